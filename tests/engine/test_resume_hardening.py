"""--resume refusals (no run, missing or corrupt checkpoints, changed events, a different config) and the
checkpoint sha256 record. Every refusal must leave the file system exactly as it was."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.config import parse_config
from clmerge.engine.checkpoint import (CheckpointIntegrityError, checkpoint_record, latest_checkpoint,
                                       load_checkpoint, resume_checkpoint, save_checkpoint)
from clmerge.engine.orders import run_orders
from clmerge.engine.resume import config_differences
from clmerge.engine.run import run_experiment
from clmerge.errors import RunStateError
from conftest import tiny_config

CKPT = "task_001.safetensors"


def snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under ``root`` with the sha256 of its bytes: what a refusal must not change."""
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
            for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> tuple[dict, Path, dict]:
    """(config dict, run directory, metrics) of a finished 2-task run (keep 2 checkpoints); tests copy it."""
    data = tiny_config(**{"run.keep_checkpoints": 2})
    out = tmp_path_factory.mktemp("base") / "run"
    metrics = run_experiment(parse_config(data), out)
    return data, out, metrics


@pytest.fixture
def run_copy(finished_run, tmp_path) -> tuple[dict, Path]:
    data, out, _ = finished_run
    shutil.copytree(out, tmp_path / "run")
    return data, tmp_path / "run"


def refused(data: dict, out: Path, root: Path, match: str) -> RunStateError:
    before = snapshot(root)
    with pytest.raises(RunStateError, match=match) as info:
        run_experiment(parse_config(data), out, resume=True)
    assert snapshot(root) == before
    return info.value


def test_the_record_holds_the_sha256_of_every_kept_checkpoint(finished_run):
    _, out, _ = finished_run
    record = checkpoint_record(out)
    assert sorted(record) == ["task_000.safetensors", CKPT]
    for name, sha in record.items():
        assert hashlib.sha256((out / "checkpoints" / name).read_bytes()).hexdigest() == sha
    meta = load_checkpoint(out / "checkpoints" / CKPT, sha256=record[CKPT])[2]
    lines = (out / "events.jsonl").read_text().splitlines(keepends=True)[: meta["state"]["events_lines"]]
    assert meta["events_sha256"] == hashlib.sha256("".join(lines).encode()).hexdigest()


@pytest.mark.parametrize("make", ["missing", "empty", "foreign", "file"])
def test_resume_refuses_a_directory_without_a_run(make, tmp_path):
    out = tmp_path / "rnu"  # a mistyped --out
    if make == "empty":
        out.mkdir()
    elif make == "foreign":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    elif make == "file":
        out.write_text("not a directory")
    err = refused(tiny_config(), out, tmp_path, match="resume")
    assert str(out) in str(err) and "--out" in str(err)
    assert out.exists() == (make != "missing")  # never created


def test_resume_refuses_deleted_checkpoints_and_changes_nothing(run_copy, tmp_path):
    data, out = run_copy
    shutil.rmtree(out / "checkpoints")
    (out / "metrics.json").unlink()
    err = refused(data, out, tmp_path, match="missing")
    assert "checkpoints/task_000.safetensors" in str(err) and f"checkpoints/{CKPT}" in str(err)


def test_resume_refuses_when_only_the_newest_recorded_checkpoint_is_gone(run_copy, tmp_path):
    data, out = run_copy
    (out / "checkpoints" / CKPT).unlink()  # the older one is still there: no silent fall-back to it
    err = refused(data, out, tmp_path, match=f"checkpoints/{CKPT}")
    assert "task_000" not in str(err)


def test_resume_refuses_a_bit_flipped_checkpoint_naming_it(run_copy, tmp_path):
    data, out = run_copy
    path = out / "checkpoints" / CKPT
    raw = bytearray(path.read_bytes())
    mid = len(raw) // 2
    raw[mid:mid + 1024] = bytes(b ^ 0x5A for b in raw[mid:mid + 1024])  # ~1 KB inside the tensor data
    path.write_bytes(bytes(raw))
    err = refused(data, out, tmp_path, match="sha256 mismatch")
    assert str(path) in str(err)
    with pytest.raises(CheckpointIntegrityError):  # the export path verifies too
        from clmerge.engine.export import load_run_model

        load_run_model(out)


@pytest.mark.parametrize("edit", ["drop_first_line", "change_a_value", "delete"])
def test_resume_refuses_an_edited_or_lost_events_log(edit, run_copy, tmp_path):
    data, out = run_copy
    events = out / "events.jsonl"
    text = events.read_text()
    if edit == "delete":
        events.unlink()
    elif edit == "drop_first_line":
        events.write_text("".join(text.splitlines(keepends=True)[1:]))
    else:
        events.write_text(text.replace('"task": 0', '"task": 7', 1))
    refused(data, out, tmp_path, match="events.jsonl")


def test_config_mismatch_lists_each_key_with_both_values(run_copy, tmp_path):
    data, out = run_copy
    given = {**data, "optim": {"lr": 0.005}, "seed": 3}
    err = refused(given, out, tmp_path, match="different config")
    lines = str(err).splitlines()
    assert len(lines) <= 3
    assert "optim.lr: 0.01 (run) != 0.005 (given)" in lines[-1] and "seed: 0 (run) != 3 (given)" in lines[-1]
    assert "2 keys differ" in lines[0]


def test_config_mismatch_with_many_keys_stays_short(run_copy, tmp_path):
    data, out = run_copy
    given = tiny_config(**{"optim.lr": 0.5, "seed": 9, "train.epochs": 1, "train.batch_size": 8,
                           "method.rank": 3, "run.keep_checkpoints": 2})
    err = refused(given, out, tmp_path, match="different config")
    assert len(str(err).splitlines()) <= 3 and "; and 2 more" in str(err) and "5 keys differ" in str(err)


def test_config_differences_names_added_and_removed_keys():
    diffs = config_differences({"a": {"b": 1, "c": "x"}, "d": True}, {"a": {"b": 1.5}, "d": 1, "e": None})
    assert diffs == ["a.b: 1 (run) != 1.5 (given)", "a.c: 'x' (run) != (absent) (given)",
                     "d: true (run) != 1 (given)", "e: (absent) (run) != null (given)"]
    assert config_differences({"x": float("nan")}, {"x": float("nan")}) == []


def test_a_run_killed_before_its_first_checkpoint_restarts(finished_run, tmp_path):
    """Recorded: no checkpoint yet (``"checkpoints": {}``): the legitimate restart from task 0."""
    data, base, metrics = finished_run
    out = tmp_path / "run"
    out.mkdir()
    shutil.copy(base / "config.yaml", out / "config.yaml")
    manifest = json.loads((base / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "checkpoints": {}}))
    (out / "events.jsonl").write_text((base / "events.jsonl").read_text().splitlines(keepends=True)[0])
    resumed = run_experiment(parse_config(data), out, resume=True)
    assert resumed["accuracy_matrix"] == metrics["accuracy_matrix"]
    assert (out / "events.jsonl").read_text().count("task_end") == 2


def test_old_run_without_hashes_resumes_with_one_warning_and_adopts_them(finished_run, run_copy, caplog):
    data, out = run_copy
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["checkpoints"]  # as written before checkpoints were hashed
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "checkpoints" / CKPT).unlink()  # killed during task 1
    (out / "metrics.json").unlink()
    with caplog.at_level(logging.WARNING, logger="clmerge.engine"):
        resumed = run_experiment(parse_config(data), out, resume=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "task_000.safetensors" in warnings[0] and "\n" not in warnings[0]
    assert resumed["accuracy_matrix"] == finished_run[2]["accuracy_matrix"]
    assert sorted(checkpoint_record(out)) == ["task_000.safetensors", CKPT]


def test_old_run_with_finished_tasks_but_no_checkpoints_is_refused(run_copy, tmp_path):
    data, out = run_copy
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["checkpoints"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    shutil.rmtree(out / "checkpoints")
    refused(data, out, tmp_path, match="2 finished task")


def test_an_unrecorded_checkpoint_is_ignored_and_pruning_updates_the_record(tmp_path):
    """Written but not recorded = a run killed between the two writes: resume takes the recorded one."""
    (tmp_path / "manifest.json").write_text("{}")
    w = {"w": torch.arange(4.0)}
    for t in range(3):
        save_checkpoint(tmp_path, t, w, {}, {"task": t}, keep=2)
    assert sorted(checkpoint_record(tmp_path)) == ["task_001.safetensors", "task_002.safetensors"]
    assert not (tmp_path / "checkpoints" / "task_000.safetensors").exists()
    ckdir = tmp_path / "checkpoints"
    shutil.copy(ckdir / "task_002.safetensors", ckdir / "task_003.safetensors")
    assert latest_checkpoint(tmp_path).name == "task_002.safetensors"
    path, sha = resume_checkpoint(tmp_path)
    assert path.name == "task_002.safetensors" and sha == checkpoint_record(tmp_path)[path.name]


def test_cli_resume_of_a_mistyped_directory_is_one_clean_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config()))
    out = tmp_path / "runs" / "typo"
    r = CliRunner().invoke(app, ["run", str(cfg), "--out", str(out), "--resume"])
    assert r.exit_code != 0 and "no such run directory" in r.output and "Traceback" not in r.output
    assert not out.exists() and not out.parent.exists()


def test_orders_resume_of_a_missing_directory_is_refused(tmp_path):
    with pytest.raises(RunStateError, match="no such run directory"):
        run_orders(parse_config(tiny_config()), tmp_path / "nothing", 2, resume=True)
    assert list(tmp_path.iterdir()) == []


def test_a_corrupt_cached_expert_is_refused_and_an_unhashed_one_loads(tmp_path):
    from clmerge.harness.merge_bench_experts import load_cached_expert
    from clmerge.utils.io import save_tensors, write_json

    path = tmp_path / "task-0123.safetensors"
    sd = {"backbone.w": torch.arange(600.0), "head.b": torch.ones(3)}
    write_json(path.with_suffix(".json"), {"sha256": "cfg", "file_sha256": save_tensors(path, sd)})
    assert torch.equal(load_cached_expert(path)["backbone.w"], sd["backbone.w"])
    raw = bytearray(path.read_bytes())
    raw[-1024:] = bytes(b ^ 0xFF for b in raw[-1024:])
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointIntegrityError, match=f"{path.name}: sha256 mismatch.*delete it"):
        load_cached_expert(path)
    write_json(path.with_suffix(".json"), {"sha256": "cfg"})  # cached before hashes were recorded
    save_tensors(path, sd)
    assert torch.equal(load_cached_expert(path)["head.b"], sd["head.b"])


def test_study_resume_refuses_a_missing_directory_and_names_a_changed_spec(tmp_path):
    from clmerge.sweep.study import run_study
    from clmerge.theory.spec import load_study

    spec = load_study(Path(__file__).resolve().parents[2] / "benchmarks" / "study_smoke.yaml", [])
    with pytest.raises(RunStateError, match="no study to resume"):
        run_study(spec, tmp_path / "typo", resume=True, log=lambda *_: None)
    assert not (tmp_path / "typo").exists()
    out = tmp_path / "study"
    out.mkdir()
    other = spec.model_copy(update={"name": "renamed"})
    (out / "study.yaml").write_text(yaml.safe_dump(spec.model_dump(), sort_keys=False))
    before = snapshot(tmp_path)
    with pytest.raises(RunStateError, match="differs from the spec") as info:
        run_study(other, out, resume=True, log=lambda *_: None)
    assert f"name: {spec.name!r} (run) != 'renamed' (given)" in str(info.value)
    assert snapshot(tmp_path) == before


def test_study_resume_may_add_seeds_and_nothing_else(tmp_path):
    """Growing a study seed by seed keeps the finished points; dropping a seed, or adding one together with any
    other change, is refused as before."""
    from clmerge.sweep.study import _prepare
    from clmerge.theory.spec import expand_points, load_study

    spec = load_study(Path(__file__).resolve().parents[2] / "benchmarks" / "study_smoke.yaml", [])
    out = tmp_path / "study"
    out.mkdir()
    (out / "study.yaml").write_text(yaml.safe_dump(spec.model_dump(), sort_keys=False))
    first = expand_points(spec)[0]
    (out / "results.jsonl").write_text(json.dumps({"point_id": first.id, "merged_loss": 1.0}) + "\n")
    more = spec.model_copy(update={"seeds": [*spec.seeds, max(spec.seeds) + 1]})
    assert _prepare(out, more, resume=True) == {first.id}
    assert first.id in {p.id for p in expand_points(more)}  # a finished point keeps its id in the grown study
    assert yaml.safe_load((out / "study.yaml").read_text())["seeds"] == more.seeds
    with pytest.raises(RunStateError, match="it may only add seeds"):
        _prepare(out, spec, resume=True)  # the grown study back to fewer seeds: a seed dropped
    both = more.model_copy(update={"seeds": [*more.seeds, max(more.seeds) + 1], "name": "renamed"})
    with pytest.raises(RunStateError, match=r"name: .* \(run\) != 'renamed' \(given\)"):
        _prepare(out, both, resume=True)


def test_a_run_from_before_a_key_existed_resumes_at_its_default(tmp_path):
    """run.precision, train.num_workers and train.pin_memory were added after runs existed: a stored config
    without them matches a given one that keeps their defaults, and not one that changes them."""
    import yaml

    from clmerge.config import dump_config
    from clmerge.engine.checkpoint import ResumeError
    from clmerge.engine.resume import check_same_config

    text = dump_config(parse_config(tiny_config()))
    old = yaml.safe_load(text)
    del old["run"]["precision"], old["train"]["num_workers"], old["train"]["pin_memory"], old["train"]["fast_jpeg"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    check_same_config(tmp_path / "config.yaml", text)
    changed = dump_config(parse_config(tiny_config(**{"run.precision": "bf16"})))
    with pytest.raises(ResumeError, match=r"\(1 key differs\).*\nrun.precision: 'fp32' \(run\) != 'bf16' \(given\)"):
        check_same_config(tmp_path / "config.yaml", changed)
