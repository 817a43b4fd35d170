"""``clmerge merge``: merge users' own checkpoints from the command line.

``clmerge merge RECIPE.yaml --out DIR`` or ``clmerge merge --method NAME --base B --expert X ... --out DIR
[--set key=value]``. Inputs are model folders (single or sharded safetensors, ``.bin`` shards), weights files,
hub ids or PEFT adapter folders; the output is a complete model folder (or one ``.safetensors`` file), built
aside and moved into place only when the merge succeeded. Every user error is one line and exit code 2.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import typer

from ..cli_support import fail
from ..config import read_yaml_mapping
from .registry import available, get_method

__all__ = ["build_recipe", "list_methods", "merge_command", "parse_set", "run_merge"]


def parse_set(items: list[str]) -> dict[str, Any]:
    """``["density=0.2", "trim_scope=global"]`` -> ``{"density": 0.2, "trim_scope": "global"}``.

    Values are read as Python literals (numbers, booleans ``true``/``false``, ``none``, lists), else kept as
    strings; names and types are checked against the method's signature later (:func:`pipeline.prepare`).
    """
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        lowered = {"true": "True", "false": "False", "none": "None", "null": "None"}.get(raw.strip().lower(), raw)
        try:
            out[key.strip()] = ast.literal_eval(lowered)
        except (ValueError, SyntaxError):
            out[key.strip()] = raw
    return out


def build_recipe(recipe_path: Path | None, method: str | None, base: str | None, experts: list[str],
                 sets: list[str], options: dict[str, Any]) -> Any:
    """The :class:`~clmerge.recipes.Recipe` of a recipe file or of the flag form (flags override the file)."""
    from ..recipes import load_recipe

    if recipe_path is not None:
        if method or experts:
            raise ValueError("give a recipe file or --method/--expert, not both")
        data = read_yaml_mapping(recipe_path, "merge recipe")
    else:
        if not method:
            raise ValueError("give a recipe file or --method NAME")
        if not experts:
            raise ValueError("give at least one --expert PATH")
        data = {"method": method, "models": [{"model": str(e)} for e in experts]}
    if base is not None:
        data["base"] = str(base)
    data["parameters"] = {**(data.get("parameters") or {}), **parse_set(sets)}
    data.update({k: v for k, v in options.items() if v is not None})
    try:
        return load_recipe(str(recipe_path) if recipe_path else "", data)
    except ValueError as exc:  # name the flag, not the recipe key, when it came from a flag
        msg = str(exc)
        for key, value in options.items():
            if value is not None and msg.startswith(f"{key}:"):
                msg = f"--{key.replace('_', '-')}" + msg[len(key):]
        raise ValueError(msg) from None


def run_merge(recipe: Any, out: Path | None, *, task: str | None = None, dry_run: bool = False,
              overwrite: bool = False, adapter_out: str = "full", adapter_rank: int | None = None,
              hash_inputs: bool = True,
              where: str = "parameters.", log: Any = lambda s: None) -> dict:
    """Check everything, then merge into ``out`` (a folder or one ``.safetensors`` file) or print the plan.

    Raises:
        KeyError, ValueError, FileNotFoundError, MergeInputError: bad method, arguments or inputs; nothing is
        written then.
    """
    from ..checkpoints.output import check_out
    from . import pipeline

    get_method(recipe.method)
    if adapter_out != "full":
        return _adapter_merge(recipe, out, adapter_out, adapter_rank, overwrite)
    prep = pipeline.prepare(recipe, task=task, where=where)
    if prep.models.mixed:
        log(f"note: the inputs mix floating dtypes on {len(prep.models.mixed)} keys; they are upcast to "
            f"{recipe.compute_dtype} for the merge")
    if dry_run:
        return {"plan": pipeline.dry_run_text(prep)}
    if out is None:
        raise ValueError("--out PATH is required (a new folder, or a .safetensors file)")
    kind = check_out(out, [s for s in [prep.models.base, *prep.models.experts] if s is not None],
                     overwrite=overwrite)
    if kind == "file" and len(prep.tasks) > 1:
        raise ValueError("--task all writes one folder per task: give --out a folder, not a .safetensors file")
    return pipeline.execute(prep, out, kind, io_threads=torch_threads_io(), hash_inputs=hash_inputs, log=log)


def _adapter_merge(recipe: Any, out: Path | None, form: str, rank: int | None, overwrite: bool) -> dict:
    from ..checkpoints.output import check_out

    try:
        from ..checkpoints import peft

        merge_adapters = getattr(peft, "merge_adapters", None)
        if merge_adapters is None:  # the adapter branch keeps it in its own module
            from ..checkpoints.lora_merge import merge_adapters
    except ImportError:
        raise ValueError("--adapter-out peft|factored needs clmerge.checkpoints.peft, missing from this build") \
            from None
    paths = [Path(m.model) for m in recipe.models]
    if not all(peft.is_peft_adapter(p) for p in paths):
        bad = next(p for p in paths if not peft.is_peft_adapter(p))
        raise ValueError(f"--adapter-out {form}: every expert must be a PEFT adapter folder; {bad} is not")
    if recipe.base is None or out is None:
        raise ValueError(f"--adapter-out {form} needs --base (the adapters' base model) and --out")
    from ..checkpoints.readers import open_checkpoint

    base = open_checkpoint(recipe.base, name=recipe.base)
    check_out(out, [base], overwrite=overwrite)
    info = merge_adapters(method=recipe.method, base=base, adapters=paths, hyperparameters=recipe.parameters,
                          out=out, form=form, rank=rank, overwrite=overwrite)
    keys = info.get("keys", "?")
    return {**info, "method": recipe.method, "keys": len(keys) if isinstance(keys, list) else keys, "out": str(out)}


def merge_command(
    recipe: Path | None = typer.Argument(None, help="a YAML merge recipe (docs/merging_checkpoints.md)"),
    method: str | None = typer.Option(None, "--method", help="merge method (see `clmerge merges --verbose`)"),
    base: str | None = typer.Option(None, "--base", help="pretrained model: folder, weights file or hub id"),
    expert: list[str] = typer.Option([], "--expert", help="a fine-tuned model or PEFT adapter (repeatable)"),
    out: Path | None = typer.Option(None, "--out", help="a new folder (a full model), or X.safetensors"),
    set_: list[str] = typer.Option([], "--set", help="hyperparameter key=value (repeatable)"),
    out_dtype: str | None = typer.Option(None, "--out-dtype", help="float32|bfloat16|float16 (default: the base's)"),
    compute_dtype: str | None = typer.Option(None, "--compute-dtype", help="float32 (default) or float64"),
    out_shard_size: str | None = typer.Option(None, "--out-shard-size",
                                              help="max bytes per shard, e.g. 2GB (default 5GB)"),
    tokenizer_from: str | None = typer.Option(None, "--tokenizer-from", help="copy the tokenizer from this model"),
    task: str | None = typer.Option(None, "--task", help="per-task methods (emr_merging, …): i or all"),
    threads: int | None = typer.Option(None, "--threads", help="CPU threads (default: half the cores, at most 4)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the plan and the memory estimate; write nothing"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing --out"),
    hash_inputs: bool = typer.Option(True, "--hash-inputs/--no-hash-inputs",
                                     help="record each input file's sha256 in the model card"),
    adapter_out: str = typer.Option("full", "--adapter-out", help="adapters merged into: full|peft|factored"),
    adapter_rank: int | None = typer.Option(None, "--adapter-rank", help="rank of --adapter-out peft"),
) -> None:
    """Merge checkpoints (model folders, weights files, hub ids, PEFT adapters) into a model folder."""
    from ..utils.threads import check_threads

    try:
        set_threads(check_threads(threads) if threads is not None else default_threads())
    except ValueError as exc:
        fail(exc)
    options = {"out_dtype": out_dtype, "compute_dtype": compute_dtype, "out_shard_size": out_shard_size,
               "tokenizer_from": tokenizer_from}
    try:
        if adapter_out not in ("full", "peft", "factored"):
            raise ValueError(f"--adapter-out: expected full, peft or factored, got {adapter_out!r}")
        spec = build_recipe(recipe, method, base, expert, set_, options)
        info = run_merge(spec, out, task=task, dry_run=dry_run, overwrite=overwrite, adapter_out=adapter_out,
                         adapter_rank=adapter_rank, hash_inputs=hash_inputs,
                         where="parameters." if recipe else "--set ",
                         log=lambda s: typer.echo(s, err=True))
    except (KeyError, ValueError, FileNotFoundError, TypeError, OSError) as exc:
        fail(exc)  # printed by clmerge.cli_support.handle_errors, exit code by kind
    if "plan" in info:
        typer.echo(info["plan"])
        return
    typer.echo(f"wrote {info['out']} ({info['keys']} tensors, {spec.method} {spec.parameters})")
    if "overall_rel_error" in info:  # an adapter re-factorised by truncated SVD
        typer.echo(f"rank {info.get('rank')}: relative error of the merged delta W {info['overall_rel_error']:.3g} "
                   f"overall, {info.get('max_rel_error', float('nan')):.3g} at worst (merge_report.json)")


_IO_THREADS = [False]


def set_threads(n: int) -> None:
    """``--threads n``: 1: everything in one thread. ``n >= 2``: one thread reads ahead and one writes
    behind while ``n - 1`` compute (torch's intra-op threads)."""
    import torch

    torch.set_num_threads(max(1, n - 1))
    _IO_THREADS[0] = n >= 2


def torch_threads_io() -> bool:
    return _IO_THREADS[0]


def default_threads() -> int:
    """Half the cores, 1 to 4: merging is memory-bound, and a shared machine keeps cores for others."""
    import os

    return max(1, min(4, (os.cpu_count() or 2) // 2))


def list_methods(verbose: bool = typer.Option(False, "--verbose", "-v",
                                              help="hyperparameters, defaults, meaning")) -> None:
    """Print the registered merge methods (with ``--verbose``: each one's hyperparameters)."""
    from .hparams import DATA_HPARAMS, method_hparams

    every = {name: method_hparams(get_method(name)) for name in available()} if verbose else {}
    for name, desc in available().items():
        typer.echo(f"{name:<26} {desc}")
        if not verbose:
            continue
        hps = every[name]
        if any(n in DATA_HPARAMS for n in hps):
            typer.echo(f"    (needs data: Python API clmerge.merging.{get_method(name).fn.__name__})")
        for h in hps.values():
            default = "required" if h.required else f"default {h.default!r}"
            # a docstring that says "other arguments as in cart" documents them there
            other = next((m for m, o in every.items() if h.name in o and o[h.name].help), None)
            text = h.help or (f"as in {other}: {every[other][h.name].help}" if other else "-")
            typer.echo(f"    {h.name} ({h.annotation or '?'}, {default}): {text}")

