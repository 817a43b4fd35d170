"""The torch thread count of a run: recorded in manifest.json, a resume with another count warns once, and
SD-LoRA's result moves by little between 1 and 2 threads (docs/threads.md)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clmerge.config import parse_config
from clmerge.engine.run import run_experiment
from conftest import tiny_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _keep_thread_count():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_thread_run(tmp_path_factory):
    """(config dict, run directory) of a finished 2-task run at 1 thread (both checkpoints kept)."""
    before = torch.get_num_threads()
    data = tiny_config(**{"run.threads": 1, "run.keep_checkpoints": 2})
    out = tmp_path_factory.mktemp("threads") / "run"
    run_experiment(parse_config(data), out)
    torch.set_num_threads(before)
    return data, out


def _killed_in_task_1(src, tmp_path):
    """A copy of ``src`` as if it had been killed during its second task."""
    out = tmp_path / "run"
    shutil.copytree(src, out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["checkpoints"].pop("task_001.safetensors")
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "checkpoints" / "task_001.safetensors").unlink()
    (out / "metrics.json").unlink()
    return out


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_the_manifest_records_the_thread_count(one_thread_run):
    _, out = one_thread_run
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["threads"] == 1 and "threads_resumed" not in manifest


def test_resume_with_another_thread_count_warns_once_and_records_it(one_thread_run, tmp_path, caplog):
    data, src = one_thread_run
    out = _killed_in_task_1(src, tmp_path)
    data = {**data, "run": {**data["run"], "threads": 2}}  # an explicit change of run.threads is no refusal
    with caplog.at_level(logging.WARNING, logger="clmerge.engine"):
        run_experiment(parse_config(data), out, resume=True)
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert "2 torch threads" in warnings[0] and "used 1" in warnings[0]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["threads"] == 1 and manifest["threads_resumed"] == [{"task": 1, "threads": 2}]


def test_resume_with_the_same_thread_count_is_silent(one_thread_run, tmp_path, caplog):
    data, src = one_thread_run
    out = _killed_in_task_1(src, tmp_path)
    with caplog.at_level(logging.WARNING, logger="clmerge.engine"):
        run_experiment(parse_config(data), out, resume=True)
    assert _warnings(caplog) == []
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["threads"] == 1 and "threads_resumed" not in manifest


def _cli_run(out, threads: int) -> tuple[dict, list[float]]:
    """SD-LoRA on digits, 2 class-incremental tasks, linear head, every task trained, in a fresh process with
    ``OMP_NUM_THREADS`` and ``run.threads`` equal (as the CLI is used); (metrics, step losses)."""
    sets = ["method.name=sd_lora", "scenario.dataset=digits", "scenario.n_tasks=2", "train.epochs=2", "seed=3",
            "head.classifier=linear", "train.adapt_tasks=null", "run.report=false", "run.progress=false",
            f"run.threads={threads}"]
    cmd = [sys.executable, "-m", "clmerge", "run", "--out", str(out)] + [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=900)
    events = map(json.loads, (out / "events.jsonl").read_text().splitlines())
    return json.loads((out / "metrics.json").read_text()), [e["loss"] for e in events if e["event"] == "step"]


@pytest.mark.slow
def test_sd_lora_at_1_and_2_threads_differs_by_rounding_only(tmp_path):
    """The two thread counts split CPU sums differently, so the runs need not be bit-identical; over 2 tasks
    (48 steps) the step losses stay within 1e-3 of each other (measured: 2.4e-4) and the accuracies within 2
    points. The 5-task runs of docs/threads.md drift much further: that is the training's sensitivity at this
    learning rate, not the thread count (the same spread comes from the dense vs low-rank compute at 1 thread)."""
    (m1, l1), (m2, l2) = _cli_run(tmp_path / "t1", 1), _cli_run(tmp_path / "t2", 2)
    assert len(l1) == len(l2) > 0
    assert max(abs(a - b) / max(abs(a), 1e-6) for a, b in zip(l1, l2)) < 1e-3
    assert abs(m1["acc"] - m2["acc"]) <= 2 and abs(m1["til"]["acc"] - m2["til"]["acc"]) <= 2
    assert json.loads((tmp_path / "t2" / "manifest.json").read_text())["threads"] == 2
