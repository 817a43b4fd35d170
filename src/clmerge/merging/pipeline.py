"""A merge from checkpoints on disk to a model folder, streamed key by key (what ``clmerge merge`` runs).

:func:`prepare` opens the inputs lazily, checks the recipe's hyperparameters against the method's signature
and partitions the keys into groups of equal hyperparameters; nothing is read beyond the headers and nothing
is written. :func:`execute` then runs the method on each group with the inputs' :class:`ModelSet` streaming
into a :class:`~clmerge.merging.io.writer.ShardedWriter`, so the memory in use is the tensors of the key
being merged (plus a method's per-key temporaries), whatever the model's size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..utils.device import Device, using_device
from ..utils.dtypes import config_dtype, to_dtype
from .methods.hparams import DATA_HPARAMS, HParam, check_hyperparameters, method_hparams, per_model_params
from .io.output import FolderJob, OutputFolder
from .io.readers import open_checkpoint, resolve_hub_id
from .io.writer import BackgroundWriter, ShardedWriter, parse_size
from .recipes import Recipe, key_groups
from .methods.registry import MergeMethod
from .methods.sources import ModelSet
from .methods.trim import input_dtype_arithmetic
from .preflight import preflight
from .vocab import VocabPlan, prepare_vocab

__all__ = ["Prepared", "execute", "prepare"]


@dataclass
class Prepared:
    """Everything a merge needs, checked: the method, the opened inputs and the key groups."""

    recipe: Recipe
    method: MergeMethod
    models: ModelSet
    groups: list[tuple[dict[str, Any], list[str]]]
    tasks: list[int | None]
    out_dtype: torch.dtype | None
    shard_size: int
    plan: list[tuple[str, tuple[int, ...], torch.dtype]] = field(default_factory=list)
    vocab: VocabPlan | None = None
    tokenizer: Any = None  # an OutputTokenizer to write instead of copying the tokenizer files
    model_folder: Path | None = None  # whose config is copied (the base's, else the first expert's)
    tokenizer_folder: Path | None = None  # whose tokenizer files are copied (None: ``tokenizer`` is written)
    config_dtype: torch.dtype | None = None  # what the output's config.json records
    tied: tuple[str, str] | None = None  # (input, output) embedding keys kept tied (VocabPlan.tied_pair)
    tokenizer_reference: Path | None = None  # whose special tokens the output keeps (verified before the move)
    template_folder: Path | None = None  # whose chat template the output gets (chat_template_from)


def _tasks(method: MergeMethod, hps: dict[str, HParam], task: str | int | None, n: int) -> list[int | None]:
    if "task" not in hps:
        if task is not None:
            raise ValueError(f"--task: {method.name} gives one merged model, not one per task")
        return [None]
    if task is None:
        raise ValueError(f"{method.name} gives one model per task: pass --task i (0..{n - 1}) or --task all")
    if str(task) == "all":
        return list(range(n))
    try:
        t = int(task)
    except ValueError:
        raise ValueError(f"--task: expected an integer or 'all', got {task!r}") from None
    if not 0 <= t < n:
        raise ValueError(f"--task: {t} is out of range for {n} experts (0..{n - 1})")
    return [t]


def prepare(recipe: Recipe, method: MergeMethod, *, task: str | int | None = None,
            where: str = "parameters.") -> Prepared:
    """Check ``recipe`` against its ``method`` (resolved by :func:`clmerge.merging.run.plan`) and open its inputs
    (headers only); raises one-line errors.

    Args:
        where: how errors name the global parameters (``"--set "`` for the flag form).
    """
    hps = method_hparams(method)
    if any(n in DATA_HPARAMS for n in hps):
        stats = ", ".join(n for n in hps if n in DATA_HPARAMS)
        raise ValueError(f"{method.name} needs data-dependent statistics ({stats}); "
                         f"use the Python API: clmerge.merging.{method.fn.__name__}(...) (docs/merging_checkpoints.md)")
    if method.needs_base and recipe.base is None:
        raise ValueError(f"{method.name} needs --base PATH (the pretrained weights)")
    task = recipe.parameters.get("task", task) if task is None else task
    params = {k: v for k, v in recipe.parameters.items() if k != "task"}
    check_hyperparameters(method, params, where, hps=hps)
    for i, o in enumerate(recipe.overrides):
        check_hyperparameters(method, o.parameters, f"overrides[{i}].parameters.", hps=hps)
    per_model = per_model_params(method, hps, recipe.models)
    base = None if recipe.base is None else open_checkpoint(recipe.base, name=recipe.base)
    experts = [open_checkpoint(m.model, base=base, name=m.model) for m in recipe.models]
    labels = ([f"the base ({recipe.base})"] if base is not None else []) + \
        [f"models[{i}] ({m.model})" for i, m in enumerate(recipe.models)]
    preflight([base, *experts], labels, embeddings=recipe.embeddings)  # headers and configs only
    if recipe.embeddings is None and "fill" in recipe.model_fields_set:
        raise ValueError(f"fill: {recipe.fill!r} applies only with embeddings: base, union or intersection "
                         "(rows are merged by index without it)")
    names = ([recipe.base] if base is not None else []) + [m.model for m in recipe.models]
    # the folders whose config (the base's, else the first expert's) and tokenizer files the output gets; a
    # tokenizer built for the merged vocabulary or chat template (prepare_vocab) is written instead
    model_folder = getattr(base if base is not None else experts[0], "folder", None)
    if recipe.embeddings is not None or recipe.chat_template_from is not None:
        tokenizer_folder = None
    elif recipe.tokenizer_from is None:
        tokenizer_folder = model_folder
    else:
        p = Path(recipe.tokenizer_from)
        tokenizer_folder = p if p.is_dir() else None if p.exists() else resolve_hub_id(recipe.tokenizer_from)
    opened = dict(zip(names, ([base] if base is not None else []) + experts))
    tokenizer_reference = _folder_of(recipe.tokenizer_from, opened) if recipe.tokenizer_from else model_folder
    template_folder = _folder_of(recipe.chat_template_from, opened) if recipe.chat_template_from else None
    vocab, tokenizer, base, experts = prepare_vocab(base, experts, names, embeddings=recipe.embeddings,
                                                    fill=recipe.fill, tokenizer_from=recipe.tokenizer_from,
                                                    chat_template_from=recipe.chat_template_from)
    tied = vocab.tied_pair() if vocab is not None else None
    models = ModelSet.of_sources(base, experts, compute_dtype=recipe.compute_dtype)
    tasks = _tasks(method, hps, task, models.num_experts)
    list_params = {n for n, h in hps.items() if h.is_list}
    groups = key_groups(models.keys(), {**params, **per_model}, recipe.overrides, list_params)
    missing = [n for n, h in hps.items() if h.required and n not in groups[0][0] and n != "task"]
    if missing:
        raise ValueError(f"{method.name}: missing required hyperparameter {', '.join(missing)} "
                         f"(--set {missing[0]}=...)")
    out_dtype = to_dtype(recipe.out_dtype)
    prep = Prepared(recipe, method, models, groups, tasks, out_dtype, parse_size(recipe.out_shard_size),
                    vocab=vocab, tokenizer=tokenizer, model_folder=model_folder, tokenizer_folder=tokenizer_folder,
                    tied=tied, tokenizer_reference=tokenizer_reference, template_folder=template_folder)
    ref = models.base if models.base is not None else models.experts[0]
    for key in models.keys():
        shape, dtype = ref.meta(key)
        prep.plan.append((key, tuple(shape), out_dtype if out_dtype is not None and dtype.is_floating_point else dtype))
    prep.config_dtype = out_dtype or config_dtype(prep.plan)
    return prep


def _folder_of(name: str, opened: dict[str, Any]) -> Path | None:
    """The model folder of the input ``name`` (or ``name`` itself, a folder that is not an input)."""
    src = opened.get(name)
    if src is not None:
        return getattr(src, "folder", None)
    return Path(name) if Path(name).is_dir() else None


def _merge_into(prep: Prepared, writer: ShardedWriter | BackgroundWriter, task: int | None) -> None:
    prep.models.sink = writer
    try:
        # compute_dtype bfloat16 / float16 / input: every pass of the method (a model-wide trim's too)
        # computes in the inputs' dtype (methods.trim.work_dtype); float32 otherwise
        with input_dtype_arithmetic(prep.models.narrow):
            _merge_groups(prep, writer, task)
        if prep.tied is not None:  # tied embeddings stay tied: the output projection is the merged input matrix
            writer.write(prep.tied[1], writer.read(prep.tied[0]))
    finally:
        prep.models.sink = None


def _merge_groups(prep: Prepared, writer: ShardedWriter | BackgroundWriter, task: int | None) -> None:
    for hp, keys in prep.groups:
        extra = {} if task is None else {"task": task}
        res = prep.method.fn(base=prep.models.base, experts=prep.models.subset(keys), **hp, **extra)
        if isinstance(res, dict):  # a method that does not stream: write what it returned
            for k, v in res.items():
                writer.write(k, v)
        elif hasattr(res, "flush"):  # a SinkView: write back a tensor the method patched in place
            res.flush()
        del res


def execute(prep: Prepared, output: OutputFolder, *, io_threads: bool = False,
            log: Callable[[str], None] = lambda s: None, device: Device | None = None) -> dict:
    """Run the merge into ``output`` (:class:`~clmerge.merging.io.output.OutputFolder`, checked, and the model
    files it copies too: :meth:`~clmerge.merging.io.output.OutputFolder.check_files`) and move the
    result into place (nothing is left on failure); returns a summary.

    Args:
        io_threads: read the next key and write the last one in background threads, overlapping both with
            the merge (``--threads`` >= 2).
        device: where the kernels compute (:mod:`clmerge.utils.device`); ``None``: the CPU. An active device
            adds ``"device"`` (its name, the wall time, the peak device memory) to the summary and the log.
    """
    prep.models.prefetch = io_threads
    if prep.vocab is not None:
        log(prep.vocab.summary() + " (merge_report.json)")
    recipe = prep.recipe
    meta = {"clmerge_method": prep.method.name}
    if device is not None:
        device.start()
    inputs = [("base", prep.models.base.name, prep.models.base.files)] if prep.models.base is not None else []
    inputs += [("model", e.name, getattr(e, "files", [])) for e in prep.models.experts]

    def fill_task(task: int | None) -> Callable[[Any], None]:
        def fill(writer: Any) -> None:
            with using_device(device):
                _merge_into(prep, writer, task)
        return fill

    output.write([FolderJob(
        prep.plan, fill_task(task), prep.shard_size, meta, background=io_threads,
        subfolder="" if len(prep.tasks) == 1 else f"task_{task}",
        done=f"merged {'task ' + str(task) + ' ' if task is not None else ''}({len(prep.plan)} tensors)",
        files=dict(model_folder=prep.model_folder, tokenizer_folder=prep.tokenizer_folder, dtype=prep.config_dtype,
                   recipe_file="clmerge_recipe.yaml", inputs=inputs, base_model=recipe.base,
                   recipe_yaml=recipe.to_yaml() + (f"# this folder: task {task}\n" if task is not None else ""),
                   tokenizer_files=prep.tokenizer.files if prep.tokenizer is not None else None,
                   edit_config=prep.vocab.renumbered if prep.vocab is not None else None,
                   report={"vocabulary": prep.vocab.report} if prep.vocab is not None else None,
                   tokenizer_reference=prep.tokenizer_reference, template_folder=prep.template_folder))
        for task in prep.tasks])
    info = {"method": prep.method.name, "keys": len(prep.plan), "out": str(output.out), "tasks": prep.tasks}
    if device is not None and device.active:
        log(device.summary())
        info["device"] = device.stats()
    return info
