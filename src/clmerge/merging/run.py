"""A merge run as ``clmerge merge`` asks for it: a recipe (from a file or from flags) checked, then merged.

:func:`build_recipe` turns a recipe file or the flag form into a :class:`~clmerge.merging.recipes.Recipe`;
:func:`run_merge` checks everything (method, hyperparameters, inputs, output path), then streams the merge into
a model folder (:mod:`.pipeline`), or into one PEFT adapter when the experts are adapters and the output form
asks for one (:mod:`.lora_merge`). Errors are raised as exceptions with one-line messages; the command
(:mod:`clmerge.cli.merge`) prints them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import read_yaml_mapping
from ..errors import UsageError
from ..utils.yaml_io import YamlLimitError, parse_assignment
from ..utils.device import Device, parse_device
from ..utils.threads import io_threads
from . import pipeline
from .io.output import check_out
from .io.peft import is_peft_adapter
from .io.readers import open_checkpoint
from .lora_merge import merge_adapters
from .recipes import PASSTHROUGH, load_recipe
from .methods.registry import get_method
from .slices import run_slices
from .stages import check_stage_refs, intermediate_folder, model_refs, with_stage_paths

__all__ = ["build_recipe", "parse_set", "run_merge"]


def parse_set(items: list[str], flag: str = "--set") -> dict[str, Any]:
    """``["density=0.2", "trim_scope=global"]`` -> ``{"density": 0.2, "trim_scope": "global"}``.

    Each value is read by the one ``key=value`` grammar of every command
    (:func:`clmerge.utils.yaml_io.parse_assignment`: YAML, so ``yes`` is true and ``[0.6, 1.0]`` a list, as in
    ``clmerge run --set``); names and types are checked against the method's signature later.

    Raises:
        UsageError: an item without ``=`` (exit code 2).
    """
    out: dict[str, Any] = {}
    for item in items:
        try:
            key, value = parse_assignment(item, flag)
        except YamlLimitError:
            raise
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        out[key] = value
    return out


def build_recipe(recipe_path: Path | None, method: str | None, base: str | None, experts: list[str],
                 sets: list[str], options: dict[str, Any]) -> Any:
    """The :class:`~clmerge.merging.recipes.Recipe` of a recipe file or of the flag form (flags override the
    file)."""
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
              hash_inputs: bool = True, device: str | Device | None = None,
              where: str = "parameters.", log: Any = lambda s: None) -> dict:
    """Check everything, then merge into ``out`` (a folder or one ``.safetensors`` file) or print the plan.

    Args:
        device: ``cpu`` (default), ``cuda`` or ``cuda:N`` (or a :class:`~clmerge.utils.device.Device`): where
            the kernels compute; the inputs stream there key by key and the results come back for writing.

    Raises:
        KeyError, ValueError, FileNotFoundError, MergeInputError: bad method, arguments or inputs; nothing is
        written then.
    """
    device = parse_device(device)
    if recipe.stages:
        return _run_stages(recipe, out, dry_run=dry_run, overwrite=overwrite, hash_inputs=hash_inputs, log=log,
                           task=task, adapter_out=adapter_out, adapter_rank=adapter_rank, where=where,
                           device=device)
    if recipe.slices:
        if adapter_out != "full" or task is not None:
            raise ValueError("a slice recipe writes a full model folder: drop --adapter-out / --task")
        return run_slices(recipe, out, dry_run=dry_run, overwrite=overwrite, hash_inputs=hash_inputs, log=log)
    get_method(recipe.method)
    if adapter_out != "full":
        return _adapter_merge(recipe, out, adapter_out, adapter_rank, overwrite, device)
    prep = pipeline.prepare(recipe, task=task, where=where)
    for src in prep.models.experts:  # an adapter whose config names another base model
        if getattr(src, "warning", None):
            log(src.warning)
    for warning in (prep.vocab.warnings if prep.vocab is not None else []):  # tokenizers of different models
        log(warning)
    if prep.models.mixed:
        log(f"note: the inputs mix floating dtypes on {len(prep.models.mixed)} keys; they are upcast to "
            f"{recipe.compute_dtype} for the merge")
    if dry_run:
        return {"plan": pipeline.dry_run_text(prep)}
    if out is None:
        raise ValueError("--out PATH is required (a new folder, or a .safetensors file)")
    kind = check_out(out, [s for s in [prep.models.base, *prep.models.experts] if s is not None],
                     overwrite=overwrite)
    if kind == "file" and prep.tokenizer is not None:
        raise ValueError(f"--out {out}: embeddings / chat_template_from build a tokenizer for the merged rows, "
                         "which a single .safetensors file cannot hold: give --out a folder")
    if kind == "file" and len(prep.tasks) > 1:
        raise ValueError("--task all writes one folder per task: give --out a folder, not a .safetensors file")
    return pipeline.execute(prep, out, kind, io_threads=io_threads(), hash_inputs=hash_inputs, log=log,
                            device=device)


def _run_stages(recipe: Any, out: Path | None, *, dry_run: bool, overwrite: bool, hash_inputs: bool, log: Any,
                **final: Any) -> dict:
    """Run the named stages in order into a temporary folder beside ``out``, then the final merge into ``out``;
    the intermediates are removed whatever happens (:mod:`.stages`). Every reference and method is checked
    before the first stage runs."""
    check_stage_refs(recipe)
    for stage in [*recipe.stages, recipe]:
        if stage.method != PASSTHROUGH:
            get_method(stage.method)
    if dry_run:
        lines = [f"stage {s.name}: {s.method} of {', '.join(r for _, r in model_refs(s))}" for s in recipe.stages]
        return {"plan": "\n".join([*lines, f"final: {recipe.method} of {', '.join(r for _, r in model_refs(recipe))}"])}
    if out is None:
        raise ValueError("--out PATH is required (a new folder, or a .safetensors file)")
    check_out(out, [], overwrite=overwrite)  # a bad --out fails before the first stage
    done: dict[str, Path] = {}
    with intermediate_folder(out) as tmp:
        for i, stage in enumerate(recipe.stages):
            run_merge(with_stage_paths(stage, done), tmp / f"stage_{i}", hash_inputs=False, log=log,
                      device=final.get("device"))
            done[stage.name] = tmp / f"stage_{i}"
            log(f"stage {stage.name}: merged")
        final_recipe = with_stage_paths(recipe, done).recorded_as(recipe.to_yaml())
        info = run_merge(final_recipe, out, overwrite=overwrite, hash_inputs=hash_inputs,
                         log=log, **final)
    return {**info, "stages": [s.name for s in recipe.stages]}


def _adapter_merge(recipe: Any, out: Path | None, form: str, rank: int | None, overwrite: bool,
                   device: Device) -> dict:
    """LoRA adapters merged into one adapter (``form`` peft or factored, :mod:`.lora_merge`)."""
    paths = [Path(m.model) for m in recipe.models]
    if not all(is_peft_adapter(p) for p in paths):
        bad = next(p for p in paths if not is_peft_adapter(p))
        raise ValueError(f"--adapter-out {form}: every expert must be a PEFT adapter folder; {bad} is not")
    if recipe.base is None or out is None:
        raise ValueError(f"--adapter-out {form} needs --base (the adapters' base model) and --out")
    base = open_checkpoint(recipe.base, name=recipe.base)
    check_out(out, [base], overwrite=overwrite)
    info = merge_adapters(method=recipe.method, base=base, adapters=paths, hyperparameters=recipe.parameters,
                          out=out, form=form, rank=rank, overwrite=overwrite, device=device)
    keys = info.get("keys", "?")
    return {**info, "method": recipe.method, "keys": len(keys) if isinstance(keys, list) else keys, "out": str(out)}
