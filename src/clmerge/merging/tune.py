"""A merge tuned on the user's data: search a recipe's free hyperparameters for the lowest held-out perplexity,
or the highest task accuracy (``clmerge merge RECIPE --tune TUNE.yaml --out DIR``; docs/tuning.md).

```yaml
search: grid               # grid (no extra package) | optuna (TPE; pip install "clmerge[tune]")
points: 5                  # grid: points per [low, high] range
trials: 30                 # optuna: number of trials
seed: 0
space:                     # recipe paths -> [low, high] (a float range) or {values: [...]} (given values)
  models[1].parameters.weight: [0.0, 1.0]
  parameters.density: [0.1, 0.9]
  overrides[0].parameters.density[1]: [0.1, 0.9]   # one value of a per-layer gradient
eval: {data: heldout.txt, max_length: 512, stride: 256, batch_size: 4, max_samples: 200}
extend: 2                  # grid: steps past an edge of a range when the best value sits on it
```

``eval:`` is what ``clmerge eval`` measures (:class:`.task_eval.EvalSpec`): texts (perplexity, minimised),
multiple-choice or labelled examples (accuracy, maximised), or lm-evaluation-harness ``tasks``. When the
grid's best value of a ``[low, high]`` range is its lowest or highest value, the search warns and tries
points past that edge, one grid step at a time (:func:`clmerge.utils.grid_edge.past_edge`, the rule of a
sweep's ``select:``), at most ``extend`` of them per range; a value the recipe refuses there (a density
above 1) stops it with a warning.

Each trial writes the recipe with its values, streams the merge into a temporary folder under ``DIR/tune``,
scores it (:func:`.lm_eval.perplexity`) and removes it. ``DIR/tune/trials.csv`` gets one row per finished
trial; a rerun with the same ``--out`` skips the trials already there (resume). The best recipe is merged
into ``DIR``; ``DIR/tune/best_recipe.yaml`` (the recipe with the chosen values, as a merge records it) is
written last. Trials run through any executor with
``submit``/``wait_any``/``result`` (:mod:`clmerge.sweep.executors`: in process, a process pool, Ray).
"""

from __future__ import annotations

import csv
import io
import itertools
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError, OutputError, UsageError
from ..utils.extras import require_extra
from ..utils.inpaths import read_text
from ..utils.io import atomic_write_text
from ..utils.outpaths import check_output_dir
from ..utils.yaml_io import load_yaml, read_yaml
from ..utils.grid_edge import past_edge
from .recipes import Recipe, recipe_of
from .task_eval import EvalSpec, evaluate_folder

__all__ = ["Dimension", "TuneSpec", "load_tune_spec", "run_trial", "set_path", "tune"]

MAX_TRIALS = 10_000
_STEP = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


@dataclass(frozen=True)
class Dimension:
    """One searched value: a recipe ``path``, and a float range (``low``, ``high``) or given ``values``."""

    path: str
    low: float | None = None
    high: float | None = None
    values: tuple = ()

    def grid(self, points: int) -> list:
        if self.values:
            return list(self.values)
        if points == 1:
            return [(self.low + self.high) / 2]
        return [round(self.low + (self.high - self.low) * i / (points - 1), 12) for i in range(points)]


@dataclass
class TuneSpec:
    space: list[Dimension]
    eval: EvalSpec
    search: str = "grid"
    points: int = 5
    trials: int = 20
    seed: int = 0
    source: str = "TUNE"
    extend: int = 2


def _parse_path(path: str, where: str) -> list[str | int]:
    steps, pos = [], 0
    for m in _STEP.finditer(path):
        if m.start() != pos + (1 if pos and path[pos] == "." else 0):
            break
        steps.append(m.group(1) if m.group(1) is not None else int(m.group(2)))
        pos = m.end()
    if pos != len(path) or not steps:
        raise UsageError(f"{where}: {path!r} is not a recipe path (e.g. models[1].parameters.weight)")
    return steps


def set_path(data: dict, path: str, value: Any, where: str = "space") -> None:
    """Set ``value`` at ``path`` (``a.b[1].c``) in ``data``: list items must exist, a missing mapping key
    is created."""
    steps = _parse_path(path, where)
    node: Any = data
    for i, step in enumerate(steps):
        last = i == len(steps) - 1
        if isinstance(step, int):
            if not isinstance(node, list) or step >= len(node):
                raise UsageError(f"{where}.{path}: the recipe has no item [{step}] there")
        elif not isinstance(node, dict):
            raise UsageError(f"{where}.{path}: the recipe has no mapping at {step!r}")
        if last:
            node[step] = value
        elif isinstance(step, str) and step not in node:
            node[step] = {}
        node = node[step]


def _dimension(path: str, spec: Any, where: str) -> Dimension:
    if isinstance(spec, dict) and set(spec) == {"values"} and isinstance(spec["values"], list) and spec["values"]:
        return Dimension(path, values=tuple(spec["values"]))
    ok = (isinstance(spec, list) and len(spec) == 2
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in spec))
    if not ok or not spec[0] < spec[1]:
        raise UsageError(f"{where}.space.{path}: expected [low, high] with low < high, or {{values: [...]}}, "
                         f"got {spec!r}")
    return Dimension(path, low=float(spec[0]), high=float(spec[1]))


_TOP_KEYS = {"search", "points", "trials", "seed", "space", "eval", "extend"}
_EVAL_KEYS = {"data", "tasks", "metric", "max_length", "stride", "batch_size", "max_samples", "num_fewshot",
              "delimiter"}


def load_tune_spec(path: str | Path) -> TuneSpec:
    """Read and check a tune file; a relative ``eval.data`` is read from the tune file's folder."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--tune {path}: no such file")
    data = read_yaml(path)
    where = str(path)
    if not isinstance(data, dict):
        raise UsageError(f"{where}: expected a mapping with space: and eval:")
    for key, allowed in (("", _TOP_KEYS), ("eval", _EVAL_KEYS)):
        block = data if not key else data.get(key) or {}
        unknown = sorted(set(block) - allowed) if isinstance(block, dict) else []
        if unknown:
            raise UsageError(f"{where}: unknown key {(key + '.' if key else '') + unknown[0]} "
                             f"(expected one of {', '.join(sorted(allowed))})")
    space, ev = data.get("space"), data.get("eval")
    if not isinstance(space, dict) or not space:
        raise UsageError(f"{where}: space: expected a mapping of recipe paths to ranges")
    spec = TuneSpec(space=[_dimension(str(p), s, where) for p, s in space.items()], eval=_eval_spec(ev, path),
                    search=data.get("search", "grid"), points=data.get("points", 5), trials=data.get("trials", 20),
                    seed=data.get("seed", 0), source=where, extend=data.get("extend", 2))
    return _check_spec(spec)


def _eval_spec(ev: Any, path: Path) -> EvalSpec:
    """The ``eval:`` block: ``data`` (read from the tune file's folder when relative) or ``tasks`` (a list or a
    comma-separated string of lm-evaluation-harness tasks), and the options of ``clmerge eval``."""
    has_data = isinstance(ev, dict) and isinstance(ev.get("data"), str)
    tasks = ev.get("tasks") if isinstance(ev, dict) else None
    tasks = [t.strip() for t in tasks.split(",") if t.strip()] if isinstance(tasks, str) else tasks
    if not has_data and not (isinstance(tasks, list) and tasks and all(isinstance(t, str) for t in tasks)):
        raise UsageError(f"{path}: eval.data: expected the path of the held-out file (texts, multiple-choice or "
                         "labelled examples), or eval.tasks: lm-evaluation-harness tasks")
    fields = {k: v for k, v in ev.items() if k not in ("data", "tasks")}
    if has_data:
        fields["data"] = str(Path(ev["data"]) if Path(ev["data"]).is_absolute() else path.parent / ev["data"])
    spec = EvalSpec(tasks=tuple(tasks or ()), **fields)
    spec.perplexity_options().check()  # its numbers (the data is read by tune(), before any merge)
    return spec


def _check_spec(spec: TuneSpec) -> TuneSpec:
    if spec.search not in ("grid", "optuna"):
        raise UsageError(f"{spec.source}: search: expected grid or optuna, got {spec.search!r}")
    for name, low in (("points", 1), ("trials", 1), ("extend", 0)):
        value = getattr(spec, name)
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= MAX_TRIALS:
            raise UsageError(f"{spec.source}: {name}: expected an integer from {low} to {MAX_TRIALS}, got {value!r}")
    if spec.search == "grid":
        n = 1
        for d in spec.space:
            n *= len(d.grid(spec.points))
        if n > MAX_TRIALS:
            raise UsageError(f"{spec.source}: the grid has {n} points (more than {MAX_TRIALS}): lower points:")
    return spec


def recipe_with(recipe: Recipe, values: dict[str, Any], source: str = "space") -> Recipe:
    """``recipe`` with each path set to its value (checked again as a recipe: a bad value names its key)."""
    data = recipe.model_dump(exclude_unset=True)
    for path, value in values.items():
        set_path(data, path, value, source)
    return recipe_of(data)


def run_trial(recipe: Recipe, values: dict, opts: EvalSpec, workdir: str) -> dict:
    """One trial (a top-level function, so a process pool or Ray can run it): merge into ``workdir``, score,
    remove ``workdir``. Returns the values, the metric and the wall time."""
    from .run import run_merge

    start = time.perf_counter()
    folder = Path(workdir)
    try:
        run_merge(recipe_with(recipe, values), folder, hash_inputs=False)
        res = evaluate_folder(folder, opts, progress=False, quiet=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"values": values, "metric": res["value"], "name": res["metric"],
            "seconds": round(time.perf_counter() - start, 3)}


# --- the search ---

def grid_points(spec: TuneSpec) -> list[dict]:
    """Every point of the grid, in row-major order of ``space``."""
    axes = [d.grid(spec.points) for d in spec.space]
    return [dict(zip((d.path for d in spec.space), combo)) for combo in itertools.product(*axes)]


def _key(values: dict) -> tuple:
    return tuple(sorted((k, repr(float(v)) if isinstance(v, (int, float)) and not isinstance(v, bool) else repr(v))
                        for k, v in values.items()))


class _Table:
    """``DIR/tune/trials.csv``: one row per finished trial, rewritten atomically after each; read back on
    resume."""

    def __init__(self, path: Path, space: list[Dimension], higher_is_better: bool = False) -> None:
        self.path, self.paths, self.higher = path, [d.path for d in space], higher_is_better
        self.rows: list[dict] = self._read() if path.is_file() else []

    def _read(self) -> list[dict]:
        rows = list(csv.DictReader(io.StringIO(read_text(self.path, within=self.path.parent))))
        if rows and set(self.paths) - set(rows[0]):
            raise InputError(f"{self.path}: its columns do not match the tune file's space: (another search "
                             "was run into this --out; give a new --out)")
        def value(r: dict, p: str) -> Any:
            return load_yaml(r[p], source=f"{self.path}: {p}")

        return [{"trial": int(r["trial"]), "values": {p: value(r, p) for p in self.paths},
                 "metric": float(r["metric"]), "seconds": float(r["seconds"])} for r in rows]

    def add(self, row: dict) -> None:
        self.rows.append(row)
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["trial", *self.paths, "metric", "seconds"])
        for r in self.rows:
            w.writerow([r["trial"], *(r["values"][p] for p in self.paths), repr(r["metric"]), r["seconds"]])
        atomic_write_text(self.path, buf.getvalue())

    def done(self) -> set:
        return {_key(r["values"]) for r in self.rows}

    def best(self) -> dict:
        """The best row: the lowest metric (perplexity), or the highest (accuracy); a tie: the earlier."""
        sign = -1 if self.higher else 1
        return min(self.rows, key=lambda r: sign * r["metric"])


def _run_points(points: list[dict], recipe: Recipe, spec: TuneSpec, table: _Table, executor: Any,
                jobs: int, log: Any) -> list[dict]:
    """Run ``points`` with at most ``jobs`` in flight; rows in completion order."""
    pending, handles, out = list(points), {}, []
    while pending or handles:
        while pending and len(handles) < max(jobs, 1):
            values = pending.pop(0)
            workdir = str(table.path.parent / "trials" / f"trial_{len(table.rows) + len(handles)}_{time.time_ns()}")
            handles[executor.submit(run_trial, recipe, values, spec.eval, workdir)] = values
        h = executor.wait_any(list(handles))
        values = handles.pop(h)
        res = executor.result(h)
        row = {"trial": len(table.rows), "values": values, "metric": res["metric"], "seconds": res["seconds"]}
        table.add(row)
        out.append(row)
        log(f"trial {row['trial']}: {values} {res['name']} {res['metric']:.4f} ({res['seconds']:.1f} s)")
    return out


def _search_grid(recipe: Recipe, spec: TuneSpec, table: _Table, executor: Any, jobs: int, log: Any) -> None:
    todo = [p for p in grid_points(spec) if _key(p) not in table.done()]
    if len(todo) < len(grid_points(spec)):
        log(f"resume: {len(grid_points(spec)) - len(todo)} grid points already in {table.path}")
    _run_points(todo, recipe, spec, table, executor, jobs, log)


def _search_optuna(recipe: Recipe, spec: TuneSpec, table: _Table, executor: Any, jobs: int, log: Any) -> None:
    """Optuna's TPE sampler (Bergstra et al. 2011) through ask/tell: ``jobs`` trials asked at once; the rows
    already in the table are told first (resume)."""
    optuna = require_extra("optuna", "tune", what="search: optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    dists = {d.path: (optuna.distributions.CategoricalDistribution(list(d.values)) if d.values
                      else optuna.distributions.FloatDistribution(d.low, d.high)) for d in spec.space}
    study = optuna.create_study(direction="maximize" if table.higher else "minimize",
                                sampler=optuna.samplers.TPESampler(seed=spec.seed))
    for r in table.rows:
        study.add_trial(optuna.trial.create_trial(params=r["values"], distributions=dists, value=r["metric"]))
    while len(table.rows) < spec.trials:
        asked = [study.ask(dists) for _ in range(min(max(jobs, 1), spec.trials - len(table.rows)))]
        rows = _run_points([t.params for t in asked], recipe, spec, table, executor, jobs, log)
        by_key = {_key(r["values"]): r["metric"] for r in rows}
        for t in asked:
            study.tell(t, by_key[_key(t.params)])


#: The files that mark a folder as a tune's own output (written into again on resume).
_TUNE_FILES = ("tune/trials.csv", "tune/best_recipe.yaml")


def check_tune_out(out: Path, overwrite: bool, inputs: list[Path] = ()) -> None:
    """``out`` must be new, empty, or an unfinished tune (``tune/trials.csv`` and no ``best_recipe.yaml``,
    resumed); ``--overwrite`` replaces a finished tune, and nothing else. Whether ``out`` may be written at all
    (a file, an input or a folder inside one, no permission) is the one output guard's rule
    (:func:`clmerge.utils.outpaths.check_output_dir`); ``inputs``: the recipe's model paths."""
    finished = out.is_dir() and (out / "tune" / "best_recipe.yaml").is_file()
    ours = finished or (out.is_dir() and (out / "tune" / "trials.csv").is_file())
    if out.is_dir() and any(out.iterdir()) and not ours:  # --overwrite never replaces a foreign folder
        raise OutputError(f"--out {out}: exists and holds no tune (tune/trials.csv): give a new folder")
    check_output_dir(out, flag="--out", inputs=inputs, ours=_TUNE_FILES, inside_inputs=False)
    if finished:
        if not overwrite:
            raise OutputError(f"--out {out}: holds a finished tune: give a new folder, or --overwrite to replace it")
        shutil.rmtree(out)


def _recipe_inputs(recipe: Recipe) -> list[Path]:
    """The recipe's local model paths (a tune's output goes into none of them)."""
    specs = [recipe.base] + [m.model for m in recipe.models]
    return [Path(s) for s in specs if isinstance(s, str) and Path(s).exists()]


def tune(recipe: Recipe, spec: TuneSpec, out: Path, *, executor: Any, jobs: int = 1, overwrite: bool = False,
         log: Any = lambda s: None) -> dict:
    """Search, then merge the best recipe into ``out``; returns the best values and metric."""
    from .run import plan

    if recipe.stages or recipe.slices:
        raise UsageError("--tune: searches recipes with models: (not slices: or stages:)")
    check_tune_out(out, overwrite, _recipe_inputs(recipe))  # a bad --out fails before anything is opened
    for end in (0, -1):  # both ends of every range: bad paths, inputs or hyperparameters fail before any merge
        point = {d.path: (d.values[end] if d.values else (d.low, d.high)[end]) for d in spec.space}
        plan(recipe_with(recipe, point, f"{spec.source}: space"))
    spec.eval.check()  # a bad held-out file or metric, a missing lm-eval: before any merge
    if spec.search == "optuna":
        require_extra("optuna", "tune", what="search: optuna")
    (out / "tune").mkdir(parents=True, exist_ok=True)
    table = _Table(out / "tune" / "trials.csv", spec.space, spec.eval.higher_is_better)
    search = _search_grid if spec.search == "grid" else _search_optuna
    try:
        search(recipe, spec, table, executor, jobs, log)
        if spec.search == "grid":
            _extend_edges(recipe, spec, table, executor, jobs, log)
    finally:
        shutil.rmtree(out / "tune" / "trials", ignore_errors=True)
    edges = _at_edges(spec, table, log)
    return {**_finish(recipe, table, out, log), "at_edge": edges, "metric_name": _metric_name(spec.eval)}


def _metric_name(ev: EvalSpec) -> str:
    return "perplexity" if ev.kind == "perplexity" else f"lm_eval {ev.metric or 'acc'}" if ev.tasks \
        else ev.metric or "acc"


# --- the edges of the ranges: warn, and extend the grid past them (the rule of a sweep's select:) ---

def _ranges(spec: TuneSpec) -> list[Dimension]:
    return [d for d in spec.space if not d.values]


def _refused(recipe: Recipe, point: dict, source: str) -> str | None:
    """Why the recipe refuses ``point`` (a value past a range's edge), or None."""
    from .run import plan

    try:
        plan(recipe_with(recipe, point, f"{source}: space"))
    except (ValueError, KeyError, TypeError) as exc:
        return str(exc).splitlines()[0][:160]
    return None


def _extend_edges(recipe: Recipe, spec: TuneSpec, table: _Table, executor: Any, jobs: int, log: Any) -> None:
    """While the best point sits on an edge of a range, try one grid step past it (at most ``spec.extend``
    values past the range per path; a rerun counts the ones already in the table). A value the recipe
    refuses, or whose trial fails, stops that path with a warning."""
    stopped: set[str] = set()
    while True:
        best, points = table.best(), []
        for d in (d for d in _ranges(spec) if d.path not in stopped):
            grid = d.grid(spec.points)
            tried = sorted({float(r["values"][d.path]) for r in table.rows})
            beyond = sum(v < d.low or v > d.high for v in tried)
            value = float(best["values"][d.path])
            nxt = past_edge(grid, tried, value, scale="linear") if beyond < spec.extend else None
            if nxt is None or _key({**best["values"], d.path: nxt}) in table.done():
                continue
            point = {**best["values"], d.path: nxt}
            why = _refused(recipe, point, spec.source)
            if why is not None:
                log(f"warning: best {d.path}={value:g} is at the edge of the values tried; {nxt:g} past it is "
                    f"refused ({why})")
                stopped.add(d.path)
                continue
            log(f"warning: best {d.path}={value:g} is at the edge of the values tried ({min(tried):g} to "
                f"{max(tried):g}); extending the range: trying {nxt:g}")
            points.append((d.path, nxt, point))
        if not points:
            return
        for path, nxt, point in points:
            try:
                _run_points([point], recipe, spec, table, executor, jobs, log)
            except (ValueError, KeyError, TypeError, RuntimeError) as exc:
                log(f"warning: {path}={nxt:g} past the edge failed ({str(exc).splitlines()[0][:160]}); not extended")
                stopped.add(path)


def _at_edges(spec: TuneSpec, table: _Table, log: Any) -> list[str]:
    """The ranges whose best value is still the lowest or highest tried (a warning each: widen ``space:``)."""
    best, out = table.best(), []
    for d in _ranges(spec):
        tried = [float(r["values"][d.path]) for r in table.rows]
        value = float(best["values"][d.path])
        tol = 0.0 if spec.search == "grid" else 0.02 * (d.high - d.low)  # TPE samples a continuum
        if len(set(tried)) > 1 and (value <= min(tried) + tol or value >= max(tried) - tol):
            out.append(d.path)
            log(f"warning: best {d.path}={value:g} is at the edge of the values tried ({min(tried):g} to "
                f"{max(tried):g}); the best may lie beyond: widen space.{d.path}"
                + (" or raise extend:" if spec.search == "grid" else ""))
    return out


def _finish(recipe: Recipe, table: _Table, out: Path, log: Any) -> dict:
    """Merge the best recipe into ``out`` (beside ``tune/``), then write ``tune/best_recipe.yaml``."""
    from .io.output import recipe_header
    from .run import effective_recipe, run_merge

    best = table.best()
    best_recipe = recipe_with(recipe, best["values"])
    staging = out / "tune" / "best_model"
    shutil.rmtree(staging, ignore_errors=True)
    info = run_merge(best_recipe, staging, log=log)
    for item in staging.iterdir():
        target = out / item.name
        if target.is_dir():
            shutil.rmtree(target)
        item.replace(target)
    staging.rmdir()
    # as the merge ran it and as out/clmerge_recipe.yaml records it: every default filled in, version and commit
    atomic_write_text(out / "tune" / "best_recipe.yaml", recipe_header() + effective_recipe(best_recipe).to_yaml())
    return {"best": best["values"], "metric": best["metric"], "trials": len(table.rows), "out": str(out),
            "keys": info.keys}
