"""``clmerge run``, ``report`` and the listings (``methods``, ``datasets``, ``models``, ``configs``).

A run goes to ``--out``, else to ``$CLMERGE_RUNS_DIR/<method>-<dataset>-<time>`` (``./runs`` when unset;
docs/cli.md); the work is :func:`clmerge.engine.run.run_experiment` and its neighbours.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

import typer
from rich.table import Table

from .base import app, by_keys, console, err, exit_with, fail, print_warning, split_keys
from ..errors import ClmergeError, UsageError
from ..plugins import PLUGIN_HELP
from ..utils.inpaths import read_text as read_input_text
from ..utils.threads import check_jobs

RUNS_DIR_ENV = "CLMERGE_RUNS_DIR"  # where `clmerge run` puts a run without --out (default: ./runs)


def _fmt(v) -> str:
    return "—" if v is None else f"{v:.2f}"


def print_results(metrics: dict) -> None:
    """The accuracy matrix and the metrics as tables."""
    R = metrics["accuracy_matrix"]
    t = Table(title=f"accuracy matrix (%) — {metrics.get('method')} on {metrics.get('dataset')} "
                    f"({metrics.get('scenario')}); row i: after task i")
    t.add_column("after")
    for j in range(len(R)):
        t.add_column(f"T{j}", justify="right")
    for i, row in enumerate(R):
        t.add_row(f"task {i}", *[_fmt(v) for v in row])
    console.print(t)
    m = Table(title="metrics (task-weighted; sample-weighted in brackets)")
    for col in ("Acc", "AAA", "forgetting", "BWT", "FWT", "plasticity"):
        m.add_column(col, justify="right")
    m.add_row(*[f"{_fmt(metrics.get(k))}" + (f" ({_fmt(metrics.get(k + '_sample'))})" if k + "_sample" in metrics else "")
                for k in ("acc", "aaa", "forgetting", "bwt", "fwt", "plasticity")])
    til = metrics.get("til")
    if til:
        m.add_row(*[f"TIL {_fmt(til.get(k))}" for k in ("acc", "aaa", "forgetting", "bwt", "fwt", "plasticity")])
    console.print(m)


@app.command()
def run(
    config: str | None = typer.Argument(None, help="a shipped config's name (`clmerge configs` lists them), or a "
                                        "YAML file: an argument with a / or a .yaml/.yml suffix is a path, a bare "
                                        "name a shipped config (./NAME: the file NAME here); default: the "
                                        "embedded default experiment"),
    set_: list[str] = typer.Option([], "--set", help="override a key: dotted.key=value (repeatable)"),
    out: Path | None = typer.Option(None, "--out", help="run directory (default: $CLMERGE_RUNS_DIR/<method>-"
                                    "<dataset>-<time>, or ./runs/... when that is unset; docs/cli.md)"),
    resume: bool = typer.Option(False, "--resume", help="continue a stopped run in --out from its last finished task"),
    orders: int | None = typer.Option(None, "--orders", help="run over N task orders into --out/order_<r>/ and "
                                      "report OPD/MOPD/AOPD (see clmerge.engine.orders)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="check the config here: random-init backbone, tiny "
                                 "look-alike data, 2 steps on the first 2 tasks, 1 evaluation (clmerge.engine.dry_run)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="write the run into an existing non-empty folder "
                                   "that holds no run (files of the same names are replaced)"),
    nproc: int = typer.Option(1, "--nproc", min=1, help="data-parallel processes on this machine: relaunches this "
                              "command under torchrun (docs/scaling.md); the batch size stays the global one"),
    seeds: str | None = typer.Option(None, "--seeds", help="run once per seed into OUT/seed<N>: e.g. 0,1,2; each "
                                      "seed sets the training seed (`seed`) and the class order (scenario.seed), "
                                      "as PILOT's seed does (a one-key `clmerge sweep`, docs/sweeps.md)"),
    fixed_class_order: bool = typer.Option(False, "--fixed-class-order", help="with --seeds: vary only the "
                                           "training seed; the class order stays the config's scenario.seed"),
    plugin: list[str] = typer.Option([], "--plugin", help=PLUGIN_HELP),
) -> None:
    """Run a continual-learning experiment and write a run directory."""
    from ..config import ConfigError, load_config
    from ..engine import distributed
    from ..engine.run import run_experiment
    from ..plugins import load_plugins, open_run_plugins

    load_plugins(plugin)
    if resume and out is not None:  # the run's own plugins, checked, before its config names what they register
        open_run_plugins(out)
    try:
        cfg = load_config(config, set_, note=print_warning)
        check_jobs(nproc, "--nproc")
    except (ConfigError, ValueError) as exc:
        fail(exc)
    if seeds is not None:
        return _run_seeds(config, set_, seeds, out, resume, dry_run, orders, nproc, cfg, fixed_class_order)
    if fixed_class_order:
        exit_with("--fixed-class-order goes with --seeds (it keeps scenario.seed fixed across the seeds)")
    if out is None and not dry_run:
        if resume:
            exit_with("--resume needs --out DIR (the run directory to continue)")
        out = default_run_dir(cfg.method.name, cfg.scenario.dataset)
    if nproc > 1 and not distributed.launched():
        if cfg.train.batch_size < nproc:
            exit_with(f"--nproc {nproc}: train.batch_size={cfg.train.batch_size} gives a process no sample per batch")
        if not dry_run:
            _check_run_out(out, resume, overwrite)
        return _launch(nproc, out)
    if dry_run:
        return _dry_run(cfg)
    main = os.environ.get("RANK", "0") == "0"  # under torchrun only process 0 checks, writes and prints
    if main:
        _check_run_out(out, resume, overwrite)
    if orders is not None:
        if main:
            _say(f"writing the run to {out.absolute()}")
        return _run_orders(cfg, out, orders, resume, _resume_command(config, set_, out, orders))
    try:  # "writing the run to DIR" once the run has passed its checks (a refused run never prints it)
        metrics = run_experiment(cfg, out, resume=resume, announce=_say)
        if not main:
            return
    except KeyboardInterrupt:
        _interrupted(_resume_command(config, set_, out, None))
    except (FileNotFoundError, FileExistsError, ValueError, RuntimeError) as exc:
        fail(exc)
    print_results(metrics)
    console.print(f"run directory: [bold]{out.absolute()}[/] (report: {out.absolute() / 'report.html'})")


def _say(line: str) -> None:
    console.print(line, highlight=False, markup=False, soft_wrap=True)


# --seeds: the class order follows the training seed (the sweep's ``link``), as one seed drives both in PILOT
# (LAMDA-PILOT trainer.py lines 48-55: _set_random(args["seed"]), then DataManager(..., args["seed"], ...), whose
# _setup_data calls np.random.seed(seed) and permutes the classes)
SEEDS_LINK = {"scenario.seed": "seed"}


def _run_seeds(config: str | None, sets: list[str], text: str, out: Path | None, resume: bool, dry_run: bool,
               orders: int | None, nproc: int, cfg, fixed_class_order: bool = False) -> None:
    """``clmerge run --seeds 0,1,2``: the sweep whose one grid key is ``seed`` (cells OUT/seed0, ...); each
    cell's ``scenario.seed`` (the class order) is its seed too, unless ``fixed_class_order``."""
    from ..config import apply_overrides, seed_problem
    from ..sweep.grid import SweepSpec, dotted_items, parse_seeds
    from .sweep import dry_run_spec, run_spec

    if orders is not None:
        raise UsageError("--seeds runs the seeds one after another: it does not combine with --orders")
    seeds = parse_seeds(text)
    for s in seeds:  # the range of the config's seed key (config.SEED_MAX), named as the flag
        if (problem := seed_problem(s, "--seeds")) is not None:
            raise UsageError(problem)
    fixed = dotted_items(apply_overrides({}, sets))
    if "scenario.seed" in fixed and not fixed_class_order:
        raise UsageError(f"--seeds sets scenario.seed (the class order) with each seed; --set scenario.seed="
                         f"{fixed['scenario.seed']} fixes it: add --fixed-class-order to keep that class order, "
                         "or drop the --set")
    spec = SweepSpec(base=str(config) if config is not None else None, set=fixed, grid={"seed": seeds},
                     link={} if fixed_class_order else dict(SEEDS_LINK))
    if dry_run:
        return dry_run_spec(spec, nproc)
    if out is None:
        if resume:
            exit_with("--resume needs --out DIR (the folder of the seeds' runs to continue)")
        out = default_run_dir(cfg.method.name, cfg.scenario.dataset)
    words = ["clmerge", "run", *([str(config)] if config else []), *[w for s in sets for w in ("--set", s)],
             "--seeds", text, *(["--fixed-class-order"] if fixed_class_order else []), "--out", str(out), "--resume",
             *(["--nproc", str(nproc)] if nproc > 1 else [])]
    run_spec(spec, out, resume=resume, nproc=nproc, resume_command=" ".join(shlex.quote(w) for w in words))


def default_run_dir(method: str, dataset: str) -> Path:
    """``$CLMERGE_RUNS_DIR/<method>-<dataset>-<time>`` (``./runs`` when the variable is unset or empty)."""
    root = os.environ.get(RUNS_DIR_ENV, "").strip() or "runs"
    return Path(root).expanduser() / f"{method}-{dataset}-{time.strftime('%Y%m%d-%H%M%S')}"


def _resume_command(config: str | None, sets: list[str], out: Path, orders: int | None) -> str:
    """The command that continues this run: the run directory's own resolved ``config.yaml`` (it holds every
    ``--set`` already, and no later edit of the original file or default changes it) with ``--set`` repeated
    for the record; ``--orders`` runs keep the original config (each order's directory holds its own)."""
    import shlex

    cfg = str(config) if config is not None else None
    if orders is None and (out / "config.yaml").is_file():
        cfg = str(out / "config.yaml")
    words = ["clmerge", "run", *([cfg] if cfg else []), *[w for s in sets for w in ("--set", s)]]
    words += [*(["--orders", str(orders)] if orders is not None else []), "--out", str(out), "--resume"]
    return " ".join(shlex.quote(w) for w in words)


def _interrupted(command: str) -> None:
    err.print(f"\ninterrupted: finished tasks are checkpointed; continue with: {command}", highlight=False,
              markup=False, soft_wrap=True)
    raise typer.Exit(130)


def _launch(nproc: int, out: Path | None) -> None:
    """``clmerge run ... --nproc N``: the same command in N processes under torchrun (one machine; for several
    machines call torchrun yourself: docs/scaling.md). ``--out`` is fixed here so every process agrees."""
    import subprocess

    args, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            args.append(a)
    if out is not None and "--out" not in args:
        args += ["--out", str(out)]
    from ..engine.distributed import torchrun_command

    cmd = torchrun_command(nproc, args)
    err.print(f"launching {nproc} processes: {' '.join(cmd[1:])}", highlight=False, markup=False, soft_wrap=True)
    raise typer.Exit(subprocess.call(cmd))


def _check_run_out(out: Path, resume: bool, overwrite: bool) -> None:
    """Refuse an unusable run directory before anything is loaded or created."""
    from ..utils.outpaths import check_output_dir, check_writable

    if resume:
        check_writable(out)
    else:  # a folder holding a run is refused by run_experiment (it names --resume)
        check_output_dir(out, overwrite=overwrite, ours=("config.yaml", "checkpoints", "order_0"))


def _dry_run(cfg) -> None:
    from ..engine.dry_run import dry_run
    from ..utils.extras import MissingExtraError

    try:
        dry_run(cfg, echo=lambda line: console.print(line, markup=False, highlight=False))
    except MissingExtraError:
        raise  # an install to do, not a failed check: its own line and exit code
    except ClmergeError as exc:  # a config the real run would refuse too (a bad key or bound): its own code
        exit_with(f"dry run failed: {exc}", code=exc.exit_code)
    except Exception as exc:  # noqa: BLE001  (a dry run reports any failure as a failed check)
        exit_with(f"dry run failed: {type(exc).__name__}: {exc}", code=1)


def _run_orders(cfg, out: Path, n: int, resume: bool, resume_command: str) -> None:
    from ..engine.orders import run_orders

    try:
        summary = run_orders(cfg, out, n, resume=resume)
    except KeyboardInterrupt:
        _interrupted(resume_command)
    except (FileNotFoundError, FileExistsError, ValueError, RuntimeError) as exc:
        fail(exc)
    if not summary:  # a data-parallel process other than 0
        return
    console.print(read_input_text(out / "orders_summary.md", within=out))
    console.print(f"order runs in: [bold]{out.absolute()}[/] (report: {out.absolute() / 'orders_report.html'}; "
                  f"mopd {_fmt(summary['mopd'])})")


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="a run directory, or a sweep directory (a folder of run "
                                   "directories): one page comparing its runs"),
    by: str = typer.Option(None, "--by", help="sweep: group by these config keys (comma-separated, dotted; "
                           "default: the sweep's grid keys but the seeds, else method.name)"),
    vs: str = typer.Option(None, "--vs", help="sweep: reference group for paired differences (e.g. seq_lora)"),
    metrics: str = typer.Option(None, "--metrics", help="sweep: the table's metrics (default "
                                "acc,aaa,forgetting,til_acc)"),
    ignore: list[str] = typer.Option([], "--ignore", help="sweep: config keys whose differences do not matter"),
) -> None:
    """(Re)build RUN_DIR/report.html, or a sweep's DIR/report.html (docs/report.md, docs/sweeps.md)."""
    from ..report import build_report, sweep_page

    if not run_dir.is_dir() or sweep_page.is_run_dir(run_dir):
        given = {"--by": by is not None, "--vs": vs, "--metrics": metrics, "--ignore": ignore}
        _sweep_options_unused(given, run_dir)
        try:
            path = build_report(run_dir)
        except (FileNotFoundError, ValueError) as exc:
            fail(exc)
    else:
        path = _sweep_report(run_dir, by, vs, metrics, ignore)
    console.print(f"wrote {path}", highlight=False, markup=False)


def _sweep_options_unused(options: dict, run_dir: Path) -> None:
    given = [k for k, v in options.items() if v]
    if given:
        what = "a run directory" if run_dir.is_dir() else "no folder"
        raise UsageError(f"{', '.join(given)}: only for a sweep directory (a folder of run directories); "
                         f"{run_dir} is {what}")


def _sweep_report(sweep_dir: Path, by: str | None, vs: str | None, metrics: str | None, ignore: list[str]) -> Path:
    from ..report import sweep_page, tables

    names = tables.parse_metrics(metrics) if metrics is not None else list(sweep_page.DEFAULT_METRICS)
    keys = by_keys(by) if by is not None else None
    return sweep_page.build_sweep_page(sweep_dir, by=keys, metrics=names, vs=vs, ignore=split_keys(ignore),
                                      warn=print_warning)


@app.command()
def methods(verbose: bool = typer.Option(False, "--verbose", "-v", help="options, defaults, meaning")) -> None:
    """List the continual-learning methods (with ``--verbose``: each one's options, the head it sets, and the
    learning rate it trains with unless the config sets ``optim.lr``, with where that rate comes from)."""
    from ..methods import available_methods, method_class

    for name, desc in available_methods().items():
        typer.echo(f"{name:<14} {desc}")
        if verbose:
            for line in _method_details(method_class(name)):
                typer.echo(f"    {line}")


def _method_details(cls) -> list[str]:
    """``key (default): description`` per option of a method, then the ``head:`` and ``optim:`` keys it sets
    (the latter with their source: paper, official code or the validation grid)."""
    lines = [f"{key} (default {field.get_default(call_default_factory=True)!r}): {field.description or '-'}"
             for key, field in cls.Options.model_fields.items()]
    if cls.head_defaults:
        lines.append("head: " + ", ".join(f"{k}={v}" for k, v in cls.head_defaults.items()))
    if cls.optim_defaults:
        lines.append("optim: " + ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in cls.optim_defaults.items()) + f"; source: {cls.optim_source}")
    else:
        lines.append("optim: the optim section's defaults (no rate of its own)")
    return lines


@app.command()
def datasets() -> None:
    """List the data sources."""
    from ..data import available_datasets

    for name, desc in available_datasets().items():
        typer.echo(f"{name:<14} {desc}")


@app.command()
def models() -> None:
    """List the backbone presets."""
    from ..models import available_backbones

    for name, desc in available_backbones().items():
        typer.echo(f"{name:<16} {desc}")


@app.command()
def configs() -> None:
    """List the papers' configs shipped with clmerge (run one by name: clmerge run NAME)."""
    from ..paper_configs import available_configs, describe_config

    for name, path in available_configs().items():
        typer.echo(f"{name:<36} {describe_config(path)}")
