"""Tests for the self-contained HTML run report and its PNG plots."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from clmerge.report import build_report, build_sweep_report
from clmerge.report import plots

MALICIOUS = "<script>alert(1)</script>"
R3 = [[99.1, None, None], [80.0, 98.0, None], [70.0, 85.0, 97.0]]
IMG_RE = re.compile(r'<img alt="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)">')


def _full_metrics() -> dict:
    return {
        "accuracy_matrix": R3,
        "til_accuracy_matrix": [[99.5, None, None], [95.0, 99.0, None], [93.0, 96.0, 98.5]],
        "initial_accuracy": None,
        "task_names": [MALICIOUS, "task 1", "task 2"],
        "task_sizes": [200, 200, 200],
        "acc": 84.0,
        "aaa": 88.0166,
        "forgetting": 21.55,
        "bwt": -21.55,
        "fwt": None,
        "plasticity": 98.0333,
        "accuracy_curve": [99.1, 89.0, 84.0],
        "forgetting_per_task": [29.1, 13.0],
        "acc_sample": 84.004,
        "aaa_sample": 88.0166,
        "forgetting_sample": 21.55,
        "bwt_sample": -21.55,
        "accuracy_curve_sample": [99.1, 89.0, 84.0],
        "til": {"acc": 95.8333, "aaa": 96.7, "forgetting": 5.0, "bwt": -5.0, "fwt": None, "plasticity": 99.0},
        "method": "seq_lora",
        "scenario": "class_incremental",
        "dataset": "mnist5k",
        "timings": {"total_s": 60.2, "per_task_s": [20.0, 20.1, 20.1]},
        "method_metrics": {"alpha": [1.0, 0.6, 0.45], "rank": 4, "note": MALICIOUS},
    }


def _write_run(run_dir: Path, metrics: dict, *, extras: bool = True) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.json").write_text(json.dumps(metrics))
    if not extras:
        return run_dir
    manifest = {
        "clmerge_version": "0.1.0",
        "torch": "2.13.0",
        "seed": 0,
        "class_order": [3, 1, 0, 2, 5, 4],
        "tasks": [
            {"name": MALICIOUS, "classes": [3, 1], "n_train": 800, "n_test": 200},
            {"name": "task 1: classes [0, 2]", "classes": [0, 2], "n_train": 800, "n_test": 200},
            {"name": "task 2: classes [5, 4]", "classes": [5, 4], "n_train": 800, "n_test": 200},
        ],
        "backbone": {"preset": "vit-tiny-fmnist", "sha256": "ab" * 32},
    }
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    (run_dir / "config.yaml").write_text(f"method:\n  name: seq_lora\n  comment: '{MALICIOUS}'\nseed: 0\n")
    events = [{"event": "epoch", "task": t, "epoch": e, "loss": 1.0 / (1 + e + t), "lr": 0.005}
              for t in range(3) for e in range(2)]
    events += [{"event": "task_end", "task": 0, "seconds": 12.0}, {"event": "merge", "task": 1, "alpha": 0.6},
               {"event": "something_new", "x": 1}]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run_dir


def _check_self_contained(text: str) -> None:
    assert "http://" not in text and "https://" not in text
    assert "<script" not in text.lower()
    assert "<link" not in text.lower()


def _images(text: str) -> list[str]:
    return IMG_RE.findall(text)


def test_full_report(tmp_path: Path) -> None:
    run_dir = _write_run(tmp_path / "run", _full_metrics())
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
    metrics = {key: None for key in _full_metrics()}
    metrics["accuracy_matrix"] = R3
    run_dir = _write_run(tmp_path / "run", metrics, extras=False)
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
        "order 0": _full_metrics(),
        MALICIOUS: {"acc": 80.123, "aaa": None, "accuracy_curve": [99.0, 80.123]},
        "empty": {},
    }
    out = build_sweep_report(tmp_path / "sub" / "sweep.html", runs)
    text = out.read_text(encoding="utf-8")
    _check_self_contained(text)
    assert "80.12" in text and "84.00" in text and "—" in text
    assert "&lt;script&gt;" in text
    assert len(_images(text)) == 2
