"""``clmerge merge``: merge users' own checkpoints from the command line.

``clmerge merge --method NAME --base PATH --expert PATH ... --out PATH [--set key=value]``. Inputs are
safetensors (read lazily) or ``.bin``/``.pt`` (``torch.load(weights_only=True)``). Experts that disagree (key,
shape, dtype) or hold NaN/Inf are an error naming the key and the files; the output is written atomically and
only after the merge succeeded.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import typer

from ..utils.io import save_tensors
from .registry import available, get_method
from .sources import MergeInputError

__all__ = ["merge_command", "parse_set", "run_merge"]


def parse_set(items: list[str], valid: dict[str, Any]) -> dict[str, Any]:
    """``["density=0.2", "trim_scope=global"]`` -> ``{"density": 0.2, "trim_scope": "global"}``.

    Values are read as Python literals (numbers, booleans ``true``/``false``, lists), else kept as strings.
    Unknown keys are an error listing the valid ones.
    """
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if key not in valid:
            raise ValueError(f"--set {key}: not a hyperparameter of this method; valid: {', '.join(valid)}")
        lowered = {"true": "True", "false": "False", "none": "None", "null": "None"}.get(raw.strip().lower(), raw)
        try:
            out[key] = ast.literal_eval(lowered)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


def run_merge(method: str, base: Path | None, experts: list[Path], out: Path, sets: list[str]) -> dict:
    """Merge and write ``out`` (safetensors, atomically); returns a small summary dict.

    Raises:
        KeyError, ValueError, FileNotFoundError, MergeInputError: bad method, arguments or inputs; nothing is
        written then.
    """
    m = get_method(method)
    valid = {k: v for k, v in m.hyperparameters().items() if k not in ("fishers", "grams")}
    if {"fishers", "grams"} & set(m.hyperparameters()):
        raise ValueError(f"{method} needs data-dependent inputs (Fisher / Gram matrices); use the Python API")
    hp = parse_set(sets, valid)
    missing = [k for k, v in valid.items() if v is inspect.Parameter.empty and k not in hp]
    if missing:
        raise ValueError(f"{method}: missing required --set {', '.join(missing)}")
    if not experts:
        raise ValueError("give at least one --expert PATH")
    if m.needs_base and base is None:
        raise ValueError(f"{method} needs --base PATH (the pretrained weights)")
    merged = m.fn(base=base, experts=[Path(e) for e in experts], **hp)
    for k, v in merged.items():
        if v.is_floating_point() and not bool(v.isfinite().all()):
            raise MergeInputError(f"merge produced NaN/Inf in key {k!r}; nothing written")
    save_tensors(out, merged, metadata={"clmerge_method": method, **{k: str(v) for k, v in hp.items()}})
    return {"method": method, "keys": len(merged), "out": str(out), "hyperparameters": hp}


def merge_command(
    method: str = typer.Option(..., "--method", help="merge method (see `clmerge merges`)"),
    base: Path | None = typer.Option(None, "--base", help="pretrained weights (safetensors, .bin or .pt)"),
    expert: list[Path] = typer.Option([], "--expert", help="a fine-tuned checkpoint (repeat for each expert)"),
    out: Path | None = typer.Option(None, "--out", help="where to write the merged safetensors"),
    set_: list[str] = typer.Option([], "--set", help="hyperparameter key=value (repeatable)"),
) -> None:
    """Merge checkpoints with a registered method and write the result as safetensors."""
    if out is None:
        typer.echo("error: --out PATH is required", err=True)
        raise typer.Exit(2)
    try:
        info = run_merge(method, base, expert, out, set_)
    except (KeyError, ValueError, FileNotFoundError, TypeError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        typer.echo(f"error: {msg}", err=True)
        raise typer.Exit(2)
    typer.echo(f"wrote {info['out']} ({info['keys']} tensors, {method} {info['hyperparameters']})")


def list_methods() -> None:
    """Print the registered merge methods."""
    for name, desc in available().items():
        typer.echo(f"{name:<26} {desc}")

