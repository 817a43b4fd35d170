"""The CLIP merging benchmark end to end on a tiny random CLIP, perturbed vision towers as experts and
look-alike test splits written here (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.data.clip_classnames import CLIP_CLASSNAMES, CLIP_TEMPLATES
from clmerge.data.clip_tasks import CLIP_SUITES, clip_test_files, write_clip_lookalike
from clmerge.harness.merge_bench_clip import CLIP_HPARAMS, run_clip_bench
from clmerge.utils.io import read_json

from clip_helpers import perturbed_experts, tiny_clip

DS = ["mnist", "eurosat", "svhn"]


@pytest.fixture(scope="module")
def clipws(tmp_path_factory):
    root = tmp_path_factory.mktemp("clip")
    tiny_clip(root / "clip", DS)
    perturbed_experts(root / "clip", root / "experts", DS, 1.0)
    write_clip_lookalike(root / "data", DS, per_class=3)
    return root


def _run(ws: Path, out: str, **kw) -> dict:
    return run_clip_bench(ws / out, suite="clip-ta8", clip=str(ws / "clip"), data_root=ws / "data",
                          experts=str(ws / "experts" / "{dataset}"), log=lambda *_: None, **kw)


def test_suites_follow_fusionbench_lists():
    assert CLIP_SUITES["clip-ta8"] == ("sun397", "stanford-cars", "resisc45", "eurosat", "svhn", "gtsrb", "mnist",
                                       "dtd")
    assert CLIP_SUITES["clip-tall14"][8:] == ("oxford_flowers102", "pcam", "fer2013", "oxford-iiit-pet", "stl10",
                                              "cifar100")
    assert len(CLIP_SUITES["clip-tall20"]) == 20
    sizes = {"sun397": 397, "stanford-cars": 196, "resisc45": 45, "gtsrb": 43, "dtd": 47, "cifar100": 100,
             "oxford_flowers102": 102, "food101": 101, "oxford-iiit-pet": 37, "emnist_letters": 26}
    assert {d: len(CLIP_CLASSNAMES[d]) for d in sizes} == sizes
    assert all("{}" in t for ts in CLIP_TEMPLATES.values() for t in ts)


def test_cli_writes_per_dataset_and_table1_shaped_tables(clipws):
    out = clipws / "cli"
    res = CliRunner().invoke(app, ["merge-bench", "--suite", "clip-ta8", "--clip", str(clipws / "clip"),
                                   "--experts", str(clipws / "experts" / "{dataset}"), "--data-root",
                                   str(clipws / "data"), "--datasets", ",".join(DS), "--out", str(out)])
    assert res.exit_code == 0, res.output
    per = (out / "clip-ta8" / "results.md").read_text().splitlines()
    header = [c.strip() for c in per[2].strip("|").split("|")]
    assert header == ["method", "eurosat", "svhn", "mnist", "avg (abs.)", "normalized", "hyperparameters"]
    rows = [r.split("|")[1].strip() for r in per[4:] if r.startswith("|")]
    assert rows == ["zero-shot (pretrained CLIP)", "individual experts", *CLIP_HPARAMS]
    t1 = (out / "table1.md").read_text().splitlines()
    assert [c.strip() for c in t1[0].strip("|").split("|")][1:] == [
        f"{n} tasks {k}" for n in (8, 14, 20) for k in ("abs.", "norm.")]
    assert len([r for r in t1 if r.startswith("| ")]) == 1 + 2 + len(CLIP_HPARAMS)
    assert "| task_arithmetic | " in "\n".join(t1) and "—" in t1[3]
    assert len(list((out / "heads").glob("*.safetensors"))) == 3  # one cached head per dataset


def test_task_arithmetic_of_one_expert_at_scaling_one_is_that_expert(clipws):
    out = clipws / "one"
    res = CliRunner().invoke(app, ["merge-bench", "--suite", "clip-ta8", "--clip", str(clipws / "clip"),
                                   "--experts", str(clipws / "experts" / "{dataset}"), "--data-root",
                                   str(clipws / "data"), "--datasets", "svhn", "--method", "task_arithmetic",
                                   "--hp", "task_arithmetic.scaling=1.0", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rows = read_json(out / "clip-ta8" / "results.json")["rows"]
    assert rows["task_arithmetic"]["hp"] == {"scaling": 1.0}
    assert rows["individual"]["test"] != rows["zero-shot"]["test"]  # the check below is not trivially true
    assert rows["task_arithmetic"]["test"] == rows["individual"]["test"]
    assert rows["task_arithmetic"]["normalized"] == pytest.approx(100.0)
    three = _run(clipws, "three", datasets=DS, methods=["weight_average"])  # each dataset scored by its expert
    ind = dict(zip(three["datasets"], three["rows"]["individual"]["test"]))
    assert ind["svhn"] == rows["individual"]["test"][0]
    assert len(set(ind.values())) > 1


def test_normalized_is_absolute_over_individual_and_heads_are_cached(clipws):
    r = _run(clipws, "norm", datasets=DS, methods=["weight_average", "ties"], max_eval=20)
    ind = r["rows"]["individual"]["test"]
    for row in r["rows"].values():
        want = 100 * sum(a / i for a, i in zip(row["test"], ind)) / len(ind)
        assert row["normalized"] == pytest.approx(want)
        assert row["avg"] == pytest.approx(sum(row["test"]) / len(ind))
    assert r["sizes"] == {d: 20 for d in r["datasets"]}
    again = _run(clipws, "norm", datasets=DS, methods=["weight_average", "ties"], max_eval=20, batch_size=7)
    assert again["rows"] == r["rows"]  # cached heads and batches that straddle classes change nothing


def test_class_folders_may_be_labels_or_names(tmp_path):
    write_clip_lookalike(tmp_path, ["eurosat"], per_class=1, max_classes=2)
    (tmp_path / "eurosat" / "test" / "1").rename(tmp_path / "eurosat" / "test" / "forest")
    assert [y for _, y in clip_test_files(tmp_path, "eurosat")] == [0, 1]
    (tmp_path / "eurosat" / "test" / "cats").mkdir()
    with pytest.raises(ValueError, match="cats"):
        clip_test_files(tmp_path, "eurosat")
