"""Self-contained HTML reports: one page per run (``clmerge report RUN_DIR``) and the page comparing the runs
of ``clmerge run --orders`` (:func:`build_sweep_report`); the page of a sweep directory is
:mod:`clmerge.report.sweep_page`'s.

The pages embed every image as a base64 ``data:`` URI and carry their CSS inline; they contain no
JavaScript and no external links, so they open offline and can be mailed or archived as a single file.
Every string read from a run's files is HTML-escaped before it reaches the page.

Only ``metrics.json`` with an ``accuracy_matrix`` is required; every other file and field may be missing
or null, and the matching part of the report is then left out or shows "—".
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from html import escape
from pathlib import Path
from typing import Any

from clmerge.metrics import forgetting_per_task
from clmerge.report import plots
from clmerge.report.elements import MISSING, format_number
from clmerge.report.elements import format_value as _format_free
from clmerge.report.elements import img as _img, is_number as _is_number, page as _page
from clmerge.report.elements import section as _section, table as _table
from clmerge.report.method_values import method_values_html
from clmerge.errors import InputError
from clmerge.utils import inpaths
from clmerge.utils.io import atomic_write_text, read_json
from clmerge.utils.outpaths import check_writable, child
from clmerge.utils.provenance import open_run_plugins

__all__ = ["PAGE", "build_report", "build_sweep_report", "check_accuracy_matrix", "load_run", "format_number",
           "page_path"]

PAGE = "report.html"

# (label, task-weighted key, sample-weighted key or None); values are percent / percentage points.
METRIC_ROWS: tuple[tuple[str, str, str | None], ...] = (
    ("Final accuracy (Acc)", "acc", "acc_sample"),
    ("Average anytime accuracy (AAA)", "aaa", "aaa_sample"),
    ("Average forgetting", "forgetting", "forgetting_sample"),
    ("Backward transfer (BWT)", "bwt", "bwt_sample"),
    ("Forward transfer (FWT)", "fwt", None),
    ("Plasticity", "plasticity", None),
)
SWEEP_METRICS: tuple[str, ...] = ("acc", "aaa", "forgetting")


def _read_events(path: Path, run_dir: Path) -> tuple[list[dict], int]:
    """Parse ``events.jsonl`` (read through the input boundary: inside ``run_dir``, under the JSON-lines cap);
    return the records and the number of unreadable lines skipped.

    A run killed mid-write can leave a torn last line; the report shows what it can and says how much it
    skipped instead of failing.
    """
    lines = _optional(path, run_dir, lambda: inpaths.read_jsonl_lines(path, within=run_dir))
    events, bad = [], 0
    for line in lines or ():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(record, dict):
            events.append(record)
        else:
            bad += 1
    return events, bad


def _optional(path: Path, run_dir: Path, read: Callable[[], Any]) -> Any:
    """``read()`` of an optional file of a run directory, or None when there is no such entry. An entry that
    is there is read through the input boundary like any other: a symlink out of the run directory, a FIFO or
    a file over its cap is an :class:`InputError`."""
    if not os.path.lexists(path):
        return None
    try:
        return read()
    except inpaths.InputMissing:  # a dangling symlink: nothing to read
        return None


def check_accuracy_matrix(metrics: Mapping[str, Any], metrics_path: Path) -> None:
    """Refuse a ``metrics.json`` whose ``accuracy_matrix`` cannot be drawn (names the file and the key).

    Raises:
        InputError: not a non-empty list of rows of numbers or nulls.
    """
    R = metrics.get("accuracy_matrix")
    if not isinstance(R, list) or not R or not all(isinstance(row, list) for row in R):
        raise InputError(f"{metrics_path}: 'accuracy_matrix' must be a non-empty list of rows, got {R!r:.80}")
    try:
        plots.matrix_to_array(R)
    except ValueError as exc:
        raise InputError(f"{metrics_path}: {exc}") from exc


def load_run(run_dir: str | Path) -> dict[str, Any]:
    """Read the files of a run directory that the report uses.

    Args:
        run_dir: the run directory.

    Returns:
        ``{"metrics", "manifest", "config_text", "events", "bad_event_lines", "metrics_mtime"}``;
        ``manifest`` is ``{}`` and ``config_text`` ``None`` when their files are absent.

    Every file is read through the input boundary (:mod:`clmerge.utils.inpaths`) with the run directory as
    ``within``: a file that is a symlink out of it (``events.jsonl -> /elsewhere``), a FIFO, a symlink loop or
    a file over its size cap is refused, naming it.

    Raises:
        FileNotFoundError: if ``metrics.json`` is missing (an :class:`~clmerge.utils.inpaths.InputMissing`;
            the message names the expected path).
        InputError: a file outside the run directory or not a regular file; ``metrics.json`` or
            ``manifest.json`` not valid JSON, or ``metrics.json`` with no usable ``accuracy_matrix``.
    """
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.json"
    try:
        metrics = read_json(metrics_path, within=run_dir)
    except inpaths.InputMissing:
        raise inpaths.InputMissing(f"no metrics.json in run directory {run_dir} (expected {metrics_path})") from None
    if not isinstance(metrics, dict):
        raise InputError(f"{metrics_path}: expected a JSON object, got {type(metrics).__name__}")
    check_accuracy_matrix(metrics, metrics_path)
    manifest_path, config_path = run_dir / "manifest.json", run_dir / "config.yaml"
    manifest = _optional(manifest_path, run_dir, lambda: read_json(manifest_path, within=run_dir))
    events, bad = _read_events(run_dir / "events.jsonl", run_dir)
    config_text = _optional(config_path, run_dir, lambda: inpaths.read_text(
        config_path, within=run_dir, kind="yaml", errors="replace"))
    return {
        "metrics": metrics,
        "manifest": manifest if isinstance(manifest, dict) else {},
        "config_text": config_text,
        "events": events,
        "bad_event_lines": bad,
        "metrics_mtime": datetime.fromtimestamp(os.stat(metrics_path).st_mtime, tz=timezone.utc),
    }


def _task_names(metrics: Mapping[str, Any], manifest: Mapping[str, Any], T: int) -> list[str]:
    """Task labels: metrics ``task_names``, else manifest task names, else ``task j``."""
    names = metrics.get("task_names")
    if not isinstance(names, list):
        tasks = manifest.get("tasks")
        tasks = tasks if isinstance(tasks, list) else []
        names = [t.get("name") if isinstance(t, dict) else None for t in tasks]
    return [str(names[j]) if j < len(names) and names[j] is not None else f"task {j}" for j in range(T)]


def _header(run: Mapping[str, Any], run_dir: Path) -> str:
    metrics, manifest = run["metrics"], run["manifest"]
    method = format_number(metrics.get("method"))
    title = f"clmerge report: {method}"
    fields = [
        ("method", metrics.get("method")),
        ("head", _head_name(metrics)),
        ("dataset", metrics.get("dataset")),
        ("scenario", metrics.get("scenario")),
        ("metrics written", run["metrics_mtime"].strftime("%Y-%m-%d %H:%M:%S UTC")),
        ("seed", manifest.get("seed")),
        ("clmerge", manifest.get("clmerge_version")),
        ("torch", manifest.get("torch")),
    ]
    timings = metrics.get("timings")
    if isinstance(timings, dict) and _is_number(timings.get("total_s")):
        fields.append(("total time", f"{timings['total_s']:.1f} s"))
    spans = "".join(f"<span><b>{escape(k)}:</b> {escape(_format_free(v))}</span>" for k, v in fields)
    where = f'<p class="meta">{escape(str(run_dir))}</p>'
    return f'<h1>{escape(title)}</h1>\n<p class="meta">{spans}</p>\n{where}'


def _head_name(metrics: Mapping[str, Any]) -> str:
    """The head variant that produced the metrics (runs made before heads were compared had only the linear head)."""
    head = metrics.get("head")
    return str(head.get("variant", "linear")) if isinstance(head, dict) else "linear"


def _heads_section(metrics: Mapping[str, Any]) -> str:
    """With ``head.compare``: final CIL / TIL accuracy of every head variant on the same backbone."""
    heads = metrics.get("heads")
    if not isinstance(heads, dict) or not heads:
        return ""
    primary = _head_name(metrics)
    rows = []
    for name, h in heads.items():
        h = h if isinstance(h, dict) else {}
        til = h.get("til") if isinstance(h.get("til"), dict) else {}
        label = f"{name} (reported)" if name == primary else name
        rows.append([label, format_number(h.get("acc")), format_number(h.get("aaa")), format_number(til.get("acc")),
                     format_number(h.get("val_acc"))])
    note = ('<p class="note">Shadow heads (head.compare): evaluated on the same backbone, never fed back into '
            'training. Validation: final CIL accuracy on the held-out validation parts.</p>')
    return _section("Heads", _table(["head", "CIL Acc", "CIL AAA", "TIL Acc", "validation CIL"], rows) + note)


def _metrics_section(metrics: Mapping[str, Any]) -> str:
    til = metrics.get("til") if isinstance(metrics.get("til"), dict) else None
    headers = ["metric", "task-weighted", "sample-weighted"] + (["TIL (task-weighted)"] if til else [])
    rows = []
    for label, key, sample_key in METRIC_ROWS:
        sample = metrics.get(sample_key) if sample_key else None
        row = [label, format_number(metrics.get(key)), format_number(sample)]
        if til:
            row.append(format_number(til.get(key)))
        rows.append(row)
    note = '<p class="note">Accuracies in percent, forgetting and transfer in percentage points.</p>'
    return _section("Metrics", _table(headers, rows) + note)


def _safe_plot(make: Callable[[], bytes], alt: str) -> str:
    """Render one plot; a plot that fails on odd data becomes a note instead of sinking the report."""
    try:
        return _img(make(), alt)
    except (ValueError, TypeError) as exc:
        return f'<p class="note">{escape(alt)}: could not be drawn ({escape(str(exc))}).</p>'


def _forgetting_values(metrics: Mapping[str, Any]) -> list | None:
    values = metrics.get("forgetting_per_task")
    if isinstance(values, list):
        return values
    try:  # not in the file: derive it from the matrix when the matrix is complete enough
        return forgetting_per_task(metrics["accuracy_matrix"])
    except (ValueError, TypeError, IndexError):
        return None


def _plot_sections(run: Mapping[str, Any], names: list[str]) -> list[str]:
    metrics = run["metrics"]
    R = metrics["accuracy_matrix"]
    heat = _safe_plot(lambda: plots.accuracy_heatmap(R, names, "Accuracy matrix"), "accuracy matrix")
    til_R = metrics.get("til_accuracy_matrix")
    if isinstance(til_R, list) and til_R:
        til_title = "TIL accuracy (task id known)"
        heat += _safe_plot(lambda: plots.accuracy_heatmap(til_R, names, til_title), "TIL accuracy matrix")
    out = [_section("Accuracy matrix", heat)]
    curves = _safe_plot(lambda: plots.accuracy_curves(R, names), "accuracy curves")
    out.append(_section("Accuracy over tasks", curves))
    forgetting = _forgetting_values(metrics)
    if forgetting:
        bars = _safe_plot(lambda: plots.forgetting_bars(forgetting, names), "forgetting per task")
        out.append(_section("Forgetting per task", bars))
    if plots.step_losses(run["events"]) or plots.epoch_losses(run["events"]):
        loss = _safe_plot(lambda: plots.loss_curve(run["events"]), "training loss")
        out.append(_section("Training loss", loss))
    if run["bad_event_lines"]:
        out.append(f'<p class="note">events.jsonl: {run["bad_event_lines"]} unreadable line(s) skipped.</p>')
    return out


def _method_metrics_section(metrics: Mapping[str, Any]) -> str:
    """What the method recorded (``method_metrics``), as plots and rounded tables."""
    body = method_values_html(metrics.get("method_metrics"))
    return _section("Method values", body) if body else ""


def _tasks_section(manifest: Mapping[str, Any], metrics: Mapping[str, Any]) -> str:
    tasks = manifest.get("tasks")
    if not isinstance(tasks, list) or not tasks:
        return ""
    timings = metrics.get("timings") if isinstance(metrics.get("timings"), dict) else {}
    per_task = timings.get("per_task_s") if isinstance(timings.get("per_task_s"), list) else []
    names = manifest.get("class_names") if isinstance(manifest.get("class_names"), list) else []
    rows = []
    for j, task in enumerate(tasks):
        task = task if isinstance(task, dict) else {}
        seconds = per_task[j] if j < len(per_task) else None
        classes = task.get("classes")
        rows.append([
            str(j),
            format_number(task.get("name")),
            MISSING if classes is None else _format_free(classes),
            *([_class_names(classes, names)] if names else []),
            _format_free(task.get("n_train")),
            _format_free(task.get("n_test")),
            format_number(seconds, ".1f"),
        ])
    header = ["#", "name", "classes", *(["class names"] if names else []), "n_train", "n_test", "train time (s)"]
    table = _table(header, rows, numeric_from=len(header) - 3)
    extra = []
    if manifest.get("class_order") is not None:
        extra.append(f"<p><b>class order:</b> {escape(_format_free(manifest['class_order']))}</p>")
    backbone = manifest.get("backbone")
    if isinstance(backbone, dict):
        extra.append(f"<p><b>backbone:</b> {escape(format_number(backbone.get('preset')))} "
                     f"(sha256 <code>{escape(format_number(backbone.get('sha256')))}</code>)</p>")
    return _section("Tasks", table + "".join(extra))


def _class_names(classes: Any, names: list) -> str:
    """The names of a task's class ids (the manifest's ``class_names``, indexed by class id), comma-separated."""
    if not isinstance(classes, list):
        return MISSING
    return ", ".join(str(names[c]) if isinstance(c, int) and 0 <= c < len(names) else str(c) for c in classes)


def build_report(run_dir: str | Path) -> Path:
    """Write ``RUN_DIR/report.html``, a self-contained report of one run, atomically.

    Args:
        run_dir: a run directory (its files are listed in ``docs/architecture.md``).

    Returns:
        The path of the written report.

    Raises:
        FileNotFoundError: if ``RUN_DIR/metrics.json`` is missing.
        ValueError: if a JSON file is malformed or the accuracy matrix is unusable, or a file of the run lies
            outside it (an :class:`InputError`).
        OutputError: ``RUN_DIR/report.html`` is a symlink or cannot be written (checked before the page is made).
    """
    run_dir = Path(run_dir)
    page_path(run_dir, PAGE)
    open_run_plugins(run_dir)  # the plugins the run recorded: checked against their sha256, then imported
    run = load_run(run_dir)
    metrics = run["metrics"]
    names = _task_names(metrics, run["manifest"], plots.matrix_to_array(metrics["accuracy_matrix"]).shape[0])
    sections = [_metrics_section(metrics), _heads_section(metrics), *_plot_sections(run, names),
                _method_metrics_section(metrics),
                _tasks_section(run["manifest"], metrics)]
    if run["config_text"] is not None:
        sections.append(_section("Resolved config", f"<pre>{escape(run['config_text'])}</pre>"))
    title = f"clmerge report: {format_number(metrics.get('method'))}"
    out = page_path(run_dir, PAGE)
    atomic_write_text(out, _page(title, _header(run, run_dir), sections))
    return out


def page_path(folder: Path, name: str) -> Path:
    """Where a page is written inside a folder the command was handed (:func:`clmerge.utils.outpaths.child`:
    never through a symlink, never a name with separators) after checking it can be written there.

    Raises:
        OutputError: the entry is a symlink or a special file, or the folder cannot be written.
    """
    out = child(Path(folder), name, flag="report")
    check_writable(out, "report")
    return out


def build_sweep_report(
    out_path: str | Path, runs: Mapping[str, Mapping[str, Any]], title: str = "clmerge sweep"
) -> Path:
    """Write a self-contained page comparing several runs' metrics, atomically.

    Args:
        out_path: where to write the HTML file (parent directories are created).
        runs: run label -> that run's ``metrics.json`` contents (any field may be missing or null).
        title: page title.

    Returns:
        ``out_path`` as a :class:`~pathlib.Path`.
    """
    out_path = page_path(Path(out_path).parent, Path(out_path).name)
    keys = [*SWEEP_METRICS, "bwt", "acc_sample"]
    rows = [[str(label), *(format_number(m.get(k)) for k in keys)] for label, m in runs.items()]
    sections = [_section("Metrics", _table(["run", *keys], rows))]
    if runs:
        values = {str(label): {k: m.get(k) for k in SWEEP_METRICS} for label, m in runs.items()}
        bars = _safe_plot(lambda: plots.metric_bars(values, SWEEP_METRICS), "metrics per run")
        sections.append(_section("Comparison", bars))
    curves = {str(k): m.get("accuracy_curve") for k, m in runs.items()}
    curves = {k: c for k, c in curves.items() if isinstance(c, list) and c}
    if curves:
        lines = _safe_plot(lambda: plots.multi_order_curves(curves), "accuracy curve per run")
        sections.append(_section("Accuracy curves", lines))
    header = f'<h1>{escape(title)}</h1>\n<p class="meta">{len(runs)} run(s)</p>'
    atomic_write_text(out_path, _page(title, header, sections))
    return out_path
