"""Run a sweep (``clmerge sweep``, ``clmerge run --seeds``): one run directory per cell, on an executor.

``DIR/sweep.yaml`` is the spec as run, ``DIR/cells.json`` maps each cell's name to its overrides and status
(``done``, ``failed: ...``, ``pending``), and ``DIR/<cell>/`` is an ordinary run directory written by
:func:`clmerge.engine.run.run_experiment`. Every cell's config is validated before the first one runs.

``resume=True``: a cell with ``metrics.json`` is skipped, a cell with a started run (``config.yaml`` and
``manifest.json``) continues through ``run_experiment(resume=True)`` from its last checkpoint, the others
start. The spec may only add cells: a changed base, ``set`` or a removed or changed cell is refused, and so
is a cell whose stored ``config.yaml`` differs from the config the spec now gives it (an edited base file).

With a ``select:`` block (:mod:`.select`), phase 1 runs the selection cells under ``DIR/select/`` (their
statuses in ``DIR/select/cells.json``) and writes ``DIR/selected.json``; then the grid's cells run with the
chosen values. A grid cell whose config is a finished selection cell's (the chosen value at a selection seed)
is copied from it instead of run again.

Every cell's folder is named by :func:`clmerge.utils.outpaths.child` inside ``DIR`` before anything is
written: a cell folder that is a symlink (to another run, another disk) is refused with an
:class:`~clmerge.errors.OutputError` naming the cell, so no run is ever written through a link. A grid of more
cells than ``max_cells`` (:data:`~.grid.MAX_CELLS`, 10,000) is a UsageError before anything is built. Files
read back from ``DIR`` (``sweep.yaml``, ``selected.json``, ``cells.json``, a cell's ``metrics.json``) go
through the input boundary with ``DIR`` (or the cell) as ``within``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import math
import os
import shutil

import yaml

from ..engine.resume import RUN_FILES, check_same_config, recorded_config_sha256
from ..errors import ClmergeError, OutputError, RunStateError, UsageError
from ..utils.inpaths import open_input
from ..utils.io import atomic_write_text, read_json, write_json
from ..utils.outpaths import check_output_dir, child
from ..utils.yaml_io import read_yaml
from .executors import Executor, make_executor
from .grid import Cell, SweepSpec, base_data, cell_config, check_cell_count, expand_cells, spec_from_dict
from .select import (SELECT_DIR, SELECTED_FILE, group_label, groups, phase2_cells, run_selection, selection_plan,
                     val_score)

__all__ = ["SweepError", "plan_sweep", "plan_selection", "run_sweep", "run_cell", "run_cell_torchrun",
           "check_nproc", "cell_state", "read_cells", "cell_dir", "check_selection_count"]

SPEC_FILE, CELLS_FILE = "sweep.yaml", "cells.json"
TORCHRUN_LOGS = ".torchrun"  # with --nproc: each cell's torchrun output, <cell>.log


class SweepError(ClmergeError, RuntimeError):
    """Some cells failed; the others are on disk and ``--resume`` retries the failed ones (exit code 1)."""


def plan_sweep(spec: SweepSpec, chosen: dict[str, Any] | None = None) -> list[tuple[Cell, dict]]:
    """Every cell with its config mapping, each validated (the first bad one: ConfigError naming it). With a
    ``select`` block: the grid's cells with ``chosen`` (group label -> value; None: the first candidate).
    A grid over ``spec.max_cells`` cells: UsageError before any cell is built."""
    check_cell_count(spec, spec.max_cells)
    base = base_data(spec)
    cells = expand_cells(spec) if spec.select is None else phase2_cells(spec, chosen)
    return [(cell, cell_config(base, cell)[0]) for cell in cells]


def plan_selection(spec: SweepSpec) -> list[tuple[Cell, dict]]:
    """The selection cells of the spec's candidate values (before any extension), each validated."""
    if spec.select is None:
        return []
    check_selection_count(spec)
    return selection_plan(spec, base_data(spec), {group_label(g): (g, list(spec.select.values))
                                                  for g in groups(spec)})


def check_selection_count(spec: SweepSpec) -> int:
    """The number of selection cells before any extension (every grid combination but the seed, x each
    candidate value, x each selection seed), refused over ``spec.max_cells`` (UsageError naming the counts)."""
    sel = spec.select
    n = math.prod(len(v) for k, v in spec.grid.items() if k != "seed") * len(sel.values) * len(sel.seeds or [None])
    if n > spec.max_cells:
        raise UsageError(f"select: {len(sel.values)} values of {sel.key} x {len(sel.seeds or [None])} seed(s) x the "
                         f"grid's other combinations = {n:,} selection cells, over the limit of {spec.max_cells:,}; "
                         "raise it with --max-cells N")
    return n


def cell_dir(out: Path, name: str) -> Path:
    """``out/<name>`` (a selection cell: ``out/select/<name>``), each part named by
    :func:`clmerge.utils.outpaths.child`: a part that is a symlink or a special file is refused.

    Raises:
        OutputError: naming the cell and what is in the way.
    """
    path = Path(out)
    try:
        for part in name.split("/"):
            path = child(path, part)
    except OutputError as exc:
        raise OutputError(f"cell {name}: {exc}") from None
    return path


def _check_cell_dirs(out: Path, plans: list[list[tuple[Cell, dict]]]) -> None:
    for plan in plans:
        for cell, _ in plan:
            cell_dir(out, cell.name)


def cell_state(cell_dir: Path) -> str:
    """``done`` (metrics.json), ``started`` (a run's first files, no metrics) or ``new``."""
    if (cell_dir / "metrics.json").is_file():
        return "done"
    return "started" if all((cell_dir / f).is_file() for f in RUN_FILES) else "new"


def run_cell(data: dict, out: str, resume: bool) -> dict[str, Any]:
    """Job: run (or continue) one cell into ``out``; the run's headline metrics."""
    from ..config import parse_config
    from ..engine.run import run_experiment

    metrics = run_experiment(parse_config(data), Path(out), resume=resume)
    return headline(metrics)


def run_cell_torchrun(data: dict, out: str, resume: bool, nproc: int) -> dict[str, Any]:
    """Job: one cell as its own data-parallel job, ``clmerge run CONFIG --out OUT [--resume]`` under torchrun
    in ``nproc`` processes (the relaunch of ``clmerge run --nproc``); the run's headline metrics. The cell's
    config is handed over as a temporary YAML file; what the job prints is appended to
    ``<sweep>/.torchrun/<cell>.log``, and a failed job raises with its last lines and that path."""
    import subprocess
    import tempfile

    from ..config import dump_config, parse_config
    from ..engine.distributed import torchrun_command

    log = child(child(Path(out).parent, TORCHRUN_LOGS), f"{Path(out).name}.log")
    log.parent.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="clmerge-cell-") as tmp, log.open("a", encoding="utf-8") as f:
        cfg = Path(tmp) / "config.yaml"
        cfg.write_text(dump_config(parse_config(data)))
        args = ["run", str(cfg), "--out", out, *(["--resume"] if resume else [])]
        code = subprocess.run(torchrun_command(nproc, args), stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:
        lines = _tail(log).splitlines()
        tail = [ln.strip() for ln in lines if ln.strip()][-2:]
        raise RuntimeError(f"torchrun exited with {code} ({log}): {' | '.join(tail)}")
    metrics = read_json(Path(out) / "metrics.json", within=out)
    return headline(metrics)


def headline(metrics: dict) -> dict[str, Any]:
    """A finished cell's headline: test ``acc``, ``aaa``, ``forgetting``, and the validation score a selection
    chooses by (``val``: :func:`.select.val_score`, None without a validation split)."""
    return {**{k: metrics.get(k) for k in ("acc", "aaa", "forgetting")}, "val": val_score(metrics)}


def _tail(log: Path, size: int = 1 << 16) -> str:
    """The last ``size`` bytes of a cell's torchrun log (read through the input boundary, any length)."""
    with open_input(log, within=log.parent, kind="text", max_bytes=1 << 62) as fh:
        fh.seek(max(0, os.fstat(fh.fileno()).st_size - size))
        return fh.read(size).decode("utf-8", errors="replace")


def check_nproc(plan: list[tuple[Cell, dict]], nproc: int) -> None:
    """Every cell can be split over ``nproc`` processes: its ``train.batch_size`` gives each one a sample."""
    from ..config import ConfigError, parse_config

    if nproc < 2:
        return
    for cell, data in plan:
        batch = parse_config(data).train.batch_size  # the default when the cell does not set it
        if batch < nproc:
            raise ConfigError(f"cell {cell.name}: --nproc {nproc}: train.batch_size={batch} gives a process no "
                              "sample per batch")


def _check_out(out: Path, spec: SweepSpec, cells: list[Cell], resume: bool) -> None:
    """A new sweep needs a new or empty folder; ``--resume`` needs this sweep's folder, a spec that only adds."""
    if not (out / SPEC_FILE).is_file():
        if resume:
            raise RunStateError(f"{out}: holds no sweep to resume (no {SPEC_FILE}); drop --resume to start one")
        check_output_dir(out)
        return
    if not resume:
        raise OutputError(f"--out {out}: already holds a sweep; pass --resume to continue it or choose another --out")
    _check_only_adds(out, spec, cells)


def _check_cells_unchanged(out: Path, plan: list[tuple[Cell, dict]]) -> None:
    """Every cell already on disk was run with the config it has now (a base file edited since: refused,
    naming the cell's config.yaml and the keys), so a skipped cell never stands for another config."""
    from ..config import dump_config, parse_config

    for cell, data in plan:
        cfg_file = out / cell.name / "config.yaml"
        if cfg_file.is_file():
            check_same_config(cfg_file, dump_config(parse_config(data)), recorded_config_sha256(out / cell.name))


def _check_only_adds(out: Path, spec: SweepSpec, cells: list[Cell]) -> None:
    old = spec_from_dict(read_yaml(out / SPEC_FILE, within=out) or {}, source=str(out / SPEC_FILE))
    old.max_cells = spec.max_cells
    for key in ("base", "set", "link", "select"):
        if getattr(old, key) != getattr(spec, key):
            raise RunStateError(f"{out}: the spec's {key} differs from the sweep's {SPEC_FILE}; a resumed sweep "
                                "may only add grid values (start a new --out)")
    new = {c.name: c.overrides for c in cells}
    for cell in expand_cells(old):
        if new.get(cell.name) != cell.overrides:
            raise RunStateError(f"{out}: cell {cell.name} of the sweep is not in the new spec; a resumed sweep may "
                                "only add grid values (start a new --out)")


def run_sweep(spec: SweepSpec, out: Path, *, resume: bool = False, backend: str = "local", jobs: int = 0,
              address: str | None = None, nproc: int = 1, log: Callable[[str], None] = print) -> dict[str, str]:
    """Run every cell of ``spec`` into ``out/<cell>``; returns cell name -> status. ``nproc`` > 1: each cell
    is its own torchrun job of ``nproc`` processes (:func:`run_cell_torchrun`), ``jobs`` of them at once.

    Raises:
        ConfigError: a bad spec or cell config (before anything is written).
        OutputError, RunStateError: ``out`` cannot take this sweep.
        SweepError: some cells failed (the rest are written; ``resume=True`` retries them).
    """
    out = Path(out)
    plan, sel_plan = plan_sweep(spec), plan_selection(spec)
    check_nproc(sel_plan + plan, nproc)
    _check_out(out, spec, expand_cells(spec), resume)
    _check_cell_dirs(out, [sel_plan, plan])
    if resume:
        _check_cells_unchanged(out, sel_plan or plan)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(child(out, SPEC_FILE), yaml.safe_dump(spec.as_dict(), sort_keys=False))

    def new_executor() -> _CellExecutor:
        return _CellExecutor(make_executor(backend, workers=jobs, address=address), nproc)

    if spec.select is not None:
        plan = _select(spec, out, new_executor, log)
        _check_cell_dirs(out, [plan])
        if resume:
            _check_cells_unchanged(out, plan)
    status = {c.name: ("done" if cell_state(out / c.name) == "done" else "pending") for c, _ in plan}
    _write_cells(out / CELLS_FILE, plan, status)
    todo = [(c, d) for c, d in plan if status[c.name] != "done"]
    log(f"{len(plan)} cells, {len(plan) - len(todo)} already done, {len(todo)} to run -> {out}")
    _run_cells(new_executor(), out, todo, status, log, lambda: _write_cells(out / CELLS_FILE, plan, status))
    failed = [n for n, s in status.items() if s.startswith("failed")]
    if failed:
        raise SweepError(f"{len(failed)} of {len(plan)} cells failed ({', '.join(failed[:3])}: {status[failed[0]]});"
                         f" see {out / CELLS_FILE}; --resume retries them")
    return status


def _select(spec: SweepSpec, out: Path, new_executor: Callable[[], _CellExecutor],
            log: Callable[[str], None]) -> list[tuple[Cell, dict]]:
    """Phase 1 (:func:`.select.run_selection`), ``selected.json`` (a resumed sweep must choose what it chose
    before), then the grid's plan with the chosen values, finished selection runs copied into it."""
    def run(plan: list) -> None:
        status = {c.name: ("done" if cell_state(out / c.name) == "done" else "pending") for c, _ in plan}
        todo = [(c, d) for c, d in plan if status[c.name] != "done"]
        log(f"selection on validation: {len(plan)} cells, {len(plan) - len(todo)} already done, {len(todo)} to run")
        save = lambda: _write_cells(out / SELECT_DIR / CELLS_FILE, plan, status)  # noqa: E731
        (out / SELECT_DIR).mkdir(exist_ok=True)
        save()
        if todo:
            _run_cells(new_executor(), out, todo, status, log, save, score="val")
        failed = [n for n, s in status.items() if s.startswith("failed")]
        if failed:
            raise SweepError(f"selection cell {failed[0]} {status[failed[0]]}; no value is chosen without it; "
                             f"see {out / SELECT_DIR / CELLS_FILE}; --resume retries it")

    records, sel_plan = run_selection(spec, base_data(spec), out, run, log)
    _check_same_choice(out / SELECTED_FILE, records)
    write_json(child(out, SELECTED_FILE), {"key": spec.select.key, "metric": spec.select.metric, "split": "val",
                                     "seeds": spec.select.seeds, "groups": records})
    for label, r in records.items():
        edge = " (at the edge of the values tried)" if r["at_edge"] else ""
        log(f"selected {spec.select.key}={r['value']} for {label} on validation{edge}")
    plan = plan_sweep(spec, {label: r["value"] for label, r in records.items()})
    _copy_selection_runs(out, plan, sel_plan, log)
    return plan


def _check_same_choice(path: Path, records: dict[str, dict]) -> None:
    doc = read_json(path, within=path.parent) if os.path.lexists(path) else {}
    old = doc.get("groups", {}) if isinstance(doc, dict) else {}
    for label, r in records.items():
        if label in old and old[label].get("value") != r["value"]:
            raise RunStateError(f"{path}: {label} chose {old[label].get('value')!r}, the selection cells now give "
                                f"{r['value']!r}; start a new --out")


def _copy_selection_runs(out: Path, plan: list, sel_plan: list, log: Callable[[str], None]) -> None:
    """A grid cell not started whose config is a finished selection cell's: a copy of that run."""
    for cell, data in plan:
        if (out / cell.name).exists():
            continue
        src = next((c for c, d in sel_plan if d == data and cell_state(out / c.name) == "done"), None)
        if src is not None:
            tmp = out / f".{cell.name}.copy"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(out / src.name, tmp)
            os.replace(tmp, out / cell.name)
            log(f"{cell.name}: the selection run {src.name} (same config), copied")


class _CellExecutor:
    """An executor whose cells run in process (``nproc`` 1) or as torchrun jobs of ``nproc`` processes."""

    def __init__(self, ex: Executor, nproc: int) -> None:
        self.ex, self.nproc = ex, nproc

    def submit_cell(self, data: dict, out: str, resume: bool) -> Any:
        if self.nproc > 1:
            return self.ex.submit(run_cell_torchrun, data, out, resume, self.nproc)
        return self.ex.submit(run_cell, data, out, resume)


def _run_cells(cx: _CellExecutor, out: Path, todo: list, status: dict[str, str], log: Callable[[str], None],
               save: Callable[[], None], score: str = "acc") -> None:
    """Run ``todo``; each finished cell's line shows ``score``: the test ``acc`` of a grid cell, or the
    validation score (``val``) that a selection cell is chosen by."""
    ex = cx.ex
    try:
        handles = {cx.submit_cell(data, str(cell_dir(out, c.name)), cell_state(out / c.name) == "started"): c
                   for c, data in todo}
        while handles:
            h = ex.wait_any(list(handles))
            cell = handles.pop(h)
            try:
                m = ex.result(h)
                status[cell.name] = "done"
                log(f"{cell.name}: done ({'val acc' if score == 'val' else 'acc'} {_pct(m.get(score))})")
            except Exception as exc:  # noqa: BLE001  (one failed cell does not stop the others)
                status[cell.name] = f"failed: {type(exc).__name__}: {exc}"
                log(f"{cell.name}: {status[cell.name]}")
            save()
    finally:
        ex.close()


def _pct(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}"


def _write_cells(path: Path, plan: list, status: dict[str, str]) -> None:
    cells = {c.name: {"overrides": c.overrides, "status": status[c.name]} for c, _ in plan}
    write_json(child(path.parent, path.name), cells)


def read_cells(out: Path) -> dict[str, dict]:
    """``out/cells.json``: cell name -> {overrides, status}."""
    return read_json(Path(out) / CELLS_FILE, within=out)
