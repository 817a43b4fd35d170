"""``clmerge sweep``: a base config crossed with a grid of overrides, one run directory per cell.

The work is :func:`clmerge.sweep.run_sweep` (docs/sweeps.md); ``clmerge run --seeds`` (:mod:`.run`) is its
one-key form.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import typer

from .base import app, err, fail, make_console
from ..errors import UsageError, clip
from ..plugins import PLUGIN_HELP

__all__ = ["sweep_command", "run_spec", "dry_run_spec", "next_commands"]

console = make_console()


@app.command("sweep")
def sweep_command(
    spec: Path = typer.Argument(..., help="sweep spec YAML: base, set, grid, link, select (docs/sweeps.md)"),
    out: Path | None = typer.Option(None, "--out", help="sweep directory: one run directory per cell, sweep.yaml, "
                                    "cells.json"),
    resume: bool = typer.Option(False, "--resume", help="skip finished cells, continue interrupted ones (the "
                                "spec may add grid values)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the cells and check every cell's config; run "
                                 "and write nothing"),
    jobs: int = typer.Option(0, "--jobs", min=0, help="local: cells in parallel worker processes (0: one after "
                             "another in this process)"),
    nproc: int = typer.Option(1, "--nproc", min=1, help="each cell as its own data-parallel torchrun job of N "
                              "processes (as `clmerge run --nproc N`), one cell after another; with --jobs J, J "
                              "such jobs at once (J x N processes)"),
    backend: str = typer.Option("local", "--backend", help="local (in process / --jobs pool) or ray"),
    address: str | None = typer.Option(None, "--address", help="Ray: an existing cluster (auto, HOST:PORT, "
                                       "ray://...); default: start a local one"),
    plugin: list[str] = typer.Option([], "--plugin", help=PLUGIN_HELP + "; cells then run in this process"),
    max_cells: int | None = typer.Option(None, "--max-cells", min=1, help="refuse a grid of more cells than this "
                                         "(default 10,000; the count is the product of the grid's list lengths)"),
) -> None:
    """Run a grid of experiments (methods x seeds x ...), one run directory per cell.

    The spec must have a grid (an empty spec or one without a grid is a usage error, not a one-cell sweep of
    the base config), and at most ``--max-cells`` cells (default 10,000, as ``merge --tune``'s grid), counted
    as the product of the grid's list lengths before any cell is built or anything is written. A cell's
    folder is a slug of its grid values (``..`` or an over-long value get a safe name with a hash), always
    directly inside ``--out``; a cell folder that is a symlink is refused (exit 5), never written through.
    """
    from ..config import ConfigError
    from ..plugins import load_plugins
    from ..sweep import load_spec
    from ..sweep.grid import MAX_CELLS, check_cell_count

    _check_processes(jobs, nproc, backend)
    if plugin and (jobs or nproc > 1 or backend != "local"):
        raise UsageError("--plugin registers its names in this process only: it does not combine with --jobs, "
                         "--nproc or --backend ray")
    load_plugins(plugin)
    try:
        sweep = load_spec(spec)
    except ConfigError as exc:
        fail(exc)
    sweep.max_cells = MAX_CELLS if max_cells is None else max_cells
    check_cell_count(sweep, sweep.max_cells, source=f"{spec}: grid")
    resume_cmd = f"clmerge sweep {shlex.quote(str(spec))} --out {shlex.quote(str(out))} --resume"
    resume_cmd += f" --nproc {nproc}" if nproc > 1 else ""
    if dry_run:
        return dry_run_spec(sweep, nproc)
    if out is None:
        raise UsageError("clmerge sweep needs --out DIR (the sweep directory)")
    run_spec(sweep, out, resume=resume, backend=backend, jobs=jobs, address=address, nproc=nproc,
             resume_command=resume_cmd)


def _check_processes(jobs: int, nproc: int, backend: str) -> None:
    """``--jobs`` and ``--nproc`` each, and ``--jobs`` x ``--nproc`` processes together, within the machine's
    bound; ``--nproc`` launches torchrun on this machine, so not from Ray workers."""
    from ..utils.threads import check_jobs

    try:
        check_jobs(jobs)
        check_jobs(nproc, "--nproc")
        if jobs and nproc > 1:
            check_jobs(jobs * nproc, f"--jobs {jobs} x --nproc {nproc} (processes at once)")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if nproc > 1 and backend != "local":
        raise UsageError("--nproc launches torchrun on this machine: it does not combine with --backend ray "
                         "(run a torchrun job per cell locally, or Ray cells in one process each)")


def _check_backend(backend: str) -> None:
    if backend not in ("local", "ray"):
        raise UsageError(f"--backend {clip(repr(backend), 60)}: expected local or ray")


def dry_run_spec(sweep, nproc: int = 1) -> None:
    """Print every cell and its overrides after validating its config (and, with ``nproc`` > 1, its batch size
    against the processes); nothing is written. With a ``select`` block, the selection cells first, then the
    grid's cells with the key shown as chosen on validation."""
    from ..config import ConfigError
    from ..sweep.runner import check_nproc, plan_selection, plan_sweep

    try:
        plan, sel_plan = plan_sweep(sweep), plan_selection(sweep)
        check_nproc(sel_plan + plan, nproc)
    except (ConfigError, ValueError) as exc:
        fail(exc)
    key = sweep.select.key if sweep.select is not None else None
    if sel_plan:
        _say(f"phase 1, selection of {key} on validation (scored on the val split only; extended at an edge "
             f"up to {sweep.select.extend} more values per group):")
        _print_cells(sel_plan, None)
        _say(f"phase 2, the grid with the {key} chosen on validation:")
    _print_cells(plan, key)
    n = f"{len(sel_plan)} selection cells + {len(plan)} cells" if sel_plan else f"{len(plan)} cells"
    _say(f"{n}; every config is valid")


def _say(line: str) -> None:
    console.print(line, markup=False, highlight=False, soft_wrap=True)


def _print_cells(plan: list, chosen_key: str | None) -> None:
    for cell, _ in plan:
        sets = " ".join(f"{k}={'(chosen on validation)' if k == chosen_key else v}" for k, v in cell.overrides.items())
        _say(f"{cell.name:<30} {sets}")


def run_spec(sweep, out: Path, *, resume: bool, backend: str = "local", jobs: int = 0,
             address: str | None = None, nproc: int = 1, resume_command: str) -> None:
    """Run a sweep from the command line: typed errors as one line, Ctrl-C as the ``--resume`` hint."""
    from ..config import ConfigError
    from ..sweep import SweepError, run_sweep

    _check_backend(backend)
    log = lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True)  # noqa: E731
    try:
        run_sweep(sweep, out, resume=resume, backend=backend, jobs=jobs, address=address, nproc=nproc, log=log)
    except KeyboardInterrupt:
        err.print(f"\ninterrupted: finished cells and tasks are kept; continue with: {resume_command}",
                  highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(130)
    except (ConfigError, FileExistsError, FileNotFoundError, ValueError, SweepError) as exc:
        fail(exc)
    console.print(f"sweep directory: {out.absolute()} (cells.json lists every cell and its overrides)",
                  markup=False, highlight=False, soft_wrap=True)
    console.print(next_commands(out), markup=False, highlight=False, soft_wrap=True)


def next_commands(out: Path) -> str:
    """The closing hint of a sweep: the commands that read its runs."""
    d = shlex.quote(str(out))
    return f"next: clmerge results {d}   (the table over seeds)   clmerge report {d}   (the HTML page)"
