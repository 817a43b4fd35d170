"""P&M records tr(F_t) per task (docs/pm.md: Eq. 8 makes alpha depend on the per-task Fisher scale)."""

from __future__ import annotations

import pytest

from clmerge.engine.checkpoint import load_checkpoint
from clmerge.engine.run import run_experiment

from _lora_cl_helpers import tiny_config


def test_fisher_trace_is_the_trace_of_each_stored_fisher(tmp_path):
    out = tmp_path / "run"
    metrics = run_experiment(tiny_config({"name": "pm", "rank": 2, "alpha_store": "per_task"}, keep=2), out)
    traces = metrics["method_metrics"]["fisher_trace"]
    _, tensors, _ = load_checkpoint(sorted((out / "checkpoints").glob("task_*.safetensors"))[-1])
    stored = [float(sum(v.double().sum() for k, v in tensors.items() if k.startswith(f"fisher{i}/")))
              for i in range(2)]
    assert len(traces) == 2 and all(t > 0 for t in traces)
    assert traces == pytest.approx(stored, rel=1e-9)
