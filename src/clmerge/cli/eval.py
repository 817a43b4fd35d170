"""``clmerge eval MODEL --data FILE``: perplexity of a causal LM on a local text or JSONL file
(:mod:`clmerge.merging.lm_eval`), accuracy on multiple-choice or labelled examples, or ``--tasks`` of
lm-evaluation-harness (:mod:`clmerge.merging.task_eval`); and the ``--tune`` part of ``clmerge merge``
(:mod:`clmerge.merging.tune`).

Results are printed as JSON and, with ``--json PATH``, written there (atomically). A progress bar on a
terminal; piped, one plain line every 50 batches and at the end (:mod:`clmerge.utils.progress`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from ..errors import UsageError
from ..utils.outpaths import check_writable
from ..plugins import PLUGIN_HELP, load_plugins
from .base import app, fail

if TYPE_CHECKING:
    from ..merging.recipes import Recipe

__all__ = ["eval_command", "run_tune"]


@app.command("eval")
def eval_command(
    model: Path = typer.Argument(..., help="an HF causal-LM folder, or a continual run directory (clmerge run)"),
    data: str | None = typer.Option(None, "--data", help="model folder: a text file (blank lines separate "
                                    "documents) or a JSONL of {\"text\": ...} (perplexity), of multiple-choice "
                                    "{\"question\", \"choices\", \"answer\"} or labelled {\"text\", \"label\"} "
                                    "examples (accuracy); run directory: a dataset name (clmerge datasets)"),
    tasks: str | None = typer.Option(None, "--tasks", help="lm-evaluation-harness tasks, comma-separated "
                                     "(pip install \"clmerge[lm-eval]\"), instead of --data"),
    metric: str | None = typer.Option(None, "--metric", help="multiple choice: acc (default) or acc_norm; "
                                      "--tasks: the harness's metric to report as value (default acc)"),
    num_fewshot: int | None = typer.Option(None, "--num-fewshot", help="--tasks: few-shot examples per prompt"),
    data_option: list[str] = typer.Option([], "--data-option", help="run directory: a dataset option "
                                          "key=value (repeatable), as scenario.options"),
    max_length: int = typer.Option(1024, "--max-length", help="tokens per window"),
    stride: int | None = typer.Option(None, "--stride", help="sliding-window stride (default: --max-length, "
                                      "disjoint windows)"),
    batch_size: int = typer.Option(4, "--batch-size", help="windows (or images) per forward pass"),
    max_samples: int | None = typer.Option(None, "--max-samples", help="score only the first N documents"),
    json_out: Path | None = typer.Option(None, "--json", help="also write the result here (JSON)"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="a progress bar or progress lines"),
    plugin: list[str] = typer.Option([], "--plugin", help=PLUGIN_HELP + "; a run directory's recorded plugins "
                                     "are imported without it"),
) -> None:
    """Perplexity of a causal LM on held-out text, its accuracy on multiple-choice or labelled examples or on
    lm-evaluation-harness tasks, or accuracy of a continual run's model on a dataset (docs/tuning.md)."""
    load_plugins(plugin)  # a run directory's own recorded plugins: engine.export.load_run_model
    try:
        if json_out is not None:
            check_writable(json_out, "--json")
        if (model / "config.yaml").is_file():
            if data is None:
                raise UsageError("--data: a run directory is measured on a dataset (clmerge datasets)")
            from ..utils.progress import progress_enabled

            with progress_enabled(progress):  # the evaluation's progress lines (--no-progress: none)
                res = _accuracy(model, data, data_option, batch_size)
        else:
            res = _folder(model, data, tasks, metric, num_fewshot, max_length, stride, batch_size, max_samples,
                          progress)
        if json_out is not None:
            from ..utils.io import write_json  # torch: imported only when needed

            write_json(json_out, res)
    except (ValueError, OSError, KeyError, TypeError) as exc:
        fail(exc)
    typer.echo(json.dumps(res, indent=2))


def _folder(model: Path, data: str | None, tasks: str | None, metric: str | None, num_fewshot: int | None,
            max_length: int, stride: int | None, batch_size: int, max_samples: int | None, progress: bool) -> dict:
    """A model folder: perplexity, multiple-choice or classification accuracy, or lm-evaluation-harness tasks
    (:mod:`clmerge.merging.task_eval`)."""
    from ..merging.task_eval import EvalSpec, evaluate_folder

    names = tuple(t.strip() for t in tasks.split(",") if t.strip()) if tasks is not None else ()
    if tasks is not None and not names:
        raise UsageError("--tasks: expected task names, comma-separated (e.g. hellaswag,arc_easy)")
    spec = EvalSpec(data=data, tasks=names, metric=metric, max_length=max_length, stride=stride,
                    batch_size=batch_size, max_samples=max_samples, num_fewshot=num_fewshot).check()
    where = {"tasks": list(names)} if names else {"data": data}
    return {"model": str(model), **where, **evaluate_folder(model, spec, progress=progress)}


def _accuracy(run_dir: Path, data: str, data_option: list[str], batch_size: int) -> dict:
    from ..engine.classifier_eval import run_accuracy
    from ..merging.run import parse_set

    options = parse_set(data_option, "--data-option")
    return {"model": str(run_dir), **run_accuracy(run_dir, data, options, batch_size=max(batch_size, 1))}


def run_tune(recipe: Recipe, tune_file: Path, out: Path, *, jobs: int, backend: str,
             overwrite: bool) -> None:
    """``clmerge merge RECIPE --tune TUNE.yaml --out DIR``: the search and the best model (docs/tuning.md).
    ``recipe``: the recipe file, read once by the command (``clmerge.cli.merge``, which checks the flags first)."""
    from ..merging.tune import load_tune_spec, tune
    from ..sweep.executors import make_executor
    from ..utils.threads import check_jobs

    executor = None
    try:
        if backend not in ("local", "ray"):
            raise UsageError(f"--backend {backend!r}: expected local or ray")
        check_jobs(jobs)
        spec = load_tune_spec(tune_file)
        executor = make_executor(backend, workers=jobs if backend == "local" and jobs > 1 else 0)
        info = tune(recipe, spec, out, executor=executor, jobs=max(jobs, 1), overwrite=overwrite,
                    log=lambda s: typer.echo(s, err=True))
    except (KeyError, ValueError, FileNotFoundError, TypeError, OSError) as exc:
        fail(exc)
    finally:
        if executor is not None:
            executor.close()
    edge = f"; at the edge of its range: {', '.join(info['at_edge'])}" if info.get("at_edge") else ""
    typer.echo(f"best {info['best']} {info['metric_name']} {info['metric']:.4f} of {info['trials']} trials; wrote "
               f"{info['out']} (tune/trials.csv, tune/best_recipe.yaml){edge}")
