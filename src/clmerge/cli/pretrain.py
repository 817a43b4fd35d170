"""``clmerge pretrain``: reproduce a shipped backbone's weights (:mod:`clmerge.pretrain`)."""

from __future__ import annotations

from pathlib import Path

import typer

from .base import app, console, err, exit_with


@app.command()
def pretrain(
    preset: str = typer.Option("vit-tiny-fmnist", "--preset", help="what to pretrain"),
    out: Path | None = typer.Option(None, "--out", help="output directory (default: ./pretrained/<preset>; the "
                                    "shipped weights are in clmerge/assets/<preset>)"),
    epochs: int | None = typer.Option(None, "--epochs", min=1, help="override the preset's epochs"),
    data_root: str | None = typer.Option(None, "--data-root", help="where the Fashion-MNIST IDX files are"),
    threads: int = typer.Option(1, "--threads", help="torch threads (the shipped weights used 1; bit-exact "
                                "reproduction needs the same count)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace the files of an existing non-empty --out"),
) -> None:
    """Reproducibly pretrain a shipped backbone (weights + provenance.json)."""
    from ..pretrain import PRESETS
    from ..utils.outpaths import check_output_dir
    from ..utils.threads import check_threads

    try:
        check_threads(threads)
    except ValueError as exc:
        exit_with(str(exc))
    if preset not in PRESETS:
        exit_with(f"--preset {preset!r}: unknown; known: {', '.join(PRESETS)}")
    # never into the installed package by default: that would silently replace the shipped weights
    target = out or Path("pretrained") / preset.replace("-", "_")
    check_output_dir(target, overwrite=overwrite)
    if out is None:
        err.print(f"writing to {target.absolute()} (give --out to choose; the shipped weights are in clmerge/assets)",
                  highlight=False, soft_wrap=True)
    kwargs = {"data_root": data_root, "threads": threads} | ({"epochs": epochs} if epochs is not None else {})
    prov = PRESETS[preset](target, **kwargs)
    console.print(f"wrote {target}: test accuracy {prov['test_accuracy']:.2f}%, sha256 {prov['sha256'][:16]}…")
