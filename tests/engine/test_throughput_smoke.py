"""benchmarks/throughput.py: step clock, memory probe, paired ratios, and a --quick smoke."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import throughput  # noqa: E402
import throughput_report  # noqa: E402


def test_measure_cell_times_the_requested_task2_steps(tiny_cfg):
    # digits tasks of 2 classes x 40 images, batch 16: 5 full batches; 1 warm-up + 3 timed steps fit in them
    cfg = tiny_cfg(**{"train.batch_size": 16, "train.max_steps_per_epoch": 1, "run.precision": "bf16"})
    res = throughput.measure_cell({"config": cfg, "threads": 1, "warmup": 1, "steps": 3})
    assert len(res["steps"]) == 3 and all(s > 0 for s in res["steps"])
    assert res["step_s"] == sorted(res["steps"])[1]
    assert res["hook_s"]["loss"] > 0 and res["peak_bytes"] >= 0


def test_peak_memory_sees_an_allocation_inside_the_region():
    probe = throughput.PeakMemory(torch.device("cpu"))
    probe.start()
    block = torch.ones(16 * 2**20 // 4)  # 16 MiB, every page written
    peak = probe.peak_bytes()
    del block
    assert peak >= 15 * 2**20


def _cells(method: str, times: list[float], kind: str = "lora") -> list[dict]:
    return [{"suite": "net", "method": method, "kind": kind, "precision": "fp32", "round": r, "step_s": t,
             "peak_bytes": 2**20, "cpu_step_s": t,
             "hook_s": {"loss": t / 2, "before_step": 0.0, "after_step": 0.0}}
            for r, t in enumerate(times)]


def test_ratios_are_paired_within_rounds_then_the_median():
    # round ratios 1.1, 1.3, 1.2 -> median 1.2; the ratio of the medians (0.33 / 0.3 = 1.1) would mix rounds
    data = {"suites": {"net": "seq_lora"}, "machine": {"device": "cpu"},
            "cells": _cells("seq_lora", [0.3, 0.5, 0.2]) + _cells("pm", [0.33, 0.65, 0.24])}
    rows = throughput_report.summarize(data)
    pm = rows[("net", "fp32", "pm")]
    assert pm["ratio"] == pytest.approx(1.2) and pm["ratio_lo"] == pytest.approx(1.1)
    assert pm["ratio_hi"] == pytest.approx(1.3) and pm["ms"] == pytest.approx(330.0)
    assert throughput_report._verdict(pm, baseline=False) == "**fail**"
    assert rows[("net", "fp32", "seq_lora")]["ratio"] == pytest.approx(1.0)


@pytest.mark.slow
def test_quick_run_writes_the_table_json_and_plot(tmp_path):
    out = tmp_path / "t.md"
    throughput.main(["--quick", "--methods", "seq_lora,pm", "--out", str(out)])
    data = json.loads(out.with_suffix(".json").read_text())
    assert {(c["method"], c["precision"]) for c in data["cells"]} == {
        (m, p) for m in ("seq_lora", "pm") for p in ("fp32", "bf16")}
    assert all(c["step_s"] > 0 for c in data["cells"])
    text = out.read_text()
    assert "QUICK SMOKE" in text and "| seq_lora | lora |" in text and "| pm | lora |" in text
    assert "not measured" in text and out.with_suffix(".png").stat().st_size > 1000
