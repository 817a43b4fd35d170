"""``clmerge results``: tables across runs (mean ± standard error over seeds, paired differences); the
library part is :mod:`clmerge.report.tables` (docs/results_tables.md)."""

from __future__ import annotations

from pathlib import Path

import typer

from .base import app, by_keys, console, err, print_warning, split_keys

_METRICS_DEFAULT = "acc,aaa,forgetting,til_acc"


def _check_output(output: Path, runs: list[Path]) -> None:
    from ..errors import OutputError
    from ..utils.outpaths import check_not_input, check_writable

    if output.is_dir():
        raise OutputError(f"--output {output}: is a folder; name a file (e.g. {output / 'results.md'})")
    check_writable(output, "--output")
    check_not_input(output, [r / n for r in runs for n in ("config.yaml", "metrics.json")], "--output")


@app.command()
def results(
    dirs: list[Path] = typer.Argument(..., help="run directories, or folders holding them (a sweep's --out; "
                                      "searched two levels down; symlinks inside are skipped with a warning)"),
    by: str = typer.Option("method.name", "--by",
                           help="group by these config keys (comma-separated, dotted)"),
    metrics: str = typer.Option(_METRICS_DEFAULT, "--metrics", help="comma-separated: acc, aaa, forgetting, "
                                "bwt, fwt, plasticity and their TIL forms til_acc, ..."),
    vs: str = typer.Option(None, "--vs", help="reference group (its --by values joined by commas, e.g. "
                           "seq_lora): paired differences against it, paired by seed and scenario.seed"),
    ignore: list[str] = typer.Option([], "--ignore", help="config keys whose differences do not matter "
                                     "(e.g. run.threads); repeat or comma-separate"),
    fmt: str = typer.Option("table", "--format", help="table, md, csv or json"),
    output: Path = typer.Option(None, "--output", help="write the table to this file (atomically) instead "
                                "of printing it"),
) -> None:
    """Mean ± standard error over seeds per group of runs, paired differences (docs/results_tables.md).

    Every file is read through the input boundary (:mod:`clmerge.utils.inpaths`): a run's ``config.yaml`` and
    ``metrics.json`` must resolve inside its run directory, ``metrics.json`` is strict JSON (no NaN/Infinity)
    and every mean must be finite (InputError, exit 3). A symlinked entry inside a folder of runs is never
    followed: it is skipped with a warning naming it, as git treats a symlink to a folder.
    """
    from ..errors import UsageError
    from ..report import tables
    from ..utils.io import atomic_write_text

    if fmt not in tables.FORMATS:
        raise UsageError(f"--format {fmt}: expected one of {', '.join(tables.FORMATS)}")
    names, keys = tables.parse_metrics(metrics), by_keys(by)
    done, unfinished = tables.find_runs(dirs, warn=print_warning)
    if output is not None:
        _check_output(output, done + unfinished)
    table = tables.build_table(tables.load_runs(done), by=keys, metrics=names, vs=vs, ignore=split_keys(ignore),
                               skipped=unfinished)
    text = tables.render(table, fmt, width=console.width)
    if output is not None:
        atomic_write_text(output, text)
        console.print(f"wrote {output}", highlight=False, markup=False)
    else:
        typer.echo(text, nl=False)
    if fmt == "csv":
        for note in table.notes():
            err.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)
