"""The merging benchmark on a tiny setting: random-init 1-layer ViT, 3 digit tasks, a few samples."""

from __future__ import annotations

import json

import pytest
import torch

from clmerge.harness import merge_bench as bench

TINY_ARCH = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cfg = bench.BenchConfig(suite="tiny", pretrained=False, arch=TINY_ARCH, epochs=1, max_train=64, max_eval=48,
                            batch_size=32)
    grids = {"weight_average": {}, "task_arithmetic": {"scaling": [0.3, 1.0]},
             "ties": {"density": [0.2], "scaling": [1.0]}, "cart": {"rank_ratio": [0.0, 0.5], "scaling": [1.0]}}
    res = bench.run_benchmark(cfg, out, grids=grids, log=lambda *_: None)
    return out, cfg, grids, res


def test_tables_and_selection_on_validation(tiny_run):
    out, cfg, grids, res = tiny_run
    md = (out / "results.md").read_text()
    for name in ("pretrained", "individual", "weight_average", "task_arithmetic", "ties", "cart"):
        assert f"| {bench.ROW_LABELS.get(name, name)} |" in md
    assert "co-trained" in md  # the protocol is stated
    saved = json.loads((out / "results.json").read_text())
    assert saved["tasks"] == ["digits-identity", "digits-rot90", "digits-invert"]
    ta = saved["search"]["task_arithmetic"]
    assert saved["rows"]["task_arithmetic"]["hp"] == max(ta, key=lambda r: r["val"])["hp"]
    assert saved["rows"]["individual"]["normalized"] == pytest.approx(100.0)


def test_experts_are_cached_with_their_config(tiny_run, monkeypatch):
    out, cfg, grids, res = tiny_run
    files = sorted((out / "experts").glob("*.safetensors"))
    assert len(files) == 3 and all(f.with_suffix(".json").exists() for f in files)
    meta = json.loads(files[0].with_suffix(".json").read_text())
    assert meta["config"]["epochs"] == 1 and len(meta["sha256"]) == 64
    monkeypatch.setattr(torch.optim, "AdamW", lambda *a, **k: (_ for _ in ()).throw(AssertionError("retrained")))
    again = bench.run_benchmark(cfg, out, grids={"weight_average": {}}, log=lambda *_: None)
    assert again["rows"]["weight_average"]["test"] == res["rows"]["weight_average"]["test"]


def test_analysis_plots_and_claims(tiny_run):
    """Rank-ratio curve, spectra and interference: PNG files, embedded in results.md, with the identities."""
    out, cfg, grids, res = tiny_run
    for name in ("rank_ratio.png", "spectra.png", "interference.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in bench.results_markdown(res)  # (results.md itself is rewritten by another test)
    a = res["analysis"]
    curve = a["rank_ratio"]
    avg, pre = res["rows"]["weight_average"]["avg"], res["rows"]["pretrained"]["avg"]
    # CART at rank 0 and full rank is weight averaging; uncentered low-rank TA at rank 0 is the pretrained model
    assert curve["cart"][0] == pytest.approx(avg) and curve["cart"][-1] == pytest.approx(avg)
    assert curve["low_rank_ta"][0] == pytest.approx(pre)
    assert len(a["interference"]["I_centered"]) == len(a["interference"]["ks"])
    assert a["spectra"]["centered"]["energy"][-1] == pytest.approx(1.0)
    md = bench.results_markdown(res)
    verdicts = [ln for ln in md.splitlines() if ln.startswith("- ") and ("holds" in ln or "does not hold" in ln)]
    assert "CART's claims" in md and len(verdicts) == 5


def test_capped_test_split_is_a_shuffled_sample():
    """With ``max_eval`` the test split is a seeded random subset, not the first (label-sorted) rows."""
    cfg = bench.BenchConfig(suite="tiny", max_train=32, max_eval=40)
    data = bench.load_task(bench.BenchTask("mnist5k", "identity"), cfg)  # its test rows are label-sorted
    assert len(data["test"][1]) == 40 and len(set(data["test"][1].tolist())) >= 5
    again = bench.load_task(bench.BenchTask("mnist5k", "identity"), cfg)
    assert torch.equal(data["test"][1], again["test"][1])


def test_class_subset_tasks_keep_only_their_classes_and_renumber():
    task = bench.parse_task("digits:rot90:3,5,7")
    assert task.spec == "digits:rot90:3,5,7" and task.name == "digits-rot90-c3,5,7"
    assert bench.parse_task(task.spec) == task
    cfg = bench.BenchConfig(max_eval=60)
    data = bench.load_task(task, cfg)
    full = bench.load_task(bench.parse_task("digits:rot90"), bench.BenchConfig())
    for split in ("train", "val", "test"):
        y = data[split][1]
        assert set(y.tolist()) == {0, 1, 2}, split
    # the subset is exactly the full split's rows of those classes, in order, labels renumbered 3->0, 5->1, 7->2
    yf = full["train"][1]
    keep = (yf == 3) | (yf == 5) | (yf == 7)
    assert torch.equal(data["train"][0], full["train"][0][keep])
    assert torch.equal(data["train"][1], torch.tensor([{3: 0, 5: 1, 7: 2}[int(v)] for v in yf[keep]]))
    assert len(data["test"][0]) == 60
    # a perturbed twin replaces one training row by a held-out row of the same classes
    twin = bench.load_task(task, bench.BenchConfig(perturb=0))
    assert set(twin["train"][1].tolist()) == {0, 1, 2}
    assert not torch.equal(twin["train"][0][0], data["train"][0][0])
    # the expert key of a task without classes is unchanged (cached experts keep their names)
    assert "classes" not in bench.BenchConfig().expert_key(bench.parse_task("digits:rot90"))["task"]
    for bad in ("digits:identity:5", "digits:identity:a-b", "digits:identity:1,1"):
        with pytest.raises(ValueError, match="classes"):
            bench.parse_task(bad)
