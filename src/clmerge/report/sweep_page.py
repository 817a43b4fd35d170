"""The sweep page: ``clmerge report DIR`` on a sweep directory (or any folder of run directories) writes
``DIR/report.html``, one self-contained page comparing the groups of runs (docs/sweeps.md, "The sweep
report").

The comparison table is :mod:`clmerge.report.tables`'s (mean ± SE and n per group, paired differences with
``vs``), the plots average each group's runs with :mod:`clmerge.report.sweep_data` and are drawn by
:mod:`clmerge.report.sweep_plots`, and every finished run gets its own page (written when missing, with
:func:`clmerge.report.html.build_report`), linked from the page. Everything is read and checked before the
first file is written; without matplotlib the page keeps its tables and says how to get the plots.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from html import escape
from pathlib import Path
from typing import Any
from urllib.parse import quote

from clmerge.report import plots, sweep_plots, tables
from clmerge.report.elements import details, format_value, img, link, page, section, table
from clmerge.report.html import PAGE, build_report, check_accuracy_matrix, page_path
from clmerge.report.sweep_data import Band, cil_curve, forgetting_values, old_new_split, seed_band, til_curve
from clmerge.utils.extras import MissingExtraError, require_extra
from clmerge.errors import InputError
from clmerge.utils.inpaths import read_text
from clmerge.utils.io import atomic_write_text, read_json
from clmerge.utils.yaml_io import read_yaml

__all__ = ["PAGE", "DEFAULT_METRICS", "is_run_dir", "default_by", "build_sweep_page", "sweep_page_html",
           "sweep_figures", "selection_rows"]

SPEC_FILE = "sweep.yaml"
DEFAULT_METRICS = ("acc", "aaa", "forgetting", "til_acc")
NO_PLOTS = ('The plots need matplotlib, which is not installed: pip install "clmerge[plots]" '
            '(from a checkout: pip install ".[plots]"); the tables above and below are complete.')
BAND_NOTE = ("Line: mean over the group's runs (seeds); band: ± 1 standard error over those runs "
             "(s / sqrt(n); no band for a single run). Accuracy axes span 0-100 %.")


def is_run_dir(path: Path) -> bool:
    """A run directory (its own report), not a folder of them: it holds ``config.yaml`` or ``metrics.json``."""
    return (path / "config.yaml").is_file() or _exists(path / "metrics.json")


def _exists(path: Path) -> bool:
    """An entry is there (a symlink too, dangling or not: the input boundary then says what is wrong with it)."""
    return os.path.lexists(path)


def default_by(sweep_dir: Path) -> list[str]:
    """The grouping keys when none are given: the grid keys of ``sweep.yaml`` but the seed keys, else
    ``method.name``."""
    spec = sweep_dir / SPEC_FILE
    data = read_yaml(spec, within=sweep_dir) if _exists(spec) else None
    grid = data.get("grid") if isinstance(data, dict) else None
    keys = [str(k) for k in grid if k not in tables.SEED_KEYS] if isinstance(grid, dict) else []
    return keys or ["method.name"]


def _warn_stderr(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr)


def build_sweep_page(sweep_dir: str | Path, *, by: Sequence[str] | None = None,
                     metrics: Sequence[str] = DEFAULT_METRICS, vs: str | None = None,
                     ignore: Sequence[str] = (), warn: Callable[[str], None] = _warn_stderr) -> Path:
    """Write ``SWEEP_DIR/report.html`` (atomically) and the missing pages of its runs; return the page's path.

    A symlinked entry inside ``sweep_dir`` (a run directory elsewhere, a link back up, a symlink loop) is never
    followed, as git records a symlink to a folder without descending into it: it is skipped, ``warn`` gets a
    line naming it (default: ``warning: ...`` on stderr). No page is ever written
    into a symlinked folder or through a symlinked ``report.html``
    (:func:`clmerge.utils.outpaths.child`), and every run file is read inside its run directory
    (:func:`clmerge.report.tables.find_runs`, :func:`clmerge.report.html.load_run`).

    Raises:
        InputError: no run directory, runs that cannot be averaged (tables.build_table), a metrics.json
            without a usable accuracy matrix, a run file outside its run directory; nothing is written then.
        UsageError: a ``by`` key in no config, an unknown ``vs`` group.
        OutputError: a page cannot be written (a symlinked ``report.html``, no permission; checked before
            anything is written).
    """
    sweep_dir = Path(sweep_dir)
    done, unfinished = tables.find_runs([sweep_dir], warn=warn)
    t = tables.build_table(tables.load_runs(done), by=list(by or default_by(sweep_dir)), metrics=list(metrics),
                           vs=vs, ignore=list(ignore), skipped=unfinished)
    for r in _runs(t):
        check_accuracy_matrix(r.metrics, r.path / "metrics.json")
    out = page_path(sweep_dir, PAGE)
    missing = [r.path for r in _runs(t) if not _exists(page_path(r.path, PAGE))]
    html = sweep_page_html(sweep_dir, t)  # reads selected.json too: a bad one stops before any write
    for run_dir in missing:
        build_report(run_dir)
    atomic_write_text(out, html)
    return out


def _runs(t: tables.ResultsTable) -> list[tables.Run]:
    return [r for g in t.groups for r in g.runs]


def sweep_page_html(sweep_dir: Path, t: tables.ResultsTable) -> str:
    """The page's HTML for the table ``t`` built from the runs under ``sweep_dir`` (links are relative to it)."""
    title = f"clmerge sweep: {sweep_dir.resolve().name}"
    sections = [_table_section(t), _selection_section(sweep_dir), *_plot_sections(t), _runs_section(sweep_dir, t),
                _spec_section(sweep_dir)]
    return page(title, _header(title, sweep_dir, t), sections)


def _header(title: str, sweep_dir: Path, t: tables.ResultsTable) -> str:
    fields = [("runs", f"{len(_runs(t))} finished, {len(t.skipped)} unfinished"),
              ("groups", f"{len(t.groups)}, by {', '.join(t.by)}"),
              ("seeds varied", " and ".join(t.seeds_varied) or "none")]
    spans = "".join(f"<span><b>{escape(k)}:</b> {escape(v)}</span>" for k, v in fields)
    return (f'<h1>{escape(title)}</h1>\n<p class="meta">{spans}</p>\n'
            f'<p class="meta">{escape(str(sweep_dir.resolve()))}</p>')


def _table_section(t: tables.ResultsTable) -> str:
    """The results table, split in two when it has paired differences: the groups' own values, then the
    differences to the reference (one wide table would not fit the page)."""
    head, rows = tables.table_rows(t)
    own = len(t.by) + 1 + len(t.metrics)
    caption = ("Each metric: mean ± standard error over the group's runs (seeds); <i>runs</i> is n. "
               "Accuracies in percent, forgetting in percentage points; <code>til_</code>: the task id is "
               "given at test time. The same numbers as <code>clmerge results</code>.")
    body = table(head[:own], [r[:own] for r in rows], numeric_from=len(t.by))
    if t.vs is not None:
        keep = list(range(len(t.by))) + list(range(own, len(head)))
        body += (f"<h3>Paired differences to {escape(t.vs)}</h3>"
                 + table([head[k] for k in keep], [[r[k] for k in keep] for r in rows], numeric_from=len(t.by)))
    notes = "".join(f"<li>{escape(n)}</li>" for n in t.notes())
    return section("Comparison", body + f'<p class="note">{caption}</p><ul class="note">{notes}</ul>')


def selection_rows(path: Path) -> tuple[str, str, list[list[str]]]:
    """A sweep's ``selected.json`` (its choice on validation, docs/sweeps.md) as (key, metric, rows): per
    group, the chosen value, every value tried with its mean validation score, and whether the choice sits at
    an edge of the values tried. A file of another shape: InputError naming the file and the key."""
    doc = read_json(path, within=path.parent)
    key, metric = (doc.get(k) if isinstance(doc, dict) else None for k in ("key", "metric"))
    groups = doc.get("groups") if isinstance(doc, dict) else None
    if not isinstance(key, str) or not isinstance(metric, str) or not isinstance(groups, dict):
        raise InputError(f"{path}: key, metric, groups: expected the config key, the validation metric and "
                         "the groups' choices a sweep writes")
    rows = []
    for label, rec in groups.items():
        scores = rec.get("scores") if isinstance(rec, dict) else None
        if not isinstance(scores, list) or not all(isinstance(s, dict) and "value" in s for s in scores):
            raise InputError(f"{path}: groups.{label}.scores: expected a list of {{value, val_{metric}}}")
        tried = "; ".join(f"{format_value(s['value'])}: {format_value(s.get(f'val_{metric}'))}" for s in scores)
        rows.append([str(label), format_value(rec.get("value")), tried, "yes" if rec.get("at_edge") else "no"])
    return key, metric, rows


def _selection_section(sweep_dir: Path) -> str:
    path = sweep_dir / tables.SELECTED_FILE
    if not _exists(path):
        return ""
    key, metric, rows = selection_rows(path)
    head = ["group", f"chosen {key}", f"values tried: mean validation {metric}", "at an edge"]
    note = (f"The sweep chose {key} per group on validation data only ({tables.SELECTED_FILE}; its runs are "
            f"in {tables.SELECT_DIR}/, not in the tables here); the grid's runs above use the chosen value. "
            "At an edge: the best value is still the largest or smallest one tried after every extension.")
    body = table(head, rows, numeric_from=4) + f'<p class="note">{escape(note)}</p>'
    return section("Selection on validation", body)


def _bands(t: tables.ResultsTable, per_run: Callable[[dict[str, Any]], Any]) -> dict[str, Band]:
    """Group label -> mean ± SE band of ``per_run(metrics)`` over the group's runs (runs giving None skipped)."""
    out = {}
    for g in t.groups:
        series = [s for r in g.runs if (s := per_run(r.metrics)) is not None]
        if series:
            out[g.label] = seed_band(series)
    return out


def sweep_figures(t: tables.ResultsTable) -> dict[str, Any]:
    """The page's figures by section title (matplotlib figures; tests read their axes)."""
    curves = {"CIL: class-incremental accuracy": _bands(t, cil_curve),
              "TIL: task id given at test time": _bands(t, til_curve)}
    split = {"Newest task: R[t][t]": _bands(t, lambda m: old_new_split(m["accuracy_matrix"])[0]),
             "Older tasks: mean of R[t][j], j < t": _bands(t, lambda m: old_new_split(m["accuracy_matrix"])[1])}
    forgetting = _bands(t, forgetting_values)
    tasks = max((len(b.mean) for b in forgetting.values()), default=0)
    return {
        "Accuracy over tasks": sweep_plots.band_panels_figure({k: v for k, v in curves.items() if v}),
        "Forgetting per task": sweep_plots.forgetting_figure(forgetting, [f"task {j}" for j in range(tasks)]),
        "Old vs new classes": sweep_plots.band_panels_figure(split),
    }


CAPTIONS = {
    "Accuracy over tasks": ("Left: class-incremental (CIL) accuracy after training task t, the task-weighted "
                            "mean of R[t][j] over the tasks j ≤ t seen so far (R: a run's accuracy matrix). "
                            "Right: the same with the task id given at test time (TIL). "),
    "Forgetting per task": ("Forgetting of task j: its best accuracy before the last task minus its final "
                            "accuracy, in points (the last task has none). Bar: mean over the group's runs; "
                            "whisker: ± 1 standard error. "),
    "Old vs new classes": ("After training task t, from each run's accuracy matrix R (metrics.json, "
                           "accuracy_matrix): left, R[t][t], the accuracy on the task just learned (the new "
                           "classes); right, the mean of R[t][j] over the older tasks j < t (each task counts "
                           "equally; none after task 0). A method that keeps old classes has the right curve "
                           "close to the left one. "),
}


def _plot_sections(t: tables.ResultsTable) -> list[str]:
    try:
        require_extra("matplotlib", what="drawing report plots")
    except MissingExtraError:
        return [section("Plots", f'<p class="note">{escape(NO_PLOTS)}</p>')]
    out = []
    for title, fig in sweep_figures(t).items():
        note = CAPTIONS[title] + ("" if title == "Forgetting per task" else BAND_NOTE)
        out.append(section(title, img(plots.to_png(fig), title) + f'<p class="note">{escape(note)}</p>'))
    return out


def _runs_section(sweep_dir: Path, t: tables.ResultsTable) -> str:
    rows = []
    for g in t.groups:
        for r in g.runs:
            rel = r.path.relative_to(sweep_dir).as_posix()
            seeds = [format_value(v) for v in r.seeds()]
            values = [_number(tables.metric_value(r, m)) for m in ("acc", "aaa", "forgetting")]
            rows.append([g.label, link(quote(f"{rel}/{PAGE}"), rel), *seeds, *values])
    for p in t.skipped:
        rows.append(["", p.relative_to(sweep_dir).as_posix(), "", "", "", "", "unfinished (no metrics.json)"])
    head = ["group", "run (its own report)", *tables.SEED_KEYS, "acc", "aaa", "forgetting"]
    return section("Runs", table(head, rows, numeric_from=2))


def _number(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


def _spec_section(sweep_dir: Path) -> str:
    spec = sweep_dir / SPEC_FILE
    if not _exists(spec):
        return ""
    text = read_text(spec, within=sweep_dir, kind="yaml", errors="replace")
    return section("Sweep spec", details(f"{SPEC_FILE} (as run)", f"<pre>{escape(text)}</pre>"))

