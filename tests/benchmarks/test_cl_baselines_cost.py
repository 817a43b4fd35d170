"""benchmarks/throughput.py's cost columns (kept state, trainable parameters, inference time per batch, the
first-task and no-step cells) and benchmarks/cl_baselines_cost.py's table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import cl_baselines_cost  # noqa: E402
import throughput  # noqa: E402


def _job(cfg: dict, **kw) -> dict:
    return {"config": cfg, "threads": 1, "warmup": 1, "steps": 2, "inference_reps": 1, **kw}


def test_a_rehearsal_cell_reports_its_buffer_params_and_inference_time(tiny_cfg):
    # digits tasks of 2 classes x 40 images, batch 16: 5 full batches, 1 warm-up + 2 timed steps fit in them
    cfg = tiny_cfg(**{"method": {"name": "er", "buffer_size": 12}})
    res = throughput.measure_cell(_job(cfg))
    assert len(res["steps"]) == 2 and res["timed_task"] == 2
    # 12 buffered 8x8 digits images (float32) and their int64 labels
    assert res["method_state_bytes"] == 12 * (8 * 8 * 4 + 8)
    model = sum(p.numel() for p in _model(cfg).parameters())
    assert res["trainable"] >= model  # er trains the whole backbone and the head (grown by task 2's classes)
    assert res["infer_batch_s"] > 0 and res["infer_batches"] == 6  # 2 tasks x 40 test images, batch 16
    assert res["head_state_bytes"] == 0 and res["model_bytes"] > 0


def _model(cfg: dict):
    from clmerge.config import parse_config
    from clmerge.engine.run import prepare

    return prepare(parse_config(cfg))[1]


def test_a_frozen_backbone_cell_has_no_step_but_its_head_statistics(tiny_cfg):
    res = throughput.measure_cell(_job(tiny_cfg(**{"method": {"name": "simplecil"}})))
    assert res["no_step"] and "step_s" not in res and res["trainable"] == 0
    assert res["head_state_bytes"] > 0 and res["infer_batch_s"] > 0


def test_a_first_task_method_is_timed_on_task_1_and_still_reports_two_tasks(tiny_cfg):
    res = throughput.measure_cell(_job(tiny_cfg(**{"method": {"name": "aper"}}), timed_task=0))
    assert res["timed_task"] == 1 and len(res["steps"]) == 2 and res["trainable"] > 0
    assert res["infer_batches"] == 6


def test_the_step_clock_with_a_last_step_callback_stops_stamping_instead_of_raising():
    class M:
        def loss(self, *a):
            return 0.0

        def before_step(self, *a):
            pass

        def after_step(self, *a):
            pass

    calls = []
    m = M()
    clock = throughput.StepClock(m, 2, torch.device("cpu"), on_last=lambda: calls.append(1))
    for _ in range(4):
        m.after_step(None)
    assert len(clock.stamps) == 2 and calls == [1]


def _cell(method: str, r: int, step, *, peak=100, infer=0.1, state=0, heads=0, model=1000, **kw) -> dict:
    cell = {"suite": "vit-tiny-fmnist", "method": method, "kind": "k", "precision": "fp32", "round": r,
            "peak_bytes": peak, "infer_batch_s": infer, "trainable": 10, "method_state_bytes": state,
            "head_state_bytes": heads, "model_bytes": model, "hook_s": {}, **kw}
    if step is None:
        return {**cell, "no_step": True}
    return {**cell, "step_s": step * 3, "cpu_step_s": step}


def test_cost_rows_pair_ratios_within_rounds_and_count_only_the_extra_state():
    cells = [_cell("seq_lora", 0, 0.2), _cell("seq_lora", 1, 0.4),
             _cell("er", 0, 0.4, state=2e6, peak=300, infer=0.3), _cell("er", 1, 0.4, state=2e6, peak=200),
             _cell("ease", 0, 0.2, model=1000 + 5e5), _cell("ease", 1, 0.2, model=1000 + 5e5),
             _cell("simplecil", 0, None, heads=1e6), {"suite": "vit-tiny-fmnist", "method": "mos", "round": 0,
                                                      "kind": "k", "precision": "fp32", "error": "boom"}]
    rows = cl_baselines_cost.summarize({"machine": {"device": "cpu"}, "cells": cells})
    assert rows["er"]["step_ratio"] == "1.50 (1.00-2.00)"  # rounds 2.0 and 1.0; not 0.4 / 0.3
    assert rows["er"]["extra_mb"] == pytest.approx(2.0) and rows["er"]["peak_ratio"] == "2.50 (2.00-3.00)"
    assert rows["ease"]["extra_mb"] == pytest.approx(0.5)  # its weights beyond seq_lora's
    assert rows["simplecil"]["step_ms"] is None and rows["simplecil"]["step_ratio"] == "-"
    assert rows["simplecil"]["extra_mb"] == pytest.approx(1.0) and "mos" not in rows
    lines = cl_baselines_cost.table(rows, ["seq_lora", "er", "simplecil", "mos"])
    assert len(lines) == 5 and "no step" in lines[-1]


def test_the_cost_run_always_includes_seq_lora_as_the_baseline(tmp_path):
    c = cl_baselines_cost.parse_args(["--methods", "er,mos", "--out", str(tmp_path / "c.md")])
    a = throughput.parse_args(cl_baselines_cost.throughput_args(c))
    assert a.methods == ["seq_lora", "er", "mos"] and a.precisions == ["fp32"] and a.inference_reps == 2
    assert a.json == tmp_path / "c.json"


def test_report_only_rebuilds_the_table_from_the_json(tmp_path):
    machine = {"device": "cpu", "cpu": "x", "cores": 2, "threads": 1, "torch": "t", "load_start": [1, 2, 3],
               "load_end": [1, 2, 3], "started": "now", "seconds": 60}
    settings = {"quick": False, "batch": 64, "task1_steps": 1, "warmup": 1, "steps": 4, "rounds": 1,
                "inference_reps": 2}
    root = str(BENCH.parent) + "/"
    data = {"machine": machine, "settings": settings, "argv": f"--out {root}benchmarks/c.md",
            "cells": [_cell("seq_lora", 0, 0.2), _cell("er", 0, 0.5)]}
    (tmp_path / "c.json").write_text(__import__("json").dumps(data))
    cl_baselines_cost.main(["--report-only", "--out", str(tmp_path / "c.md")])
    text = (tmp_path / "c.md").read_text()
    assert "| er | k | 0.5" not in text and "| er | k | 500.0 | 2.50 (2.50-2.50) |" in text
    assert root not in text and "--out benchmarks/c.md" in text
