"""``clmerge study``, ``clmerge predict`` and ``clmerge advise``.

The commands are thin: the work is in :func:`clmerge.sweep.run_study` (jobs), :func:`clmerge.sweep.finish_study`
(fits.json, advice.txt, report.html), :mod:`clmerge.theory` (fits, predictions, advice) and
:mod:`clmerge.theory.report` (the HTML page).
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

from .base import app, err, fail, make_console, print_warning, renamed_option
from ..errors import InputError, UsageError, clip

__all__ = ["study_command", "predict_command", "advise_command"]

console = make_console()


@app.command("study")
def study_command(
    spec: Path = typer.Argument(..., help="study spec YAML (see benchmarks/study_smoke.yaml)"),
    out: Path = typer.Option(..., "--out", help="study directory (results.jsonl, fits.json, report.html)"),
    backend: str = typer.Option("local", "--backend", help="local (in process / --jobs pool) or ray"),
    address: str | None = typer.Option(None, "--address", help="Ray: an existing cluster (auto, HOST:PORT, "
                                       "ray://...); default: start a local one"),
    jobs: int = typer.Option(0, "--jobs", min=0, help="local: parallel worker processes (0: in this process)"),
    workers: int | None = typer.Option(None, "--workers", min=0, hidden=True, help="old spelling of --jobs"),
    num_cpus: int | None = typer.Option(None, "--num-cpus", min=1, help="Ray local cluster: CPUs (default: all)"),
    resume: bool = typer.Option(False, "--resume", help="keep finished points in --out, run the rest (the spec "
                                "may add seeds)"),
    cache: Path | None = typer.Option(None, "--cache", help="expert cache directory (default: OUT/experts)"),
    set_: list[str] = typer.Option([], "--set", help="override a spec key: dotted.key=value (repeatable)"),
    fit_only: bool = typer.Option(False, "--fit-only", help="only refit the laws and rebuild the report"),
) -> None:
    """Run an expert-hyperparameter study, fit the laws, write the report."""
    from ..config import ConfigError
    from ..sweep import StudyError, finish_study, run_study
    from ..theory.spec import load_study
    from ..utils.extras import require_extra
    from ..utils.outpaths import check_writable
    from ..utils.threads import check_jobs

    jobs = renamed_option("--workers", "--jobs", workers, jobs, 0)
    try:
        check_jobs(jobs)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if backend not in ("local", "ray"):  # before the study directory is created
        raise UsageError(f"--backend {clip(repr(backend), 60)}: expected local or ray")
    try:
        for module in ("scipy", "matplotlib"):  # the fits and the report, checked before any job runs
            require_extra(module, "study", what="clmerge study")
        if not fit_only:
            check_writable(out)
            study = load_study(spec, set_)
            run_study(study, out, backend=backend, workers=jobs, address=address, num_cpus=num_cpus,
                      resume=resume, cache=cache, log=console.print)
        fits = finish_study(out)
    except KeyboardInterrupt:
        _interrupted(_resume_command(spec, set_, out, backend=backend, address=address, jobs=jobs,
                                     num_cpus=num_cpus, cache=cache))
    except (ConfigError, FileExistsError, FileNotFoundError, ValueError, StudyError) as exc:
        fail(exc)
    n = sum(len(v) for v in fits["laws"].values())
    console.print(f"{n} law fits -> {out / 'fits.json'}; report: {out / 'report.html'}")


def _resume_command(spec: Path, sets: list[str], out: Path, *, backend: str, address: str | None, jobs: int,
                    num_cpus: int | None, cache: Path | None) -> str:
    """The command that continues an interrupted study: the study directory's own ``study.yaml`` (the spec with
    every ``--set`` applied, so later edits of the original file cannot change it), else the spec as given with
    its ``--set`` overrides, and the same backend options."""
    import shlex

    saved = out / "study.yaml"
    words = ["clmerge", "study", str(saved)] if saved.is_file() else \
        ["clmerge", "study", str(spec), *[w for s in sets for w in ("--set", s)]]
    words += ["--out", str(out), "--resume"]
    words += [*(["--backend", backend] if backend != "local" else []), *(["--address", address] if address else []),
              *(["--jobs", str(jobs)] if jobs else []), *(["--num-cpus", str(num_cpus)] if num_cpus else []),
              *(["--cache", str(cache)] if cache else [])]
    return " ".join(shlex.quote(w) for w in words)


def _interrupted(command: str) -> None:
    """Exit 130 (docs/cli_errors.md) with the line that resumes: finished points are in results.jsonl."""
    err.print(f"\ninterrupted: finished points are kept in results.jsonl; continue with: {command}",
              highlight=False, markup=False, soft_wrap=True)
    raise typer.Exit(130)


def _parse_assignments(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"{item!r}: expected NAME=VALUE, e.g. lr=0.02")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise UsageError(f"{item!r}: {value!r} is not a number") from None
    return out


@app.command("predict")
def predict_command(
    study_dir: Path = typer.Argument(..., help="a study directory with fits.json"),
    assignments: list[str] = typer.Argument(None, help="hyperparameters to change, e.g. lr=0.02 steps=80"),
    method: str = typer.Option("weight_average", "--method", help="merge method whose laws to use (as named by "
                               "`clmerge merges`)"),
) -> None:
    """Predict the merged loss at unseen expert hyperparameters, with a 95% interval."""
    from ..theory.analysis import predict
    from ..theory.spec import OLD_METHOD_NAMES
    from ..utils.io import read_json

    if method in OLD_METHOD_NAMES:
        print_warning(f"--method {method}: an old name of {OLD_METHOD_NAMES[method]} (the same merge); it is "
                      f"accepted for one more release")
        method = OLD_METHOD_NAMES[method]
    hp = _parse_assignments(assignments or [])
    try:
        fits = read_json(study_dir / "fits.json", within=study_dir)
        if not isinstance(fits, dict) or not isinstance(fits.get("laws"), dict):
            raise InputError(f"{study_dir / 'fits.json'}: not a study's fits (no 'laws' mapping); refit with "
                             f"clmerge study SPEC --out {study_dir} --fit-only")
        res = predict(fits, method, **hp)
    except (FileNotFoundError, KeyError, ValueError) as exc:
        fail(exc)
    hp = ", ".join(f"{k}={v:g}" for k, v in res["hp"].items()) or "the defaults"
    warn = f" (extrapolated in {', '.join(res['extrapolated'])})" if res["extrapolated"] else ""
    console.print(f"{method} at {hp}: merged loss {res['loss']:.4f} "
                  f"[{res['low']:.4f}, {res['high']:.4f}] (95%){warn}")


@app.command("advise")
def advise_command(study_dir: Path = typer.Argument(..., help="a study directory")) -> None:
    """Plain-words advice: which expert settings merge best and which term of the bound dominates."""
    from ..sweep import finish_study, read_results
    from ..theory.advise import advise
    from ..utils.io import read_json

    if not os.path.lexists(study_dir / "results.jsonl"):
        raise InputError(f"{study_dir}: no results.jsonl (run `clmerge study` first)")
    try:
        fits = (read_json(study_dir / "fits.json", within=study_dir) if os.path.lexists(study_dir / "fits.json")
                else finish_study(study_dir))
    except (FileNotFoundError, ValueError) as exc:
        fail(exc)
    typer.echo(advise(read_results(study_dir), fits))
