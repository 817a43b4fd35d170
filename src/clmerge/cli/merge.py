"""``clmerge merge``, ``merges``, ``extract-lora`` and ``export``: the typer commands over
:mod:`clmerge.merging.run`, :mod:`clmerge.merging.io.extract` and :mod:`clmerge.engine.export`.

``clmerge merge RECIPE.yaml --out DIR`` or ``clmerge merge --method NAME --base B --expert X ... --out DIR
[--set key=value]``. Inputs are model folders (single or sharded safetensors, ``.bin`` shards), weights files,
hub ids or PEFT adapter folders; the output is a complete model folder (or one ``.safetensors`` file), built
aside and moved into place only when the merge succeeded. Every user error is one line with the exit code of
its kind.
"""

from __future__ import annotations

import re
from pathlib import Path

import typer

from ..errors import UsageError
from ..plugins import PLUGIN_HELP
from .base import app, console, exit_with, fail

# torch, transformers and the merge methods are imported inside the commands: `clmerge --help` and every
# other command's start-up stay free of them (tests/test_startup.py)

__all__ = ["export_command", "extract_lora_command", "list_methods", "merge_command", "moe_command"]


@app.command("merge")
def merge_command(
    recipe: Path | None = typer.Argument(None, help="a YAML merge recipe (docs/merging_checkpoints.md)"),
    method: str | None = typer.Option(None, "--method", help="merge method (see `clmerge merges --verbose`)"),
    base: str | None = typer.Option(None, "--base", help="pretrained model: folder, weights file or hub id"),
    expert: list[str] = typer.Option([], "--expert", help="a fine-tuned model or PEFT adapter (repeatable)"),
    out: Path | None = typer.Option(None, "--out", help="a new folder (a full model), or X.safetensors"),
    set_: list[str] = typer.Option([], "--set", help="hyperparameter key=value (repeatable)"),
    out_dtype: str | None = typer.Option(None, "--out-dtype", help="float32|bfloat16|float16 (default: the base's)"),
    compute_dtype: str | None = typer.Option(None, "--compute-dtype",
                                             help="float32 (default: one rounding), float64, or bfloat16 / "
                                                  "float16 / input (mergekit's arithmetic)"),
    out_shard_size: str | None = typer.Option(None, "--out-shard-size",
                                              help="max bytes per shard, e.g. 2GB (default 5GB)"),
    tokenizer_from: str | None = typer.Option(None, "--tokenizer-from", help="copy the tokenizer from this model"),
    task: str | None = typer.Option(None, "--task", help="per-task methods (emr_merging, …): i or all"),
    threads: int | None = typer.Option(None, "--threads", help="CPU threads (default: half the cores, at most 4 "
                                       "and at most the free cores)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the plan and the memory estimate; write nothing"),
    print_recipe: bool = typer.Option(False, "--print-recipe", help="print the clmerge recipe (YAML) that RECIPE, "
                                      "a mergekit config included, becomes; merge nothing"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing --out"),
    hash_inputs: bool = typer.Option(True, "--hash-inputs/--no-hash-inputs",
                                     help="record each input file's sha256 in the model card"),
    adapter_out: str = typer.Option("full", "--adapter-out", help="adapters merged into: full|peft|factored"),
    adapter_rank: int | None = typer.Option(None, "--adapter-rank", help="rank of --adapter-out peft"),
    tune: Path | None = typer.Option(None, "--tune", help="TUNE.yaml: search the recipe's values for the "
                                     "lowest held-out perplexity (docs/tuning.md)"),
    jobs: int = typer.Option(0, "--jobs", min=0, help="--tune: trials in parallel worker processes"),
    backend: str = typer.Option("local", "--backend", help="--tune: local (in process / --jobs pool) or ray"),
    device: str = typer.Option("cpu", "--device", help="where the merge computes: cpu, cuda or cuda:N (tensors "
                               "stream there key by key and back)"),
    plugin: list[str] = typer.Option([], "--plugin", help=PLUGIN_HELP + " (e.g. a merge method registered with "
                                     "clmerge.merging.register_merge)"),
) -> None:
    """Merge checkpoints (model folders, weights files, hub ids, PEFT adapters) into a model folder."""
    from ..merging.run import build_recipe, effective_recipe, run_merge
    from ..plugins import load_plugins
    from ..utils.device import parse_device, stats_line
    from ..utils.threads import check_threads, default_threads, set_threads
    from .eval import run_tune

    load_plugins(plugin)

    try:
        set_threads(check_threads(threads) if threads is not None else default_threads())
    except ValueError as exc:
        fail(exc)
    options = {"out_dtype": out_dtype, "compute_dtype": compute_dtype, "out_shard_size": out_shard_size,
               "tokenizer_from": tokenizer_from}
    try:
        if tune is not None:  # the search takes the recipe file as it is, and writes into --out
            blocked = {"--method": method, "--expert": expert, "--set": set_, "--dry-run": dry_run, "--task": task,
                       "--adapter-out": adapter_out != "full", "--base": base, "--out-dtype": out_dtype,
                       "--compute-dtype": compute_dtype, "--tokenizer-from": tokenizer_from}
            given = [flag for flag, value in blocked.items() if value]
            if given:
                raise UsageError(f"--tune searches a recipe file's values: drop {given[0]}")
            if recipe is None or out is None:
                raise UsageError("--tune needs a recipe file (clmerge merge RECIPE --tune TUNE.yaml --out DIR)")
        dev = parse_device(device)
        if adapter_out not in ("full", "peft", "factored"):
            raise ValueError(f"--adapter-out: expected full, peft or factored, got {adapter_out!r}")
        spec = build_recipe(recipe, method, base, expert, set_, options)
    except (KeyError, ValueError, FileNotFoundError, TypeError, OSError) as exc:
        fail(exc)  # printed by clmerge.cli.base.handle_errors, exit code by kind
    if print_recipe:  # what a mergekit config (or the flag form) becomes; nothing is opened
        typer.echo(spec.to_yaml().rstrip("\n"))
        return
    if tune is not None:
        return run_tune(spec, tune, out, jobs=jobs, backend=backend, overwrite=overwrite)
    try:
        res = run_merge(spec, out, task=task, dry_run=dry_run, overwrite=overwrite, adapter_out=adapter_out,
                        adapter_rank=adapter_rank, hash_inputs=hash_inputs, device=dev,
                        where="parameters." if recipe else "--set ",
                        log=lambda s: typer.echo(s, err=True))
    except (KeyError, ValueError, FileNotFoundError, TypeError, OSError) as exc:
        fail(exc)  # printed by clmerge.cli.base.handle_errors, exit code by kind
    if res.plan is not None:
        typer.echo(res.plan)
        return
    for line in res.warnings:  # adapter merges: another base model named, ranks clamped
        typer.echo(line, err=True)
    # the hyperparameters as the merge used them (defaults filled in), as clmerge_recipe.yaml records them
    typer.echo(f"wrote {res.out} ({res.keys} tensors, {spec.method} {effective_recipe(spec).parameters})")
    if res.device is not None and adapter_out != "full":  # a full merge logged it already
        typer.echo(stats_line(res.device), err=True)
    if "overall_rel_error" in res.report:  # an adapter re-factorised by truncated SVD
        r = res.report
        typer.echo(f"rank {r.get('rank')}: relative error of the merged delta W {r['overall_rel_error']:.3g} "
                   f"overall, {r.get('max_rel_error', float('nan')):.3g} at worst (merge_report.json)")


@app.command("merges", help="List the model-merging methods.")
def list_methods(verbose: bool = typer.Option(False, "--verbose", "-v",
                                              help="hyperparameters, defaults, meaning")) -> None:
    """Print the registered merge methods (with ``--verbose``: each one's hyperparameters)."""
    from ..merging.methods.hparams import DATA_HPARAMS, method_hparams
    from ..merging.methods.registry import available, get_method

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


def _summary(res: dict) -> str:
    return (f"rank {res['rank']}, {len(res.get('per_module_rel_error', {}))} modules, relative Frobenius error "
            f"overall {res['overall_rel_error']:.3g}, max {res['max_rel_error']:.3g}")


@app.command("extract-lora")
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
    device: str = typer.Option("cpu", "--device", help="where the SVDs run: cpu, cuda or cuda:N"),
) -> None:
    """A PEFT LoRA adapter from a full fine-tune (truncated SVD of tuned - base per Linear weight)."""
    from ..merging.io.extract import extract_lora
    from ..merging.io import MergeInputError
    from ..utils.device import parse_device, stats_line

    for flag, pattern in (("--include", include), ("--exclude", exclude)):
        try:
            re.compile(pattern or "")
        except re.error as exc:
            exit_with(f"{flag} {pattern!r}: not a regular expression ({exc})")
    try:
        dev = parse_device(device)
        res = extract_lora(base=base, tuned=tuned, rank=rank, out=out, include=include, exclude=exclude,
                           embeddings=embeddings, svd=svd, overwrite=overwrite, device=dev)
    except (MergeInputError, FileNotFoundError, ValueError) as exc:
        fail(exc)
    if res.get("note"):  # modules whose min(out, in) is below --rank
        typer.echo(res["note"], err=True)
    console.print(f"wrote {out}: {_summary(res)}")
    if "device" in res:
        typer.echo(stats_line(res["device"]), err=True)


@app.command("export")
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
    plugin: list[str] = typer.Option([], "--plugin", help=PLUGIN_HELP + "; the run's recorded plugins are "
                                     "imported without it"),
) -> None:
    """Export a continual run's final model as an HF model folder or a PEFT LoRA adapter."""
    from ..engine.export import export_run
    from ..merging.io import MergeInputError
    from ..plugins import load_plugins

    load_plugins(plugin)  # the run's own recorded plugins are imported by export_run (load_run_model)

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


@app.command("moe")
def moe_command(
    recipe: Path = typer.Argument(..., help="a YAML MoE recipe: base_model, experts, shared_experts, "
                                  "architecture, gate_mode, layout (docs/moe.md)"),
    out: Path | None = typer.Option(None, "--out", help="new model folder (the MoE)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing --out"),
    hash_inputs: bool = typer.Option(True, "--hash-inputs/--no-hash-inputs",
                                     help="record each input file's sha256 in the model card"),
    dry_run: bool = typer.Option(False, "--dry-run", help="check the recipe and the inputs and print the plan; "
                                 "write nothing"),
) -> None:
    """Assemble a mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, dots1) from dense experts."""
    from ..merging.moe import load_moe_recipe
    from ..merging.run import run_moe

    try:
        res = run_moe(load_moe_recipe(recipe), out, dry_run=dry_run, overwrite=overwrite, hash_inputs=hash_inputs,
                      log=lambda s: typer.echo(s, err=True))
    except (KeyError, ValueError, FileNotFoundError, TypeError, OSError) as exc:
        fail(exc)
    if res.plan is not None:
        typer.echo(res.plan)
        return
    typer.echo(f"wrote {res.out} ({res.experts} experts, {res.layers} layers, {res.keys} tensors)")
