"""Tables across runs (``clmerge results``): collect run directories, group them by config keys, and give each
group's metrics as mean ± standard error over its runs (seeds), with paired differences against a reference
group.

A run directory holds ``config.yaml`` and, once finished, ``metrics.json``. Groups are formed by the values of
the ``by`` config keys (dotted: ``method.name``, ``optim.lr``). Within a group, runs may differ only in the
seed keys (:data:`SEED_KEYS`: ``seed`` is the training randomness, ``scenario.seed`` the class order) and in
keys the caller ignores; anything else is refused, naming the keys, because the mean would mix settings.
Groups may differ from each other in any key (a method's own options do).

Statistics (:func:`clmerge.metrics.mean_se`): mean and SE = s / sqrt(n), s the sample standard deviation over
the group's runs. A paired difference against the reference group takes, for every seed (the values of the
seed keys) present in both groups, ``x_group - x_reference``, and reports the mean and standard error of those
differences and the number of pairs; runs without a partner are listed, not dropped silently.

Every file is read through the input boundary (:mod:`clmerge.utils.inpaths`): a run's ``config.yaml`` and
``metrics.json`` must resolve inside its run directory, ``metrics.json`` is strict JSON (``NaN`` and
``Infinity`` refused, naming the key), and a mean or standard error that overflows is refused rather than shown
as ``inf`` (:class:`~clmerge.errors.InputError`, exit 3). Inside a folder of runs, a symlinked entry is never
followed (:func:`find_runs`).

A sweep with a ``select:`` block (``selected.json`` beside its cells) chose a key on validation: its
selection runs (``select/``) are not results and are skipped, and the table gets a column with the chosen
value(s) of that key in each group.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from clmerge.errors import InputError, UsageError
from clmerge.metrics import mean_se
from clmerge.utils import inpaths
from clmerge.utils.inpaths import real_subdirs
from clmerge.utils.io import read_json
from clmerge.utils.yaml_io import read_yaml

__all__ = ["METRICS", "SEED_KEYS", "FORMATS", "Run", "Group", "ResultsTable", "find_runs", "load_runs",
           "build_table", "flatten", "link_warning", "read_metrics", "metric_value", "parse_metrics", "render",
           "table_rows"]

SEED_KEYS = ("seed", "scenario.seed")
SEED_MEANING = {"seed": "the training seed", "scenario.seed": "the class order"}
#: written after a group's mean ± 0.00 over two or more runs: the runs gave one value, so the error bar
#: measures nothing (a deterministic method under a varied training seed alone, or runs that are copies)
NOTHING_VARIED = "nothing varied"
# name -> path in metrics.json; the TIL ones (task-incremental: the task's own classes only) sit under "til"
METRICS: dict[str, tuple[str, ...]] = {
    **{m: (m,) for m in ("acc", "aaa", "forgetting", "bwt", "fwt", "plasticity")},
    **{f"til_{m}": ("til", m) for m in ("acc", "aaa", "forgetting", "bwt", "fwt", "plasticity")},
}
FORMATS = ("table", "md", "csv", "json")
SEARCH_DEPTH = 2  # a sweep folder holds run directories one or two levels down
SELECTED_FILE, SELECT_DIR = "selected.json", "select"  # a sweep's choice on validation and its selection runs
_ABSENT = "<absent>"


@dataclass
class Run:
    """One finished run: its folder, flattened config (dotted keys) and metrics.json."""

    path: Path
    config: dict[str, Any]
    metrics: dict[str, Any]
    selected: list[str] = field(default_factory=list)  # config keys its sweep chose on validation

    def seeds(self) -> tuple:
        return tuple(self.config.get(k) for k in SEED_KEYS)


@dataclass
class Group:
    """The runs that share the values of the ``by`` keys."""

    values: tuple
    runs: list[Run]
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    diffs: dict[str, dict[str, Any]] = field(default_factory=dict)
    unpaired: list[Path] = field(default_factory=list)

    @property
    def label(self) -> str:
        return ",".join(_text(v) for v in self.values)


@dataclass
class ResultsTable:
    by: list[str]
    metrics: list[str]
    groups: list[Group]
    vs: str | None = None
    skipped: list[Path] = field(default_factory=list)
    seeds_varied: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    between: list[str] = field(default_factory=list)
    selected: list[str] = field(default_factory=list)

    def notes(self) -> list[str]:
        """What the reader must know besides the numbers: unfinished runs, unpaired runs, what the n count."""
        varied = " and ".join(f"{SEED_MEANING[k]} ({k})" for k in self.seeds_varied) or "no seed key"
        out = [f"runs: the runs averaged; what varied: {varied} (seed keys: {', '.join(SEED_KEYS)})"]
        flat = [f"{m} of {g.label}" for g in self.groups for m in self.metrics if _nothing_varied(g.stats[m])]
        if flat:
            hint = ("" if "scenario.seed" in self.seeds_varied else "; the class order (scenario.seed) stayed "
                    "fixed: clmerge run --seeds varies it unless --fixed-class-order")
            more = f" and {len(flat) - 4} more" if len(flat) > 4 else ""
            out.append(f"{NOTHING_VARIED}: the same value in every run ({', '.join(flat[:4])}{more}), so its "
                       f"± 0.00 is no error bar{hint}")
        if self.vs is not None:
            same = " and ".join(SEED_KEYS)
            out.append(f"Δ: paired difference to {self.vs} over runs with the same {same}, "
                       f"mean ± SE (pairs)")
        if self.between:
            more = f" and {len(self.between) - 6} more" if len(self.between) > 6 else ""
            out.append(f"groups differ also in: {', '.join(self.between[:6])}{more}")
        if self.ignored:
            out.append(f"ignored config keys: {', '.join(self.ignored)}")
        for k in self.selected:
            out.append(f"{k} (val-selected): chosen on validation data by the sweep ({SELECTED_FILE})")
        out += [f"skipped (no metrics.json, unfinished): {p}" for p in self.skipped]
        for g in self.groups:
            out += [f"unpaired against {self.vs} (no run with the same seeds): {p}" for p in g.unpaired]
        return out


def _text(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, default=str)


# -- collecting run directories ------------------------------------------------------------------------------

def _is_run_dir(p: Path) -> bool:
    return (p / "config.yaml").is_file()


def _is_sweep_dir(folder: Path) -> bool:
    """A sweep's folder (its ``sweep.yaml``, or the ``selected.json`` of its choice on validation): its
    ``select/`` holds selection runs, even before the choice is written (a sweep stopped in phase 1)."""
    return (folder / SELECTED_FILE).is_file() or (folder / "sweep.yaml").is_file()


def _search(folder: Path, depth: int, links: list[Path]) -> list[Path]:
    """Run directories at or below ``folder`` (at most ``depth`` levels down), hidden folders skipped; a
    symlinked entry is never followed (added to ``links``)."""
    if _is_run_dir(folder):
        return [folder]
    if depth == 0:
        return []
    skip = SELECT_DIR if _is_sweep_dir(folder) else None  # selection runs: not results
    kids, linked = real_subdirs(folder)
    links += [p for p in linked if not p.name.startswith(".")]
    kids = [p for p in kids if not p.name.startswith(".") and p.name != skip]
    return [r for k in kids for r in _search(k, depth - 1, links)]


def link_warning(link: Path) -> str:
    """The warning line for a symlinked entry skipped in a folder of runs."""
    return (f"{link}: a symlink, skipped (clmerge does not follow symlinks inside a folder of runs; name the "
            "run directory itself to include it)")


def find_runs(dirs: Iterable[str | Path], *, warn: Callable[[str], None] | None = None
              ) -> tuple[list[Path], list[Path]]:
    """``(finished, unfinished)`` run directories in ``dirs``: each a run directory or a folder holding run
    directories up to :data:`SEARCH_DEPTH` levels down. A run directory holds ``config.yaml``; it is finished
    when it holds ``metrics.json`` too.

    A folder named in ``dirs`` is the user's choice and is read even when it is a symlink; inside it, a
    symlinked entry (to a run directory elsewhere, to a folder above, a symlink loop) is never followed, as git
    records a symlink to a folder without descending into it: it is skipped and ``warn`` is called with a line
    naming it (:func:`link_warning`).

    Raises:
        InputError: a folder that does not exist or holds no run directory.
    """
    found: list[Path] = []
    for d in map(Path, dirs):
        if not d.is_dir():
            what = "not a folder" if d.exists() or d.is_symlink() else "no such folder"
            raise InputError(f"{d}: {what} (expected a run directory or a folder of run directories)")
        links: list[Path] = []
        runs = _search(d, SEARCH_DEPTH, links)
        for link in links:
            if warn is not None:
                warn(link_warning(link))
        if not runs:
            raise InputError(f"{d}: no run directory (config.yaml + metrics.json) in it or "
                             f"{SEARCH_DEPTH} levels below" + (" (symlinks are not followed)" if links else ""))
        seen = {f.resolve() for f in found}
        found += [r for r in runs if r.resolve() not in seen]
    done = [r for r in found if (r / "metrics.json").is_file() or (r / "metrics.json").is_symlink()]
    return done, [r for r in found if r not in done]


def flatten(cfg: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay values."""
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _load_run(path: Path) -> Run:
    cfg = read_yaml(path / "config.yaml", within=path)
    if not isinstance(cfg, dict):
        raise InputError(f"{path / 'config.yaml'}: expected a mapping of config keys, "
                         f"got {type(cfg).__name__}")
    metrics = read_metrics(path / "metrics.json", within=path)
    if not isinstance(metrics, dict):
        raise InputError(f"{path / 'metrics.json'}: expected a JSON object, got {type(metrics).__name__}")
    return Run(path, flatten(cfg), metrics, _selected_keys(path.parent / SELECTED_FILE))


def read_metrics(path: Path, *, within: Path) -> Any:
    """A run's ``metrics.json``, read through the input boundary (a regular file inside ``within``, under the
    JSON cap) as strict JSON: ``NaN`` / ``Infinity`` (which Python's json writes, JSON does not have) are an
    :class:`InputError` naming the file and the key that holds one."""
    data = inpaths.read_bytes(path, within=within, kind="json")
    try:
        return inpaths.loads_json(data, str(path), strict=True)
    except InputError:
        doc = inpaths.loads_json(data, str(path))  # not strict: where is the non-finite number?
        key, value = _non_finite(doc)
        if key is None:
            raise
        raise InputError(f"{path}: '{key}' is {value}, not a finite number (JSON has no NaN or Infinity; "
                         "a finished run's metrics are finite)") from None


def _non_finite(doc: Any, prefix: str = "") -> tuple[str | None, str]:
    """The first dotted key (list items as ``[i]``) holding NaN or an infinity, and that value as JSON spells it."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        key = f"{prefix}[{k}]" if isinstance(doc, list) else (f"{prefix}.{k}" if prefix else str(k))
        if isinstance(v, float) and not math.isfinite(v):
            return key, "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
        found = _non_finite(v, key)
        if found[0] is not None:
            return found
    return None, ""


def _selected_keys(path: Path) -> list[str]:
    """The key a sweep chose on validation, from its ``selected.json`` (none without one)."""
    if not path.is_file() and not path.is_symlink():
        return []
    doc = read_json(path, within=path.parent)
    key = doc.get("key") if isinstance(doc, dict) else None
    if not isinstance(key, str):
        raise InputError(f"{path}: key: expected the config key the sweep selected, got {key!r}")
    return [key]


def load_runs(paths: Sequence[Path]) -> list[Run]:
    return [_load_run(p) for p in paths]


# -- metrics -------------------------------------------------------------------------------------------------

def parse_metrics(text: str) -> list[str]:
    """``"acc,aaa"`` -> ``["acc", "aaa"]``; an unknown name is a :class:`UsageError` listing the known
    ones."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in METRICS]
    if bad or not names:
        raise UsageError(f"--metrics: unknown metric {', '.join(repr(b) for b in bad) or '(none given)'}; "
                         f"known: {', '.join(METRICS)}")
    return names


def metric_value(run: Run, name: str) -> float | None:
    """The metric ``name`` of ``run`` (None when the run has none, e.g. FWT without an initial evaluation).

    Raises:
        InputError: the value is not a number (names the file and key).
    """
    v: Any = run.metrics
    for part in METRICS[name]:
        v = v.get(part) if isinstance(v, dict) else None
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InputError(f"{run.path / 'metrics.json'}: '{'.'.join(METRICS[name])}' should be a number, "
                         f"got {str(v)[:40]!r}")
    try:
        x = float(v)
    except OverflowError:  # an integer beyond any float
        x = math.inf
    if not math.isfinite(x):
        raise InputError(f"{run.path / 'metrics.json'}: '{'.'.join(METRICS[name])}' is {str(v)[:40]}, not a "
                         "finite number")
    return x


def _stat(xs: Sequence[float], what: str = "the values") -> dict[str, Any]:
    """Mean, standard error and n of ``xs``; a mean or SE that overflows (finite values near 1e308) is an
    :class:`InputError` naming ``what``, never an ``inf`` in the table."""
    if not xs:
        return {"mean": None, "se": None, "n": 0}
    with np.errstate(over="ignore", invalid="ignore"):
        m, se = mean_se(xs)
    se_ok = math.isfinite(se) or (len(xs) < 2 and math.isnan(se))  # one run: no SE (NaN), not an overflow
    if not math.isfinite(m) or not se_ok:
        raise InputError(f"{what}: the mean ± standard error over {len(xs)} run(s) is not finite (the values, up "
                         f"to {max(abs(x) for x in xs):.3g}, overflow a float); not a metric clmerge writes")
    return {"mean": m, "se": None if math.isnan(se) else se, "n": len(xs)}


# -- grouping and checks -------------------------------------------------------------------------------------

def _group(runs: Sequence[Run], by: Sequence[str]) -> list[Group]:
    known = set().union(*(r.config for r in runs))
    missing = [k for k in by if k not in known]
    if missing:
        raise UsageError(f"--by: {', '.join(repr(k) for k in missing)} is in no run's config.yaml "
                         f"(dotted config keys, e.g. method.name, optim.lr)")
    groups: dict[tuple, Group] = {}
    for r in runs:
        key = tuple(r.config.get(k, _ABSENT) for k in by)
        groups.setdefault(tuple(_canon(v) for v in key), Group(key, [])).runs.append(r)
    return list(groups.values())


def _canon(v: Any) -> str:
    """A config value as comparable text (YAML may hold dates: ``str`` of them)."""
    return json.dumps(v, sort_keys=True, default=str)


def _skipped(key: str, skip: set[str]) -> bool:
    """``key`` is in ``skip``, or under a section in it (``run`` skips ``run.threads``)."""
    return any(key == k or key.startswith(k + ".") for k in skip)


def _differing_keys(runs: Sequence[Run], skip: set[str]) -> list[str]:
    """The config keys whose values differ between ``runs``, but ``skip``: keys every run has first."""
    keys = sorted(k for k in set().union(*(r.config for r in runs)) if not _skipped(k, skip))
    diff = [k for k in keys if len({_canon(r.config.get(k, _ABSENT)) for r in runs}) > 1]
    return sorted(diff, key=lambda k: any(k not in r.config for r in runs))


def _between_groups(groups: Sequence[Group], skip: set[str]) -> list[str]:
    """Keys outside ``method.`` (a method's own options) whose values differ between groups."""
    firsts = [g.runs[0] for g in groups]
    return _differing_keys(firsts, skip | {"method"})


def _check_group(g: Group, skip: set[str]) -> None:
    """Refuse a group whose runs differ in other keys than ``skip``, or that holds two runs of one seed."""
    diff = _differing_keys(g.runs, skip)
    if diff:
        shown = ", ".join(diff[:6]) + (f" and {len(diff) - 6} more" if len(diff) > 6 else "")
        raise InputError(f"runs of group {g.label!r} differ in config keys {shown} "
                         f"({_example(g.runs, diff[0])}): add them to --by, or --ignore them if they do "
                         f"not matter")
    seen: dict[tuple, Path] = {}
    for r in g.runs:
        if r.seeds() in seen:
            raise InputError(f"{seen[r.seeds()]} and {r.path}: the same config and seeds "
                             f"({_seed_text(r)}) twice; a copy? remove one")
        seen[r.seeds()] = r.path


def _example(runs: Sequence[Run], key: str) -> str:
    """Two runs that differ in ``key``: ``"key: a in RUN1, b in RUN2"``."""
    first = runs[0].config.get(key, _ABSENT)
    other = next(r for r in runs if r.config.get(key, _ABSENT) != first)
    return (f"{key}: {_text(first)[:40]} in {runs[0].path}, {_text(other.config.get(key, _ABSENT))[:40]} "
            f"in {other.path}")


def _seed_text(r: Run) -> str:
    return ", ".join(f"{k}={_text(v)}" for k, v in zip(SEED_KEYS, r.seeds()))


# -- paired differences --------------------------------------------------------------------------------------

def _pair(g: Group, ref: Group, metrics: Sequence[str]) -> None:
    """Fill ``g.diffs`` (mean ± SE of same-seed differences to ``ref``) and ``g.unpaired``."""
    ref_by_seed = {r.seeds(): r for r in ref.runs}
    mine = {r.seeds() for r in g.runs}
    pairs = [(r, ref_by_seed[r.seeds()]) for r in g.runs if r.seeds() in ref_by_seed]
    g.unpaired = [r.path for r in g.runs if r.seeds() not in ref_by_seed]
    g.unpaired += [r.path for r in ref.runs if r.seeds() not in mine]
    for m in metrics:
        vals = [(metric_value(a, m), metric_value(b, m)) for a, b in pairs]
        g.diffs[m] = _stat([a - b for a, b in vals if a is not None and b is not None],
                           f"{m}: group {g.label!r} minus {ref.label!r}")


def _find_group(groups: Sequence[Group], label: str) -> Group:
    for g in groups:
        if g.label == label:
            return g
    raise UsageError(f"--vs {label}: no such group; groups (--by values joined by commas): "
                     + "; ".join(repr(g.label) for g in groups))


def build_table(runs: Sequence[Run], *, by: Sequence[str], metrics: Sequence[str], vs: str | None = None,
                ignore: Sequence[str] = (), skipped: Sequence[Path] = ()) -> ResultsTable:
    """Group ``runs`` by ``by``, check each group (module docstring), compute mean ± SE per metric and, with
    ``vs`` (a group label: the ``by`` values joined by commas), paired differences to that group.

    Raises:
        UsageError: a ``by`` key in no config, an unknown ``vs`` group, no finished run.
        InputError: a group's runs differ in other config keys, or two runs share config and seeds.
    """
    if not runs:
        raise InputError("no finished run (metrics.json) among the run directories: "
                         + ", ".join(str(p) for p in skipped[:3]))
    groups = _group(runs, by)
    skip = set(by) | set(SEED_KEYS) | set(ignore)
    for g in groups:
        _check_group(g, skip)
        g.stats = {m: _stat([v for r in g.runs if (v := metric_value(r, m)) is not None], f"{m} of group {g.label!r}")
                   for m in metrics}
    ref = _find_group(groups, vs) if vs is not None else None
    groups.sort(key=lambda g: g is not ref)  # the reference first, the others in the order found
    for g in groups:
        if ref is not None and g is not ref:
            _pair(g, ref, metrics)
    varied = [k for i, k in enumerate(SEED_KEYS)
              if any(len({r.seeds()[i] for r in g.runs}) > 1 for g in groups)]
    selected = [k for k in dict.fromkeys(k for r in runs for k in r.selected) if k not in by]
    return ResultsTable(list(by), list(metrics), groups, vs, list(skipped), varied, list(ignore),
                        _between_groups(groups, skip), selected)


def _chosen(t: ResultsTable, g: Group) -> list[str]:
    """Each selected key's value(s) in the group's runs (``/``-joined when the group holds several)."""
    return ["/".join(dict.fromkeys(_text(r.config.get(k)) for r in g.runs if k in r.selected)) or "-"
            for k in t.selected]


# -- rendering -----------------------------------------------------------------------------------------------

def _nothing_varied(s: Mapping[str, Any]) -> bool:
    """A mean over two or more runs whose standard error is zero up to float rounding (the mean of equal values
    need not equal them to the last bit): every run gave the same value."""
    return s["n"] >= 2 and s["se"] is not None and s["se"] <= 1e-9 * max(1.0, abs(s["mean"]))


def _pm(s: Mapping[str, Any], sign: bool = False) -> str:
    if s["n"] == 0:
        return "—"
    mean = f"{s['mean']:+.2f}" if sign else f"{s['mean']:.2f}"
    if s["se"] is None:
        return mean
    return f"{mean} ± {s['se']:.2f}" + (f" ({NOTHING_VARIED})" if not sign and _nothing_varied(s) else "")


def _header(t: ResultsTable) -> list[str]:
    cols = [*t.by, "runs", *(f"{k} (val-selected)" for k in t.selected), *t.metrics]
    if t.vs is not None:
        cols += [f"Δ{m}" for m in t.metrics]
    return cols


def _cells(t: ResultsTable, g: Group) -> list[str]:
    row = [*(_text(v) for v in g.values), str(len(g.runs)), *_chosen(t, g)]
    row += [_pm(g.stats[m]) + (f" (n={g.stats[m]['n']})" if 0 < g.stats[m]["n"] < len(g.runs) else "")
            for m in t.metrics]
    if t.vs is not None:
        row += ["reference" if g.label == t.vs else f"{_pm(g.diffs[m], sign=True)} ({g.diffs[m]['n']})"
                for m in t.metrics]
    return row


def table_rows(t: ResultsTable) -> tuple[list[str], list[list[str]]]:
    """The header and the rows of every format's table, as text (the HTML sweep page shows them too)."""
    return _header(t), [_cells(t, g) for g in t.groups]


def _markdown(t: ResultsTable) -> str:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
    head = _header(t)
    lines = [line(head), "|" + "---|" * len(head), *(line(_cells(t, g)) for g in t.groups), ""]
    return "\n".join(lines + [f"- {n}" for n in t.notes()]) + "\n"


def _csv(t: ResultsTable) -> str:
    head = [*t.by, "runs", *(f"{k} (val-selected)" for k in t.selected)] + [f"{m}_{s}" for m in t.metrics for s in ("mean", "se", "n")]
    if t.vs is not None:
        head += [f"d_{m}_{s}" for m in t.metrics for s in ("mean", "se", "n")]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(head)
    for g in t.groups:
        row = [*(_text(v) for v in g.values), len(g.runs), *_chosen(t, g)]
        row += [_blank(g.stats[m][s]) for m in t.metrics for s in ("mean", "se", "n")]
        if t.vs is not None:
            row += [_blank(g.diffs.get(m, {}).get(s)) for m in t.metrics for s in ("mean", "se", "n")]
        w.writerow(row)
    return buf.getvalue()


def _blank(v: Any) -> Any:
    return "" if v is None else v


def _json(t: ResultsTable) -> str:
    groups = [{"label": g.label, "values": dict(zip(t.by, g.values)), "runs": [str(r.path) for r in g.runs],
               "seeds": [dict(zip(SEED_KEYS, r.seeds())) for r in g.runs], "metrics": g.stats,
               **({"val_selected": dict(zip(t.selected, _chosen(t, g)))} if t.selected else {}),
               **({"vs": g.diffs, "unpaired": [str(p) for p in g.unpaired]}
                  if t.vs and g.label != t.vs else {})}
              for g in t.groups]
    doc = {"by": t.by, "metrics": t.metrics, "vs": t.vs, "seed_keys": list(SEED_KEYS),
           "seeds_varied": t.seeds_varied, "ignored": t.ignored, "groups_differ_also_in": t.between,
           "groups": groups,
           "skipped": [str(p) for p in t.skipped], "notes": t.notes()}
    return json.dumps(doc, indent=2) + "\n"


def _rich(t: ResultsTable, width: int) -> str:
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    head, rows = _header(t), [_cells(t, g) for g in t.groups]
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for i, h in enumerate(head):  # as Text: brackets in config values are not markup
        table.add_column(Text(h), no_wrap=True, justify="left" if i < len(t.by) else "right")
    for row in rows:
        table.add_row(*(Text(c) for c in row))
    needed = sum(max(len(c) for c in col) + 3 for col in zip(head, *rows)) + 4
    buf = io.StringIO()  # wider than the terminal rather than cut: the terminal wraps, numbers stay whole
    Console(file=buf, width=max(width, needed), no_color=True, highlight=False).print(table, markup=False)
    return buf.getvalue() + "".join(f"{n}\n" for n in t.notes())


def render(t: ResultsTable, fmt: str, *, width: int = 120) -> str:
    """The table as text: ``table`` (a rich box table and the notes), ``md``, ``csv`` or ``json``."""
    if fmt == "md":
        return _markdown(t)
    if fmt == "csv":
        return _csv(t)
    if fmt == "json":
        return _json(t)
    if fmt == "table":
        return _rich(t, width)
    raise UsageError(f"--format {fmt}: expected one of {', '.join(FORMATS)}")
