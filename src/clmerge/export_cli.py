"""``clmerge extract-lora`` and ``clmerge export``: PEFT adapters from fine-tunes and from continual runs."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from .cli_support import exit_with as _fail
from .cli_support import fail, make_console

__all__ = ["extract_lora_command", "export_command"]

console = make_console()


def _summary(res: dict) -> str:
    return (f"rank {res['rank']}, {len(res.get('per_module_rel_error', {}))} modules, relative Frobenius error "
            f"overall {res['overall_rel_error']:.3g}, max {res['max_rel_error']:.3g}")


def extract_lora_command(
    base: str = typer.Option(..., "--base", help="pretrained model: folder, sharded folder or weights file"),
    tuned: str = typer.Option(..., "--tuned", help="the full fine-tune of --base (same keys)"),
    rank: int = typer.Option(..., "--rank", help="LoRA rank r (lora_alpha = r, so the scale is 1)"),
    out: Path = typer.Option(..., "--out", help="new PEFT adapter folder"),
    include: str | None = typer.Option(None, "--include", help="regex: only keys that match"),
    exclude: str | None = typer.Option(None, "--exclude", help="regex: skip keys that match"),
    embeddings: bool = typer.Option(False, "--include-embeddings", help="also extract embedding tables "
                                    "(written as peft's lora_embedding_A/B)"),
    svd: str = typer.Option("auto", "--svd", help="auto (randomized for large matrices), full (exact optimum) "
                            "or randomized"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing non-empty --out"),
) -> None:
    """A PEFT LoRA adapter from a full fine-tune (truncated SVD of tuned - base per Linear weight)."""
    from .merging.io.extract import extract_lora
    from .merging.io import MergeInputError

    for flag, pattern in (("--include", include), ("--exclude", exclude)):
        try:
            re.compile(pattern or "")
        except re.error as exc:
            _fail(f"{flag} {pattern!r}: not a regular expression ({exc})")
    try:
        res = extract_lora(base=base, tuned=tuned, rank=rank, out=out, include=include, exclude=exclude,
                           embeddings=embeddings, svd=svd, overwrite=overwrite)
    except (MergeInputError, FileNotFoundError, ValueError) as exc:
        fail(exc)
    if res.get("note"):  # modules whose min(out, in) is below --rank
        typer.echo(res["note"], err=True)
    console.print(f"wrote {out}: {_summary(res)}")


def export_command(
    run_dir: Path = typer.Argument(..., help="a continual run directory (clmerge run --out)"),
    format: str = typer.Option(..., "--format", help="hf (folded HF model + head) or peft (LoRA adapter)"),
    out: Path = typer.Option(..., "--out", help="new output folder"),
    rank: int | None = typer.Option(None, "--rank", help="peft: adapter rank (default: the largest numerical "
                                    "rank of the updates: exact)"),
    base_out: Path | None = typer.Option(None, "--base-out", help="peft: also write the pretrained backbone "
                                         "here as an HF folder (the base the adapter applies to)"),
    svd: str = typer.Option("auto", "--svd", help="peft: auto, full or randomized truncated SVD"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing non-empty --out / --base-out"),
) -> None:
    """Export a continual run's final model as an HF model folder or a PEFT LoRA adapter."""
    from .engine.export import export_run
    from .merging.io import MergeInputError

    try:
        res = export_run(run_dir, format=format, out=out, rank=rank, base_out=base_out, svd=svd,
                         overwrite=overwrite)
    except (MergeInputError, FileNotFoundError, ValueError) as exc:
        fail(exc)
    if format == "peft":
        console.print(f"wrote {out}: {_summary(res)}")
    else:
        console.print(f"wrote {out}: HF model folder, head.safetensors, classes.json ({res['method']}, "
                      f"{len(res['adapted_modules'])} LoRA-adapted modules folded)")
