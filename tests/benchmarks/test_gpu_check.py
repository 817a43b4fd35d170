"""benchmarks/merging/gpu_check.py: the report's differences, and one run with the CPU forced as the device."""

from __future__ import annotations

import pytest
import torch
from bench_helpers import load_bench


def _load():
    return load_bench("merging", "gpu_check")


def test_max_abs_diff_reads_every_floating_tensor():
    gc = _load()
    a = {"w": torch.zeros(3), "i": torch.tensor([1, 2])}
    b = {"w": torch.tensor([0.0, -0.5, 0.25]), "i": torch.tensor([7, 2])}
    assert gc.max_abs_diff(a, b) == 0.5


def test_forced_cpu_run_writes_the_table(tmp_path):
    pytest.importorskip("transformers")
    gc = _load()
    out = tmp_path / "check.md"
    assert gc.main(["--tiny", "--forced-cpu", "--data", str(tmp_path / "d"), "--out", str(out)]) == 0
    text = out.read_text()
    for cell in ("merge task_arithmetic", "merge ties global", "merge dare (linear)", "extract-lora rank 16"):
        assert f"| {cell} |" in text, cell
    rows = [ln for ln in text.splitlines() if ln.startswith("| merge") or ln.startswith("| extract")]
    assert len(rows) == 6 and all(ln.rstrip().endswith("| 0 |") for ln in rows)  # the forced path is exact


def test_without_cuda_the_check_is_one_error_line(tmp_path, monkeypatch, capsys):
    gc = _load()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gc.main(["--data", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --device cuda") and not (tmp_path / "d").exists()
