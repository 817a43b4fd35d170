"""Tests for the self-contained HTML run report and its PNG plots."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from report_helpers import MALICIOUS, R3, full_metrics, write_run

from clmerge.report import build_report, build_sweep_report
from clmerge.report import plots

IMG_RE = re.compile(r'<img alt="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)">')


def _check_self_contained(text: str) -> None:
    assert "http://" not in text and "https://" not in text
    assert "<script" not in text.lower()
    assert "<link" not in text.lower()


def _images(text: str) -> list[str]:
    return IMG_RE.findall(text)


def test_full_report(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", full_metrics())
    out = build_report(run_dir)
    assert out == run_dir / "report.html" and out.is_file()
    text = out.read_text(encoding="utf-8")
    _check_self_contained(text)
    # heatmap, TIL heatmap, accuracy curves, forgetting bars, loss curve, the per-task method values
    assert len(_images(text)) == 6
    for value in ("84.00", "88.02", "21.55", "-21.55", "98.03", "95.83", "96.70", "84.00"):
        assert value in text
    assert "—" in text  # fwt is null
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert '<td class="num">0.6</td><td class="num">0.45</td>' in text  # method-metric list: a table row
    assert "seq_lora" in text and "mnist5k" in text and "class_incremental" in text
    assert "<pre>" in text and "vit-tiny-fmnist" in text
    assert '<td class="num">800</td>' in text and "800.00" not in text  # counts are not metrics
    assert [p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")] == []


def test_null_heavy_report_without_optional_files(tmp_path: Path) -> None:
    metrics = {key: None for key in full_metrics()}
    metrics["accuracy_matrix"] = R3
    run_dir = write_run(tmp_path / "run", metrics, extras=False)
    text = build_report(run_dir).read_text(encoding="utf-8")
    _check_self_contained(text)
    # heatmap, accuracy curves, forgetting bars (derived from the matrix); no TIL, no loss
    assert len(_images(text)) == 3
    assert text.count("—") >= 6
    assert "Training loss" not in text and "Resolved config" not in text


def test_minimal_metrics_and_torn_events(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.json").write_text(json.dumps({"accuracy_matrix": [[55.5]]}))
    torn = '{"event": "epoch", "task": 0, "epoch": 0, "loss": 0.5}\n{"event": "ep'  # killed mid-write
    (run_dir / "events.jsonl").write_text(torn)
    text = build_report(run_dir).read_text(encoding="utf-8")
    _check_self_contained(text)
    assert "1 unreadable line(s) skipped" in text
    assert len(_images(text)) == 3  # heatmap, curves, loss; a single task has no forgetting


def test_missing_metrics_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="metrics.json") as info:
        build_report(tmp_path)
    assert str(tmp_path / "metrics.json") in str(info.value)


def test_bad_matrix_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "metrics.json").write_text(json.dumps({"accuracy_matrix": [[1.0, "x"], [2.0, 3.0]]}))
    with pytest.raises(ValueError, match=r"metrics\.json.*\[0\]\[1\]"):
        build_report(tmp_path)
    (tmp_path / "metrics.json").write_text(json.dumps({"acc": 1.0}))
    with pytest.raises(ValueError, match="accuracy_matrix"):
        build_report(tmp_path)


@pytest.mark.parametrize(
    "make",
    [
        lambda: plots.accuracy_heatmap(R3, ["a", "b", "c"], "t"),
        lambda: plots.accuracy_curves(R3, None),
        lambda: plots.forgetting_bars([29.1, None], ["a"]),
        lambda: plots.loss_curve([{"event": "epoch", "task": 0, "loss": 0.3}, {"event": "merge"}]),
        lambda: plots.loss_curve([]),
        lambda: plots.multi_order_curves({"order 0": [99.0, 90.0], "order 1": [98.0, None]}),
        lambda: plots.metric_bars({"a": {"acc": 80.0, "aaa": None}}, ["acc", "aaa"]),
    ],
)
def test_plots_return_png(make) -> None:
    png = make()
    assert isinstance(png, bytes) and png.startswith(plots.PNG_SIGNATURE)


def test_sweep_report(tmp_path: Path) -> None:
    runs = {
        "order 0": full_metrics(),
        MALICIOUS: {"acc": 80.123, "aaa": None, "accuracy_curve": [99.0, 80.123]},
        "empty": {},
    }
    out = build_sweep_report(tmp_path / "sub" / "sweep.html", runs)
    text = out.read_text(encoding="utf-8")
    _check_self_contained(text)
    assert "80.12" in text and "84.00" in text and "—" in text
    assert "&lt;script&gt;" in text
    assert len(_images(text)) == 2
