"""``clmerge verify DIR [--against BASE]``: the checks every merge runs before it moves its output into place
(:mod:`clmerge.merging.io.verify`), on any model or PEFT adapter folder. Nothing heavy is imported until the
command runs (``clmerge --help`` stays quick)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from .base import app, fail

__all__ = ["verify_command"]


@app.command("verify")
def verify_command(
    folder: Path = typer.Argument(..., help="a model folder (config.json, weights, tokenizer) or a PEFT adapter "
                                  "folder"),
    against: str | None = typer.Option(None, "--against", help="the base model folder: its special tokens and "
                                       "chat template must be preserved, its dtypes per key are accepted (for an "
                                       "adapter: the base whose weights the modules must fit)"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """Verify a merged model or adapter folder: every tensor its config implies, with that shape, dtype and
    finite values; tied embeddings; tokenizer against the embedding rows; special tokens and chat template;
    a clean reload in transformers (docs/verify.md). Exit code 3 when a check fails."""
    from ..merging.io.verify import VerificationError, verify_folder

    try:
        v = verify_folder(folder, against=against)
    except (ValueError, FileNotFoundError, OSError) as exc:
        fail(exc)
    if as_json:
        typer.echo(json.dumps({"folder": str(folder), **v.to_dict()}, indent=2))
    else:
        width = max(map(len, v.checks), default=0)
        for name, state in v.checks.items():
            typer.echo(f"{name:<{width}}  {state}")
        for note in v.notes:
            typer.echo(f"note: {note}")
        for problem in v.problems:
            typer.echo(f"problem: {problem}", err=True)
        typer.echo(f"{folder}: {v.summary()}")
    if not v.ok:
        raise VerificationError(v)
