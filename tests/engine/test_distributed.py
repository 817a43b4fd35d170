"""Data-parallel runs: `clmerge run --nproc 2` (torchrun, gloo, 2 CPU processes) against one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from clmerge.config import parse_config
from clmerge.engine.run import run_experiment
from clmerge.paper_configs import PAPER_DIR
from conftest import tiny_config

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
# What "equal" means between 1 and 2 processes: the summed gradient adds the same numbers in another order
# (float32 rounding), so losses and alphas agree to ~1e-6 relative, and a test prediction may flip only if
# two logits tie to that precision. Measured on these configs: identical accuracy matrices.
ACC_TOL = 1.0  # percentage points per accuracy-matrix entry
LOSS_RTOL = 1e-4


def _config(tmp_path: Path, method: dict, **extra) -> Path:
    cfg = tiny_config(**{"model.pretrained": True, "model.config": {}, "method": method,
                         "scenario.train_per_class": 40, "scenario.test_per_class": 20, "train.epochs": 1,
                         "train.max_steps_per_epoch": None, "scenario.val_fraction": 0.1, **extra})
    path = tmp_path / f"{method['name']}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(cfg: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "clmerge", "run", str(cfg), "--out", str(out), *args],
                         env=ENV, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def _steps(out: Path) -> list[float]:
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return [e["loss"] for e in events if e["event"] == "step"]


def _same(one: Path, two: Path) -> None:
    m1, m2 = (json.loads((d / "metrics.json").read_text()) for d in (one, two))
    for key in ("accuracy_matrix", "til_accuracy_matrix"):
        for r1, r2 in zip(m1[key], m2[key]):
            assert all((a is None and b is None) or abs(a - b) <= ACC_TOL for a, b in zip(r1, r2)), (key, r1, r2)
    assert _steps(one) == pytest.approx(_steps(two), rel=LOSS_RTOL)
    for name, values in m1["method_metrics"].items():  # P&M's alpha, InfLoRA's basis sizes, ...
        if isinstance(values, list) and all(isinstance(v, (int, float)) for v in values):
            assert values == pytest.approx(m2["method_metrics"][name], rel=1e-5), name


@pytest.mark.slow  # 4 real runs, two of them 2-process torchrun launches: ~60-120 s on 2 loaded cores
@pytest.mark.parametrize("method,extra", [
    ({"name": "pm", "rank": 2}, {"head.align": True}),  # alpha from Fisher sums; alignment statistics
    ({"name": "inflora", "rank": 2}, {}),  # DualGPM bases from covariances, computed once and broadcast
    ({"name": "hide_prompt", "pool_size": 2, "length": 2, "layers": [0], "tii_epochs": 2, "tii_align_epochs": 2,
      "tap_epochs": 2, "tap_samples": 8, "tii_align_samples": 8, "contrast_weight": 0.0}, {}),  # TII, TAP state
    # (HiDe's contrastive regulariser couples the batch's samples: each process takes it over its own share, as
    # the official code under DDP, so it is off here)
])
def test_two_processes_match_one_process_with_the_same_global_batch(tmp_path, method, extra):
    cfg = _config(tmp_path, method, **extra)
    _run(cfg, tmp_path / "one")
    res = _run(cfg, tmp_path / "two", "--nproc", "2")
    assert "launching 2 processes" in res.stderr
    _same(tmp_path / "one", tmp_path / "two")
    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["device"] == "cpu"
    # only process 0 wrote, and it wrote what a one-process run writes
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(p.name for p in (tmp_path / "one").iterdir())
    assert res.stdout.count("run directory:") == 1


@pytest.mark.slow
def test_a_one_process_crash_resumes_in_two_processes(tmp_path, monkeypatch):
    from clmerge.methods import METHODS

    method = {"name": "pm", "rank": 2}
    path = _config(tmp_path, method, **{"scenario.n_tasks": 3, "scenario.classes_per_task": [2, 2, 2]})
    cfg = parse_config(yaml.safe_load(path.read_text()))
    run_experiment(cfg, tmp_path / "full")
    original = METHODS["pm"].end_task

    def crash_on_task_2(self, task, ctx):
        if task.index == 2:
            raise RuntimeError("simulated crash")
        return original(self, task, ctx)

    monkeypatch.setattr(METHODS["pm"], "end_task", crash_on_task_2)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_experiment(cfg, tmp_path / "crashed")
    _run(path, tmp_path / "crashed", "--resume", "--nproc", "2")
    _same(tmp_path / "full", tmp_path / "crashed")


@pytest.mark.slow
def test_paper_config_dry_run_in_two_processes(tmp_path):
    """A ViT-B/16 paper config dry-runs data-parallel (random init, look-alike data, 2 steps per task)."""
    cfg = PAPER_DIR / "sd_lora_imagenet_r_10.yaml"
    res = subprocess.run([sys.executable, "-m", "clmerge", "run", str(cfg), "--dry-run", "--nproc", "2"],
                         env=ENV, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("dry run ok") == 1 and "2 data-parallel processes (gloo)" in res.stdout


def test_nproc_relaunch_command_drops_the_flag_and_fixes_out(monkeypatch, tmp_path):
    """`--nproc N` relaunches the same command under torchrun, without --nproc, with one --out for all."""
    from clmerge.cli import run as cli

    calls = []
    monkeypatch.setattr(sys, "argv", ["clmerge", "run", "c.yaml", "--nproc", "2", "--set", "seed=1"])
    monkeypatch.setattr(subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    with pytest.raises(cli.typer.Exit):
        cli._launch(2, tmp_path / "r")
    cmd = calls[0]
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert cmd[5:] == ["-m", "clmerge", "run", "c.yaml", "--set", "seed=1", "--out", str(tmp_path / "r")]


def test_batch_smaller_than_the_process_count_is_refused(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(**{"train.batch_size": 1})))
    res = subprocess.run([sys.executable, "-m", "clmerge", "run", str(cfg), "--out", str(tmp_path / "r"),
                          "--nproc", "2"], env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "train.batch_size=1" in res.stderr and not (tmp_path / "r").exists()
