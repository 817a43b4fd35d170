"""``clmerge eval MODEL --data FILE``: perplexity of a causal LM on a local text or JSONL file
(:mod:`clmerge.merging.lm_eval`), and the ``--tune`` part of ``clmerge merge`` (:mod:`clmerge.merging.tune`).

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
    data: str = typer.Option(..., "--data", help="causal LM: a text file (blank lines separate documents) or a "
                             "JSONL of {\"text\": ...}; run directory: a dataset name (clmerge datasets)"),
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
    """Perplexity of a causal LM on held-out text, or accuracy of a continual run's model on a dataset."""
    load_plugins(plugin)  # a run directory's own recorded plugins: engine.export.load_run_model
    try:
        if json_out is not None:
            check_writable(json_out, "--json")
        if (model / "config.yaml").is_file():
            res = _accuracy(model, data, data_option, batch_size)
        else:
            res = _perplexity(model, data, max_length, stride, batch_size, max_samples, progress)
        if json_out is not None:
            from ..utils.io import write_json  # torch: imported only when needed

            write_json(json_out, res)
    except (ValueError, OSError, KeyError, TypeError) as exc:
        fail(exc)
    typer.echo(json.dumps(res, indent=2))


def _perplexity(model: Path, data: str, max_length: int, stride: int | None, batch_size: int,
                max_samples: int | None, progress: bool) -> dict:
    from ..merging.lm_eval import EvalOptions, load_causal_lm, perplexity, read_texts

    opts = EvalOptions(data, max_length, stride, batch_size, max_samples).check()
    texts = read_texts(data, max_samples)
    lm, tok = load_causal_lm(model)
    return {"model": str(model), "data": data, **perplexity(lm, tok, texts, opts, progress=progress),
            "max_length": max_length, "stride": stride or max_length}


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
    typer.echo(f"best {info['best']} perplexity {info['metric']:.4f} of {info['trials']} trials; wrote "
               f"{info['out']} (tune/trials.csv, tune/best_recipe.yaml)")
