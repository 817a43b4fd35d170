"""The "Method values" part of a run report: whatever a method put in ``metrics["method_metrics"]``, as plots
and rounded tables instead of a raw JSON dump.

Methods record free-form values (``ContinualMethod.record`` appends one entry per task), so the shapes are
recognised, not the names; a new method's values are shown without changing this module:

- a number, string or bool                          -> a row of the "scalars" table;
- a list of numbers (one per task: P&M alpha)       -> a panel of the per-task plot and a row of its table;
- a list of {name: number} (SD-LoRA magnitudes, HALRP ranks, GPM basis sizes, InfLoRA's [dim, kind])
                                                    -> a plot with one line per name, and a names x tasks table;
- a {name: number} dict                             -> a two-column table;
- anything else (a list of records like SD-LoRA-KD's residuals, nested dicts)
                                                    -> a table with one row per record (or per dotted path).

Every number is rounded (:func:`~clmerge.report.elements.format_value`: ints exact, floats to 4 significant
digits), and every plot is drawn by :func:`~clmerge.report.plots.value_panels`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from clmerge.report import plots
from clmerge.report.elements import MISSING, details, format_value, img, is_number, table

__all__ = ["method_values_html", "classify_value", "numeric_part"]

MAX_ROWS = 400  # a table longer than this is cut, with a note saying how many rows were left out
OPEN_ROWS = 30  # tables up to this many rows are shown open; longer ones are collapsed
MAX_COLUMNS = 8  # a list of records with more fields than this is shown transposed


def _number_or_none(value: Any) -> bool:
    return value is None or is_number(value)


def numeric_part(value: Any) -> float | int | None:
    """The number a value stands for: itself, or the first item of ``[number, label...]`` (InfLoRA's
    ``[dimension, "remove"]``); ``None`` when there is none."""
    if is_number(value):
        return value
    if (isinstance(value, (list, tuple)) and value and is_number(value[0])
            and not any(is_number(v) or isinstance(v, (list, tuple, Mapping)) for v in value[1:])):
        return value[0]
    return None


def _plottable(value: Any) -> bool:
    return value is None or numeric_part(value) is not None


def classify_value(value: Any) -> str:
    """Which display a method value gets: ``scalar``, ``series``, ``keyed_series``, ``dict`` or ``records``."""
    if value is None or isinstance(value, (str, bool)) or is_number(value):
        return "scalar"
    if isinstance(value, (list, tuple)) and value and all(_number_or_none(v) for v in value):
        return "series" if any(is_number(v) for v in value) else "records"
    if (isinstance(value, (list, tuple)) and value and all(isinstance(v, Mapping) for v in value)
            and all(_plottable(x) for v in value for x in v.values())
            and any(numeric_part(x) is not None for v in value for x in v.values())):
        return "keyed_series"
    if isinstance(value, Mapping) and value and all(_number_or_none(v) for v in value.values()):
        return "dict"
    return "records"


def _task_headers(width: int) -> list[str]:
    return [f"task {j}" for j in range(width)]


def _series_block(series: Mapping[str, Sequence]) -> str:
    """Per-task lists of numbers: one plot (a panel each) and one table (a row each)."""
    width = max(len(v) for v in series.values())
    panels = {name: {name: list(values)} for name, values in series.items()}
    rows = [[name, *(format_value(v) for v in values), *([MISSING] * (width - len(values)))]
            for name, values in series.items()]
    picture = _plot(lambda: plots.value_panels(panels), "per-task method values")
    return picture + table(["value", *_task_headers(width)], rows)


def _keyed_series_block(name: str, entries: Sequence[Mapping[str, Any]]) -> str:
    """A list (one per task) of {name: number}: a line per name over tasks, and a names x tasks table."""
    keys: list[str] = []
    for entry in entries:
        keys += [str(k) for k in entry if str(k) not in keys]
    lines = {k: [_get(entry, k) for entry in entries] for k in keys}
    numbers = {k: [numeric_part(v) for v in vs] for k, vs in lines.items()}
    picture = _plot(lambda: plots.value_panels({name: numbers}), name)
    rows = [[k, *(format_value(v) for v in vs)] for k, vs in lines.items()]
    return f"<h3>{escape(name)}</h3>\n" + picture + _long_table([name, *_task_headers(len(entries))], rows)


def _get(entry: Mapping[str, Any], key: str) -> Any:
    return next((v for k, v in entry.items() if str(k) == key), None)


def _records_block(name: str, value: Any) -> str:
    """Anything else: a list of records as rows x fields; other values flattened to (path, value) rows."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, Mapping) for v in value):
        fields: list[str] = []
        for entry in value:
            fields += [str(k) for k in entry if str(k) not in fields]
        if len(fields) > MAX_COLUMNS:  # many fields (one per layer): fields down, records across
            rows = [[f, *(format_value(_get(entry, f)) for entry in value)] for f in fields]
            return f"<h3>{escape(name)}</h3>\n" + _long_table([name, *(f"#{i}" for i in range(len(value)))], rows)
        rows = [[str(i), *(format_value(_get(entry, f)) for f in fields)] for i, entry in enumerate(value)]
        return f"<h3>{escape(name)}</h3>\n" + _long_table(["#", *fields], rows)
    rows = [[path, format_value(v)] for path, v in _flatten(value)]
    return f"<h3>{escape(name)}</h3>\n" + _long_table(["key", "value"], rows)


def _flatten(value: Any, path: str = "") -> list[tuple[str, Any]]:
    """(dotted path, leaf) pairs of nested dicts; lists of scalars stay whole (shown inline, rounded)."""
    if isinstance(value, Mapping) and value:
        return [pair for k, v in value.items() for pair in _flatten(v, f"{path}.{k}" if path else str(k))]
    if isinstance(value, (list, tuple)) and any(isinstance(v, (Mapping, list, tuple)) for v in value):
        return [pair for i, v in enumerate(value) for pair in _flatten(v, f"{path}[{i}]")]
    return [(path or "value", value)]


def _long_table(headers: list[str], rows: list[list[str]]) -> str:
    cut = len(rows) - MAX_ROWS
    body = table(headers, rows[:MAX_ROWS])
    if cut > 0:
        body += f'<p class="note">{cut} more row(s) not shown; metrics.json has them all.</p>'
    return details(f"table ({len(rows)} rows)", body) if len(rows) > OPEN_ROWS else body


def _plot(make, alt: str) -> str:
    try:
        return img(make(), alt)
    except (ValueError, TypeError) as exc:  # odd data: a note instead of a failed report
        return f'<p class="note">{escape(alt)}: could not be drawn ({escape(str(exc))}).</p>'


def method_values_html(values: Any) -> str:
    """The body of the report's "Method values" section ("" when there is nothing to show).

    Args:
        values: ``metrics["method_metrics"]``, any JSON value (normally a dict of name -> value).

    Returns:
        HTML: the scalars table, the per-task plot and table, then one block per other value.
    """
    if not isinstance(values, Mapping):
        values = {} if values is None else {"value": values}
    kinds = {str(k): classify_value(v) for k, v in values.items()}
    items = {str(k): v for k, v in values.items()}
    scalars = [[k, format_value(v)] for k, v in items.items() if kinds[k] == "scalar"]
    series = {k: v for k, v in items.items() if kinds[k] == "series"}
    parts = [table(["name", "value"], scalars)] if scalars else []
    if series:
        parts.append(_series_block(series))
    for k, v in items.items():
        if kinds[k] == "keyed_series":
            parts.append(_keyed_series_block(k, v))
        elif kinds[k] == "dict":
            parts.append(f"<h3>{escape(k)}</h3>\n" + _long_table([k, "value"], [[str(a), format_value(b)]
                                                                                 for a, b in v.items()]))
        elif kinds[k] == "records":
            parts.append(_records_block(k, v))
    return "\n".join(parts)
