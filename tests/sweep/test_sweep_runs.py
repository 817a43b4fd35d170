"""``clmerge sweep`` and ``clmerge run --seeds`` end to end on tiny digits runs (clmerge.sweep.runner).

A 3 methods x 2 seeds sweep runs, is interrupted inside a cell, resumes that cell from its checkpoint to the
numbers of an uninterrupted sweep, and skips the finished cells.
"""

from __future__ import annotations

import json
import operator
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.sweep.executors import LocalExecutor
from clmerge.sweep.runner import run_sweep
from clmerge.sweep.grid import spec_from_dict

from conftest import tiny_config
from executor_helpers import FakeRay

METHODS = ["seq_lora", "pm", "sd_lora"]
CELLS = [f"{m}-seed{s}" for m in METHODS for s in (0, 1)]


@pytest.fixture()
def ws(tmp_path, monkeypatch):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_config(**{"train.epochs": 1})))
    _spec(tmp_path / "spec.yaml", seeds=[0, 1])
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _spec(path: Path, seeds: list[int], methods: list[str] = METHODS) -> None:
    path.write_text(yaml.safe_dump({"base": "tiny.yaml", "set": {"scenario.n_tasks": 2},
                                    "grid": {"method.name": methods, "seed": seeds}}))


def _invoke(*argv: str):
    return CliRunner().invoke(app, list(argv))


def _metrics(run: Path) -> list:
    return json.loads((run / "metrics.json").read_text())["accuracy_matrix"]


def _interrupt_pm_in_task_1(monkeypatch):
    """Ctrl-C inside the second task of the first ``pm`` cell (after its first checkpoint)."""
    from clmerge.methods import METHODS as REGISTRY

    cls = REGISTRY["pm"]
    original = cls.end_task

    def interrupted(self, task, ctx):
        if task.index == 1:
            raise KeyboardInterrupt
        return original(self, task, ctx)

    monkeypatch.setattr(cls, "end_task", interrupted)
    return lambda: monkeypatch.setattr(cls, "end_task", original)


def test_three_methods_two_seeds_run_resume_after_an_interrupt_and_skip_finished_cells(ws, monkeypatch):
    ref = _invoke("sweep", "spec.yaml", "--out", "ref")
    assert ref.exit_code == 0, ref.output
    restore = _interrupt_pm_in_task_1(monkeypatch)
    first = _invoke("sweep", "spec.yaml", "--out", "sw")
    assert first.exit_code == 130 and "clmerge sweep spec.yaml --out sw --resume" in first.stderr
    assert (ws / "sw/pm-seed0/checkpoints/task_000.safetensors").is_file()
    assert not (ws / "sw/pm-seed0/metrics.json").exists() and not (ws / "sw/pm-seed1").exists()
    done = {c: (ws / "sw" / c / "metrics.json").stat().st_mtime_ns for c in CELLS[:2]}
    restore()
    assert _invoke("sweep", "spec.yaml", "--out", "sw").exit_code == 5  # a sweep is there: --resume
    second = _invoke("sweep", "spec.yaml", "--out", "sw", "--resume")
    assert second.exit_code == 0, second.output
    assert "2 already done, 4 to run" in second.stdout
    assert {c: (ws / "sw" / c / "metrics.json").stat().st_mtime_ns for c in CELLS[:2]} == done  # skipped
    for cell in CELLS:
        assert _metrics(ws / "sw" / cell) == _metrics(ws / "ref" / cell), cell
    cells = json.loads((ws / "sw/cells.json").read_text())
    assert list(cells) == CELLS and {c["status"] for c in cells.values()} == {"done"}
    assert cells["pm-seed1"]["overrides"] == {"method.name": "pm", "seed": 1}
    assert yaml.safe_load((ws / "sw/sweep.yaml").read_text())["grid"]["seed"] == [0, 1]
    assert yaml.safe_load((ws / "sw/pm-seed1/config.yaml").read_text())["seed"] == 1


def test_resume_may_add_cells_but_not_change_the_sweep(ws):
    _spec(ws / "one.yaml", seeds=[0], methods=["seq_lora"])
    assert _invoke("sweep", "one.yaml", "--out", "sw").exit_code == 0
    _spec(ws / "more.yaml", seeds=[0, 1], methods=["seq_lora"])
    more = _invoke("sweep", "more.yaml", "--out", "sw", "--resume")
    assert more.exit_code == 0 and "1 already done, 1 to run" in more.stdout, more.output
    _spec(ws / "fewer.yaml", seeds=[1], methods=["seq_lora"])
    before = sorted(str(p) for p in (ws / "sw").rglob("*"))
    fewer = _invoke("sweep", "fewer.yaml", "--out", "sw", "--resume")
    assert fewer.exit_code == 4 and "seq_lora-seed0" in fewer.stderr and "only add" in fewer.stderr
    assert sorted(str(p) for p in (ws / "sw").rglob("*")) == before


def test_resume_refuses_a_base_file_edited_since_the_cells_ran(ws):
    _spec(ws / "one.yaml", seeds=[0], methods=["seq_lora"])
    assert _invoke("sweep", "one.yaml", "--out", "sw").exit_code == 0
    (ws / "tiny.yaml").write_text(yaml.safe_dump(tiny_config(**{"train.epochs": 1, "optim.lr": 0.5})))
    before = sorted((str(p), p.stat().st_mtime_ns) for p in (ws / "sw").rglob("*"))
    result = _invoke("sweep", "one.yaml", "--out", "sw", "--resume")
    assert result.exit_code == 4 and "seq_lora-seed0" in result.stderr and "optim.lr" in result.stderr, result.stderr
    assert sorted((str(p), p.stat().st_mtime_ns) for p in (ws / "sw").rglob("*")) == before


def test_dry_run_checks_every_cell_and_creates_nothing(ws):
    before = sorted(p.name for p in ws.iterdir())
    result = _invoke("sweep", "spec.yaml", "--out", "sw", "--dry-run")
    assert result.exit_code == 0, result.output
    assert [ln.split()[0] for ln in result.stdout.splitlines()[:6]] == CELLS
    assert "6 cells; every config is valid" in result.stdout
    bad = ws / "bad.yaml"
    bad.write_text(yaml.safe_dump({"base": "tiny.yaml", "grid": {"method.name": ["seq_lora", "ewc"]}}))
    before = sorted(p.name for p in ws.iterdir())
    result = _invoke("sweep", "bad.yaml", "--out", "sw", "--dry-run")  # tiny.yaml's method.rank: not ewc's
    assert result.exit_code == 2 and "cell ewc" in result.stderr and "rank" in result.stderr
    assert sorted(p.name for p in ws.iterdir()) == before


def test_a_failed_cell_does_not_stop_the_others_and_resume_retries_it(ws, monkeypatch):
    from clmerge.methods import METHODS as REGISTRY

    cls = REGISTRY["pm"]
    original = cls.end_task
    monkeypatch.setattr(cls, "end_task", lambda self, task, ctx: (_ for _ in ()).throw(RuntimeError("boom")))
    _spec(ws / "s.yaml", seeds=[0], methods=["pm", "seq_lora"])
    result = _invoke("sweep", "s.yaml", "--out", "sw")
    assert result.exit_code == 1 and "1 of 2 cells failed" in result.stderr and "boom" in result.stderr
    assert (ws / "sw/seq_lora-seed0/metrics.json").is_file()
    assert json.loads((ws / "sw/cells.json").read_text())["pm-seed0"]["status"].startswith("failed: ")
    monkeypatch.setattr(cls, "end_task", original)
    assert _invoke("sweep", "s.yaml", "--out", "sw", "--resume").exit_code == 0
    assert (ws / "sw/pm-seed0/metrics.json").is_file()


def test_a_plugin_method_can_be_swept(ws):
    from clmerge.methods.base import METHODS as REGISTRY

    (ws / "my_plugin.py").write_text(
        "from clmerge.methods.seq_lora import SeqLoRA\nfrom clmerge.methods.base import register_method\n\n\n"
        "@register_method\nclass MySeq(SeqLoRA):\n    name = 'my_seq_sweep'\n    description = 'a plugin'\n")
    _spec(ws / "s.yaml", seeds=[0], methods=["my_seq_sweep"])
    try:
        result = _invoke("sweep", "s.yaml", "--plugin", "my_plugin.py", "--out", "sw")
    finally:
        REGISTRY.unregister("my_seq_sweep")
    assert result.exit_code == 0, result.output
    assert (ws / "sw/my_seq_sweep-seed0/metrics.json").is_file()


def test_run_seeds_writes_one_run_per_seed(ws):
    result = _invoke("run", "tiny.yaml", "--set", "train.epochs=1", "--seeds", "0,2", "--out", "r")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (ws / "r").iterdir()) == ["cells.json", "seed0", "seed2", "sweep.yaml"]
    assert yaml.safe_load((ws / "r/seed2/config.yaml").read_text())["seed"] == 2
    assert yaml.safe_load((ws / "r/sweep.yaml").read_text())["set"] == {"train.epochs": 1}


def test_the_local_pool_runs_jobs_in_other_processes():
    """``LocalExecutor(workers)``, what ``--jobs N`` uses: a job runs in a spawned process, a future passed as an
    argument (alone or in a list) is resolved before the job is sent, ``wait_any`` returns a finished handle. A
    stdlib function keeps the spawned worker cheap; a whole sweep through the pool is the slow test below."""
    ex = LocalExecutor(1)
    try:
        pid = ex.submit(os.getpid)
        total = ex.submit(operator.add, ex.submit(operator.mul, 2, 3), 4)
        listed = ex.submit(sum, [total, 1])
        assert ex.result(ex.wait_any([listed])) == 11 and ex.result(total) == 10
        assert ex.result(pid) != os.getpid()
    finally:
        ex.close()


@pytest.mark.slow  # two spawned workers import torch and run a cell each: ~14 CPU s; the pool alone is above
def test_library_call_with_a_process_pool(ws):
    spec = spec_from_dict({"base": "tiny.yaml", "grid": {"seed": [0, 1]}})
    status = run_sweep(spec, ws / "pool", jobs=2, log=lambda line: None)
    assert status == {"seed0": "done", "seed1": "done"}
    assert _metrics(ws / "pool/seed0") and _metrics(ws / "pool/seed1")


def test_ray_backend_gives_the_local_numbers(ws, monkeypatch):
    """The real ``RayExecutor`` on an in-process Ray stand-in: every cell through pickled Ray tasks."""
    fake = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    spec = spec_from_dict({"base": "tiny.yaml", "grid": {"method.name": ["seq_lora", "pm"]}})
    assert run_sweep(spec, ws / "local", log=lambda line: None) == {"seq_lora": "done", "pm": "done"}
    result = _invoke("sweep", "spec.yaml", "--out", "ray", "--backend", "ray", "--dry-run")
    assert result.exit_code == 0 and fake.calls == 0  # a dry run starts no cluster
    assert run_sweep(spec, ws / "ray", backend="ray", log=lambda line: None) == {"seq_lora": "done", "pm": "done"}
    assert fake.calls == 2 and not fake.initialized  # one task per cell; the cluster shut down
    for cell in ("seq_lora", "pm"):
        assert _metrics(ws / "ray" / cell) == _metrics(ws / "local" / cell)


@pytest.mark.slow  # real processes: a sweep killed with SIGKILL inside a cell, then resumed
def test_sigkill_then_resume(ws):
    cfg = tiny_config(**{"train.epochs": 5, "train.max_steps_per_epoch": None, "scenario.train_per_class": 60})
    (ws / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    _spec(ws / "s.yaml", seeds=[0, 1], methods=["seq_lora"])
    cmd = [sys.executable, "-m", "clmerge", "sweep", "s.yaml", "--out", "sw"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, env=env, cwd=ws, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ck = ws / "sw/seq_lora-seed1/checkpoints/task_000.safetensors"
    deadline = time.time() + 300
    while not ck.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the sweep finished before it could be killed; make it longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = (ws / "sw/seq_lora-seed0/metrics.json").stat().st_mtime_ns
    assert not (ws / "sw/seq_lora-seed1/metrics.json").exists()
    out = subprocess.run([*cmd, "--resume"], env=env, cwd=ws, capture_output=True, text=True, check=True)
    assert "1 already done, 1 to run" in out.stdout
    assert (ws / "sw/seq_lora-seed0/metrics.json").stat().st_mtime_ns == done
    assert (ws / "sw/seq_lora-seed1/metrics.json").is_file()
