"""Every long per-task phase reports progress through ``clmerge.utils.progress.phase``: P&M's Fisher, InfLoRA's
input covariances, the head's training features (APER's and SimpleCIL's prototypes) and the evaluation; a run
with ``run.progress: false`` writes none of it. Here the phases' 2 s delay is 0, so even tiny ones report."""

from __future__ import annotations

import io

import pytest

import clmerge.utils.progress as progress_mod
from clmerge.config import parse_config
from clmerge.engine.run import run_experiment
from conftest import tiny_config


def _stderr_of_run(tmp_path, monkeypatch, method: dict, progress: bool = True) -> str:
    monkeypatch.setattr(progress_mod, "PHASE_DELAY", 0.0)
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)  # not a terminal: plain lines
    cfg = parse_config(tiny_config(**{"method": method, "scenario.n_tasks": 2, "train.epochs": 1,
                                      "train.max_steps_per_epoch": 1, "run.progress": progress}))
    run_experiment(cfg, tmp_path / "run")
    return err.getvalue()


@pytest.mark.parametrize("method, phase", [
    ({"name": "pm", "rank": 2}, "pm: Fisher of task 2: done"),
    ({"name": "inflora", "rank": 2}, "inflora: input covariances: done"),
    ({"name": "aper", "bottleneck": 4}, "head: training features: done"),
])
def test_long_phases_write_plain_lines(tmp_path, monkeypatch, method, phase):
    text = _stderr_of_run(tmp_path, monkeypatch, method)
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert any(ln.startswith(phase) for ln in lines), lines
    assert any(ln.startswith("evaluation (test): done") for ln in lines)


def test_run_progress_false_silences_the_phases(tmp_path, monkeypatch):
    assert _stderr_of_run(tmp_path, monkeypatch, {"name": "pm", "rank": 2}, progress=False) == ""
