"""``clmerge eval MODEL --data FILE``: perplexity of a causal LM on a local text or JSONL file
(:mod:`clmerge.merging.lm_eval`), and the ``--tune`` part of ``clmerge merge`` (:mod:`clmerge.merging.tune`).

Results are printed as JSON and, with ``--json PATH``, written there (atomically). A progress bar on a
terminal; piped, one plain line every 50 batches and at the end (:mod:`clmerge.utils.progress`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from ..errors import UsageError
from ..utils.io import write_json
from ..utils.outpaths import check_writable
from .base import app, fail

__all__ = ["eval_command", "run_tune"]


@app.command("eval")
def eval_command(
    model: Path = typer.Argument(..., help="an HF causal-LM folder (config.json, weights, tokenizer)"),
    data: Path = typer.Option(..., "--data", help="a text file (blank lines separate documents) or a JSONL "
                              "of {\"text\": ...}"),
    max_length: int = typer.Option(1024, "--max-length", help="tokens per window"),
    stride: int | None = typer.Option(None, "--stride", help="sliding-window stride (default: --max-length, "
                                      "disjoint windows)"),
    batch_size: int = typer.Option(4, "--batch-size", help="windows per forward pass"),
    max_samples: int | None = typer.Option(None, "--max-samples", help="score only the first N documents"),
    json_out: Path | None = typer.Option(None, "--json", help="also write the result here (JSON)"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="a progress bar or progress lines"),
) -> None:
    """Perplexity of a causal language model on held-out text (token-weighted mean NLL, sliding window)."""
    from ..merging.lm_eval import EvalOptions, load_causal_lm, perplexity, read_texts

    try:
        opts = EvalOptions(str(data), max_length, stride, batch_size, max_samples).check()
        if json_out is not None:
            check_writable(json_out, "--json")
        texts = read_texts(data, max_samples)
        lm, tok = load_causal_lm(model)
        res = {"model": str(model), "data": str(data), **perplexity(lm, tok, texts, opts, progress=progress),
               "max_length": max_length, "stride": stride or max_length}
        if json_out is not None:
            write_json(json_out, res)
    except (ValueError, OSError, KeyError, TypeError) as exc:
        fail(exc)
    typer.echo(json.dumps(res, indent=2))


def run_tune(recipe: Path | None, tune_file: Path, out: Path | None, *, jobs: int, backend: str,
             overwrite: bool, blocked: dict[str, Any]) -> None:
    """``clmerge merge RECIPE --tune TUNE.yaml --out DIR``: the search and the best model (docs/tuning.md)."""
    from ..config import read_yaml_mapping
    from ..merging.tune import load_tune_spec, tune
    from ..sweep.executors import make_executor
    from ..utils.threads import check_jobs

    executor = None
    try:
        given = [flag for flag, value in blocked.items() if value]
        if given:
            raise UsageError(f"--tune searches a recipe file's values: drop {given[0]}")
        if recipe is None or out is None:
            raise UsageError("--tune needs a recipe file (clmerge merge RECIPE --tune TUNE.yaml --out DIR)")
        if backend not in ("local", "ray"):
            raise UsageError(f"--backend {backend!r}: expected local or ray")
        check_jobs(jobs)
        spec = load_tune_spec(tune_file)
        data = read_yaml_mapping(recipe, "merge recipe")
        executor = make_executor(backend, workers=jobs if backend == "local" and jobs > 1 else 0)
        info = tune(data, spec, out, executor=executor, jobs=max(jobs, 1), overwrite=overwrite,
                    log=lambda s: typer.echo(s, err=True))
    except (KeyError, ValueError, FileNotFoundError, TypeError, OSError) as exc:
        fail(exc)
    finally:
        if executor is not None:
            executor.close()
    typer.echo(f"best {info['best']} perplexity {info['metric']:.4f} of {info['trials']} trials; wrote "
               f"{info['out']} (tune/trials.csv, tune/best_recipe.yaml)")
