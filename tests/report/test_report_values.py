"""Method values in the run report: plots and rounded tables, never a raw JSON dump; loss per step."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from clmerge.report import build_report, plots
from clmerge.report.elements import format_value
from clmerge.report.method_values import classify_value, method_values_html, numeric_part

IMG = re.compile(r'<img alt="([^"]*)" src="data:image/png;base64,[A-Za-z0-9+/=]+">')


def _raw_float(text: str) -> str | None:
    """A number on the page with more than 4 significant digits (a raw float dump: 0.5454831016484806)."""
    for token in re.findall(r"\d+\.\d+", IMG.sub("", text)):
        if len(token.replace(".", "").lstrip("0")) > 4:
            return token
    return None


PM = {"alpha": [1.0, 0.5454831016484806, 0.31136098896402076],
      "alpha_raw": [1.0, 0.5454831016484806, 0.31136098896402076],
      "fisher_trace": [2.421187198488118, 2.8677114278929356, 2.2260468700751836]}
SD_LORA_KD = {
    "kd": [{"task": 0, "residual": None, "absorbed": False},
           {"task": 1, "residual": 1.3756995283377618, "score": 1.3756995283377618, "absorbed": False,
            "coefficients": {"task0": 0.2317874109299938}}],
    "magnitudes": [{"task0": 1.0709031820297241}, {"task0": 1.1549564599990845, "task1": 1.1221275329589844}],
}
INFLORA = {"gpm_dims": [{"k": [1, "remove"], "v": [1, "remove"]}, {"k": [2, "remove"], "v": [3, "retain"]}]}
HALRP = {"ranks": [{"conv1": 3, "conv2": 5}, {"conv1": 2, "conv2": 4}], "warmup_loss": [0.123456789, 0.0987654321],
         "bytes_per_task": [4000, 1200]}


@pytest.mark.parametrize("value,kind", [
    (0.3, "scalar"), ("x", "scalar"), (True, "scalar"), (None, "scalar"), (7, "scalar"),
    ([1.0, None, 0.5], "series"), ([None, None], "records"), ([1, "a"], "records"),
    ([{"a": 1.0}, {"a": 2.0, "b": None}], "keyed_series"), (INFLORA["gpm_dims"], "keyed_series"),
    (SD_LORA_KD["kd"], "records"), ({"a": 1.5, "b": 2}, "dict"), ({"a": {"b": 1.0}}, "records"), ([], "records"),
])
def test_classify_value(value, kind) -> None:
    assert classify_value(value) == kind


def test_format_value_rounds_all_the_way_down() -> None:
    assert format_value(0.5454831016484806) == "0.5455"
    assert format_value(123456.789) == "1.235e+05"
    assert format_value(12345) == "12345" and format_value(True) == "true" and format_value(None) == "—"
    assert format_value({"a": [0.123456, {"b": 2.0000001}]}) == "{a: [0.1235, {b: 2}]}"
    assert format_value(float("nan")) == "nan"
    assert format_value([[[[1.0]]]]) == "[[[…]]]"
    assert numeric_part([3, "remove"]) == 3 and numeric_part([3, 4]) is None and numeric_part("3") is None


@pytest.mark.parametrize("values,images,cells", [
    (PM, 1, ["0.5455", "0.3114", "2.421", "2.868"]),
    (SD_LORA_KD, 1, ["1.071", "1.155", "1.122", "1.376", "{task0: 0.2318}", "false"]),
    (INFLORA, 1, ["[2, remove]", "[3, retain]"]),
    (HALRP, 2, ["0.1235", "0.09877", "4000", "1200"]),
    ({"fisher_mean": 0.000123456789, "note": "<b>", "nested": {"a": {"b": [0.11111111, 2]}}}, 0,
     ["0.0001235", "&lt;b&gt;", "a.b", "[0.1111, 2]"]),
])
def test_method_values_are_plots_and_rounded_tables(values, images, cells) -> None:
    html = method_values_html(values)
    assert len(IMG.findall(html)) == images
    for cell in cells:
        assert f'<td class="num">{cell}</td>' in html or f"<td>{cell}</td>" in html, cell
    assert _raw_float(html) is None
    assert "<b>" not in html


def test_keyed_series_table_is_names_by_tasks() -> None:
    html = method_values_html({"magnitudes": SD_LORA_KD["magnitudes"]})
    assert "<th>magnitudes</th><th>task 0</th><th>task 1</th>" in html
    # task1's magnitude does not exist after task 0: a gap, not a zero
    assert '<tr><td>task1</td><td class="num">—</td><td class="num">1.122</td></tr>' in html


def test_long_and_wide_values_stay_readable() -> None:
    layers = {f"layer{i}": float(i) / 3 for i in range(40)}
    html = method_values_html({"importance": [layers, layers]})
    assert "<details><summary>table (40 rows)</summary>" in html  # collapsed, still there
    wide = [{f"layer{i}": {"n": i, "kind": "keep"} for i in range(10)}]  # 10 fields, not plottable: transposed
    html = method_values_html({"wide": wide})
    assert "<th>wide</th><th>#0</th>" in html and html.count("<tr>") == 11
    assert method_values_html(None) == "" and method_values_html({}) == ""
    assert "<td>value</td>" in method_values_html(0.25)  # not a dict: shown as one scalar


def test_step_losses_accumulate_steps() -> None:
    events = [{"event": "epoch", "task": 0, "loss": 9.0}, {"event": "step", "task": 0, "steps": 4, "loss": 1.0},
              {"event": "step", "task": 0, "steps": 2, "loss": 0.5}, {"event": "step", "task": 1, "steps": 4,
                                                                       "loss": "bad"},
              {"event": "step", "task": 1, "steps": 3, "loss": 0.8}]
    assert plots.step_losses(events) == [(0, 4.0, 1.0), (0, 6.0, 0.5), (1, 9.0, 0.8)]
    assert plots.loss_curve(events).startswith(plots.PNG_SIGNATURE)
    assert plots.value_panels({"a": {"x": [1.0, None]}, "b": {f"s{i}": [i, i + 1] for i in range(20)}}).startswith(
        plots.PNG_SIGNATURE)


def test_report_plots_step_losses_and_method_values(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    metrics = {"accuracy_matrix": [[90.0, None], [80.0, 85.0]], "method_metrics": PM}
    (run / "metrics.json").write_text(json.dumps(metrics))
    events = [{"event": "step", "task": t, "steps": 2, "loss": 1.0 / (k + 1)} for t in range(2) for k in range(30)]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    text = build_report(run).read_text(encoding="utf-8")
    assert IMG.findall(text) == ["accuracy matrix", "accuracy curves", "forgetting per task", "training loss",
                                 "per-task method values"]
    assert "<h2>Method values</h2>" in text and _raw_float(text) is None
