"""The one recipe runner of ``clmerge merge``: a typed recipe, planned and checked once, then run.

:func:`build_recipe` turns a recipe file or the flag form into a :class:`~clmerge.merging.recipes.Recipe`
(``--set`` values in the one YAML ``key=value`` grammar). :func:`plan` resolves what kind of recipe it is
(a merge of whole models, layer slices, named stages, or LoRA adapters merged into one adapter) and checks
everything before any work: the method, the hyperparameters (once, :func:`~.methods.hparams.check_hyperparameters`),
the inputs. :func:`run_merge` then writes the output through the one model-folder writer
(:class:`~.io.output.OutputFolder`) and returns a :class:`MergeResult`. Errors are exceptions with one-line
messages; the command (:mod:`clmerge.cli.merge`) prints them.

Multi-stage recipes. 
A recipe's ``stages`` (each a full recipe with a ``name``; mergekit-multi's several YAML documents) run in
order before the recipe's own merge. A model reference (``base``, ``models[].model``, ``slices[].sources[].model``,
``tokenizer_from``) equal to an earlier stage's name reads that stage's result. Every reference is checked
before anything runs. Intermediate results are streamed into a temporary folder beside the output
(``.OUT.<pid>.<random>.tmp``, removed after the run, on failure and on SIGTERM too; a later run removes one
left by a killed process), so only the final model remains.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..errors import UsageError
from ..utils.device import Device, parse_device
from ..utils.dtypes import dtype_name
from ..utils.threads import io_threads
from ..utils.yaml_io import YamlLimitError, parse_assignment, read_yaml_mapping
from . import moe, pipeline, slices, towers
from .io.base import MergeInputError
from .io.output import OutputFolder, OutputTarget
from .io.peft import is_peft_adapter
from .io.readers import HUB_ID, open_checkpoint
from .lora_merge import ADAPTER_FOLDER_ONLY, open_adapters, write_merged_adapter
from .recipes import PASSTHROUGH, Recipe, recipe_of
from .methods.hparams import effective_hyperparameters
from .methods.registry import MERGES, get_method

__all__ = ["MergeResult", "Plan", "build_recipe", "check_stage_refs", "effective_recipe", "model_refs", "parse_set",
           "plan", "run_merge", "run_moe", "with_stage_paths"]

NEEDS_OUT = "--out PATH is required (a new folder, or a .safetensors file)"


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
                 sets: list[str], options: dict[str, Any]) -> Recipe:
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
        return recipe_of(data, str(recipe_path) if recipe_path else "")
    except ValueError as exc:  # name the flag, not the recipe key, when it came from a flag
        msg = str(exc)
        for key, value in options.items():
            if value is not None and msg.startswith(f"{key}:"):
                msg = f"--{key.replace('_', '-')}" + msg[len(key):]
        raise ValueError(msg) from None


@dataclass
class MergeResult:
    """What a merge wrote (or, for a dry run, the plan it printed)."""

    method: str
    out: str | None = None
    keys: int | str = 0
    plan: str | None = None  # a dry run: the plan; nothing was written
    tasks: list[int | None] = field(default_factory=list)
    layers: int | None = None  # a slice recipe or an MoE: the output's layer count
    experts: int | None = None  # an MoE: experts per layer
    stages: list[str] = field(default_factory=list)
    device: dict | None = None  # the device's name, wall time and peak memory when one was active
    warnings: list[str] = field(default_factory=list)
    report: dict = field(default_factory=dict)  # an adapter merge: merge_report.json


@dataclass
class Plan:
    """A recipe checked and resolved into one kind of run.

    ``models``: whole models merged key by key (:mod:`.pipeline`, ``prepared``); ``slices``: layer ranges
    stacked (:mod:`.slices`, ``prepared``); ``stages``: named merges run in order before the final one
    (each planned when its inputs exist); ``adapters``: PEFT adapters merged into one adapter (:mod:`.lora_merge`);
    ``moe``: a mixture of experts assembled from dense models (:mod:`.moe`, a :class:`~.moe.MoeRecipe`).
    """

    recipe: Recipe | moe.MoeRecipe
    kind: Literal["models", "slices", "stages", "adapters", "moe"]
    prepared: Any = None  # pipeline.Prepared | slices.SlicePlan | lora_merge.OpenedAdapters | moe.MoePlan
    adapter_out: str = "full"
    adapter_rank: int | None = None

    def text(self) -> str:
        """The dry run's plan."""
        r = self.recipe
        if self.kind == "models":
            return _models_text(self.prepared)
        if self.kind == "moe":
            return self.prepared.text()
        if self.kind == "slices":
            return _slices_text(self.prepared)
        if self.kind == "stages":
            lines = [f"stage {s.name}: {s.method} of {', '.join(m for _, m in model_refs(s))}" for s in r.stages]
            return "\n".join([*lines, f"final: {r.method} of {', '.join(m for _, m in model_refs(r))}"])
        return f"{r.method} of {len(r.models)} adapters into one {self.adapter_out} adapter"

    def inputs(self) -> list[Any]:
        """The opened inputs (an output never goes into one)."""
        if self.kind == "models":
            return [s for s in [self.prepared.models.base, *self.prepared.models.experts] if s is not None]
        if self.kind == "slices":
            return list(self.prepared.sources.values())
        if self.kind == "adapters":
            return [self.prepared.base, *self.prepared.srcs]
        if self.kind == "moe":
            return self.prepared.inputs()
        return []


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _models_text(prep: pipeline.Prepared) -> str:
    """A whole-model merge's plan: keys and shapes (summarised), per-group hyperparameters, and the memory
    estimate."""
    ms = prep.models
    n_in = ms.num_experts + (ms.base is not None)
    in_bytes = [math.prod(ms.experts[0].meta(k)[0]) * ms.experts[0].meta(k)[1].itemsize for k in ms.keys()]
    numels = [math.prod(s) for _, s, _ in prep.plan]
    out_bytes = sum(n * d.itemsize for n, (_, _, d) in zip(numels, prep.plan))
    largest = max(range(len(numels)), key=numels.__getitem__) if numels else 0
    # per key: every input's tensor, the output, and about T+2 float32 temporaries of whole-tensor kernels
    peak = n_in * max(in_bytes, default=0) + (ms.num_experts + 3) * 4 * max(numels, default=0)
    lines = [f"method: {prep.method.name}; inputs: {ms.num_experts} models" + (" + base" if ms.base else ""),
             f"keys: {len(prep.plan)} tensors, {sum(numels):,} parameters; largest {prep.plan[largest][0]} "
             f"{list(prep.plan[largest][1])}" if numels else "keys: none",
             f"output: {_size(out_bytes)} ({', '.join(sorted({dtype_name(d) for *_, d in prep.plan}))}), "
             f"shards of at most {_size(prep.shard_size)}",
             f"memory estimate: about {_size(peak)} beyond the Python process (the largest key's inputs, "
             "output and float32 temporaries; nothing else is held)",
             f"tasks: {'one model' if prep.tasks == [None] else ', '.join(map(str, prep.tasks))}",
             f"groups (keys with equal hyperparameters): {len(prep.groups)}"]
    for hp, keys in prep.groups:
        shown = ", ".join(keys[:3]) + (f", … ({len(keys)} keys)" if len(keys) > 3 else "")
        lines.append(f"  {prep.method.name} {hp or '{defaults}'}: {shown}")
    if prep.vocab is not None:
        lines.append(prep.vocab.summary())
    if ms.mixed:
        lines.append(f"mixed input dtypes on {len(ms.mixed)} keys: cast to {ms.compute_dtype}")
    return "\n".join(lines)


def _slices_text(sp: slices.SlicePlan) -> str:
    """A slice recipe's plan: which output layers come from which sources."""
    lines = [f"slices: {len(sp.recipe.slices)}; output layers: {sp.num_layers}; method: {sp.recipe.method}"]
    start = 0
    for sl in sp.recipe.slices:
        n = sl.sources[0].layer_range[1] - sl.sources[0].layer_range[0]
        srcs = " + ".join(f"{s.model} {list(s.layer_range)}" for s in sl.sources)
        lines.append(f"  layers {start}..{start + n - 1} <- {srcs}")
        start += n
    lines.append(f"tensors: {len(sp.plan)}")
    return "\n".join(lines)


def plan(recipe: Recipe, *, task: str | None = None, adapter_out: str = "full", adapter_rank: int | None = None,
         where: str = "parameters.") -> Plan:
    """Resolve and check ``recipe`` before any work; raises one-line errors (nothing is written).

    Args:
        where: how errors name the global parameters (``"--set "`` for the flag form).
    """
    recipe = effective_recipe(recipe)  # every default written out: what runs is what the output records
    if recipe.stages:
        check_stage_refs(recipe)
        for stage in [*recipe.stages, recipe]:
            if stage.method != PASSTHROUGH:
                get_method(stage.method)
        return Plan(recipe, "stages", adapter_out=adapter_out, adapter_rank=adapter_rank)
    method = None if recipe.method == PASSTHROUGH else get_method(recipe.method)  # resolved once, passed down
    if recipe.slices:
        if adapter_out != "full" or task is not None:
            raise ValueError("a slice recipe writes a full model folder: drop --adapter-out / --task")
        return Plan(recipe, "slices", slices.plan_slices(recipe, method))
    if adapter_out != "full":
        paths = [Path(m.model) for m in recipe.models]
        bad = next((p for p in paths if not is_peft_adapter(p)), None)
        if bad is not None:
            raise ValueError(f"--adapter-out {adapter_out}: every expert must be a PEFT adapter folder; {bad} is not")
        if recipe.base is None:
            raise ValueError(f"--adapter-out {adapter_out} needs --base (the adapters' base model) and --out")
        base = open_checkpoint(recipe.base, name=recipe.base)
        opened = open_adapters(method=method, base=base, adapters=paths, hyperparameters=recipe.parameters,
                               form=adapter_out, rank=adapter_rank)
        return Plan(recipe, "adapters", opened, adapter_out=adapter_out, adapter_rank=adapter_rank)
    prepared = towers.split_towers(pipeline.prepare(recipe, method, task=task, where=where))  # VLM folders
    return Plan(recipe, "models", prepared)


def effective_recipe(recipe: Recipe) -> Recipe:
    """``recipe`` (and each of its stages) with its method's hyperparameters as the merge uses them, every
    default filled in (:func:`~.methods.hparams.effective_hyperparameters`). :func:`plan` runs this recipe, and
    the output folder records it (``clmerge_recipe.yaml``, the model card), so re-running the recorded recipe
    gives the same merge after a later clmerge changes a default. The recipe keys whose default decides the
    output (:data:`~.recipes.PINNED`) are set too, so the recorded YAML writes them out: ``compute_dtype``,
    ``out_shard_size``, ``fill`` (with ``embeddings``) and a slice recipe's ``outer_tensors`` (``base`` when it
    names a base, else ``slices``). An unknown method is left for :func:`plan` to name."""
    update: dict[str, Any] = {"compute_dtype": recipe.compute_dtype, "out_shard_size": recipe.out_shard_size}
    if recipe.embeddings is not None:  # without embeddings, fill is refused (rows are merged by index)
        update["fill"] = recipe.fill
    if recipe.slices:
        update["outer_tensors"] = recipe.outer_tensors or ("base" if recipe.base else "slices")
    if recipe.stages:
        update["stages"] = [effective_recipe(s) for s in recipe.stages]
    if recipe.method != PASSTHROUGH and MERGES.get(recipe.method, None) is not None:
        per_model = [k for m in recipe.models for k in m.parameters]
        per_model += [k for sl in recipe.slices for s in sl.sources for k in s.parameters]
        params = effective_hyperparameters(get_method(recipe.method), recipe.parameters, per_model)
        if params != recipe.parameters or list(params) != list(recipe.parameters):
            update["parameters"] = params
    return recipe.model_copy(update=update)


def run_merge(recipe: Recipe, out: Path | None, *, task: str | None = None, dry_run: bool = False,
              overwrite: bool = False, adapter_out: str = "full", adapter_rank: int | None = None,
              hash_inputs: bool = True, device: str | Device | None = None,
              where: str = "parameters.", log: Callable[[str], None] = lambda s: None) -> MergeResult:
    """Plan and check ``recipe`` (:func:`plan`), then merge into ``out`` (a folder or one ``.safetensors``
    file), or return the plan (``dry_run``).

    Args:
        device: ``cpu`` (default), ``cuda`` or ``cuda:N`` (or a :class:`~clmerge.utils.device.Device`): where
            the kernels compute; the inputs stream there key by key and the results come back for writing.

    Raises:
        KeyError, ValueError, FileNotFoundError, MergeInputError: bad method, arguments or inputs; nothing is
        written then.
    """
    device = parse_device(device)
    p = plan(recipe, task=task, adapter_out=adapter_out, adapter_rank=adapter_rank, where=where)
    if p.kind == "models":
        _log_notes(p.prepared, log)
    if dry_run:
        return MergeResult(recipe.method, plan=p.text())
    output = _output(p, out, overwrite=overwrite, hash_inputs=hash_inputs, log=log)
    if p.kind == "stages":
        return _run_stages(p, output, log=log, task=task, device=device, where=where)
    if p.kind == "adapters":
        info = write_merged_adapter(p.prepared, output, device=device)
        keys = info.get("keys", "?")
        return MergeResult(recipe.method, out=str(output.out), keys=len(keys) if isinstance(keys, list) else keys,
                           device=info.get("device"), warnings=list(info.get("warnings", [])), report=info)
    output.check_files(p.prepared.model_folder, p.prepared.tokenizer_folder)  # one leading out: before any work
    if p.kind == "slices":
        info = slices.execute_slices(p.prepared, output, log=log)
        return MergeResult(recipe.method, out=info["out"], keys=info["keys"], layers=info["layers"])
    prep = p.prepared
    if output.kind == "file" and prep.tokenizer is not None:
        raise ValueError(f"--out {out}: embeddings / chat_template_from build a tokenizer for the merged rows, "
                         "which a single .safetensors file cannot hold: give --out a folder")
    if output.kind == "file" and len(prep.tasks) > 1:
        raise ValueError("--task all writes one folder per task: give --out a folder, not a .safetensors file")
    info = pipeline.execute(prep, output, io_threads=io_threads(), log=log, device=device)
    return MergeResult(info["method"], out=info["out"], keys=info["keys"], tasks=info["tasks"],
                       device=info.get("device"))


def run_moe(recipe: moe.MoeRecipe, out: Path | None, *, dry_run: bool = False, overwrite: bool = False,
            hash_inputs: bool = True, log: Callable[[str], None] = lambda s: None) -> MergeResult:
    """``clmerge moe``: an MoE recipe planned (its inputs opened and checked, :func:`.moe.plan_moe`), its output
    checked by the same rule as a merge's (:func:`_output`), then assembled (routers, then the tensors streamed
    through :class:`~.io.output.OutputFolder`); ``dry_run`` returns the plan."""
    p = Plan(recipe, "moe", moe.plan_moe(recipe))
    if dry_run:
        return MergeResult("moe", plan=p.text())
    output = _output(p, out, overwrite=overwrite, hash_inputs=hash_inputs, log=log)
    info = moe.execute_moe(p.prepared, output, log=log)  # its model files were checked when its inputs opened
    return MergeResult("moe", out=info["out"], keys=info["keys"], layers=info["layers"], experts=info["experts"])


def _output(p: Plan, out: Path | None, *, overwrite: bool, hash_inputs: bool,
            log: Callable[[str], None]) -> OutputFolder:
    """The one output check of every kind, before any work: ``out`` is given, is never an input nor inside
    one, and replaces nothing unasked (:class:`~.io.output.OutputFolder`)."""
    if out is None:
        raise ValueError(_NEEDS_OUT.get(p.kind, NEEDS_OUT).format(form=p.adapter_out))
    # an adapter folder has no model card, so its inputs are not hashed
    return OutputFolder(out, p.inputs(), overwrite=overwrite, hash_inputs=hash_inputs and p.kind != "adapters",
                        log=log, folder_only=_FOLDER_ONLY.get(p.kind), reshapes=p.kind in ("moe", "slices"))


# what a missing --out says, and why a kind writes only folders (``--out X.safetensors`` is one file)
_NEEDS_OUT = {"moe": "--out PATH is required (a new folder)", "adapters": "--adapter-out {form} needs --base (the adapters' base model) and --out",
              "slices": "--out PATH is required (a new folder)"}
_FOLDER_ONLY = {"moe": "an MoE model is a folder (with its config.json), not one .safetensors file",
                "slices": "a slice recipe writes a model folder (its config.json names the new layer count), not "
                          "one .safetensors file",
                "adapters": ADAPTER_FOLDER_ONLY}


def _log_notes(prep: pipeline.Prepared, log: Callable[[str], None]) -> None:
    for src in prep.models.experts:  # an adapter whose config names another base model
        if getattr(src, "warning", None):
            log(src.warning)
    for warning in (prep.vocab.warnings if prep.vocab is not None else []):  # tokenizers of different models
        log(warning)
    if prep.models.mixed:
        log(f"note: the inputs mix floating dtypes on {len(prep.models.mixed)} keys; they are cast to "
            f"{prep.recipe.compute_dtype} for the merge")


def _run_stages(p: Plan, output: OutputFolder, *, log: Callable[[str], None], **final: Any) -> MergeResult:
    """Run the named stages in order into a temporary folder beside ``output`` (checked already: a bad
    ``--out`` fails before the first stage), then the final merge into it; the intermediates are removed
    whatever happens (below)."""
    recipe, out = p.recipe, output.out
    done: dict[str, Path] = {}
    with intermediate_folder(out) as tmp:
        for i, stage in enumerate(recipe.stages):
            run_merge(with_stage_paths(stage, done), tmp / f"stage_{i}", hash_inputs=False, log=log,
                      device=final.get("device"))
            done[stage.name] = tmp / f"stage_{i}"
            log(f"stage {stage.name}: merged")
        res = run_merge(with_stage_paths(recipe, done, recorded=recipe.to_yaml()), out, overwrite=output.overwrite,
                        hash_inputs=output.hash_inputs, log=log, adapter_out=p.adapter_out,
                        adapter_rank=p.adapter_rank, **final)
    res.stages = [s.name for s in recipe.stages]
    return res


# --- stages: named merges whose results later stages and the final merge read ---


def model_refs(recipe: Recipe) -> list[tuple[str, str]]:
    """``(where, reference)`` of every model a recipe reads."""
    refs = [("base", recipe.base)] if recipe.base else []
    refs += [(f"models[{i}].model", m.model) for i, m in enumerate(recipe.models)]
    refs += [(f"slices[{i}].sources[{j}].model", s.model) for i, sl in enumerate(recipe.slices)
             for j, s in enumerate(sl.sources)]
    refs += [("tokenizer_from", recipe.tokenizer_from)] if recipe.tokenizer_from else []
    return refs


def check_stage_refs(recipe: Recipe) -> None:
    """Refuse, before anything runs, a reference that is neither an earlier stage's name nor an existing input.

    Raises:
        MergeInputError: names the stage, the key and the reference (exit code 3).
    """
    names = [s.name for s in recipe.stages]
    for i, stage in enumerate([*recipe.stages, recipe]):
        label = f"stages[{i}] ({stage.name})" if i < len(names) else "the final merge"
        for where, ref in model_refs(stage):
            if ref in names[:i]:
                continue
            if ref in names:
                raise MergeInputError(f"{label}: {where} {ref!r} is the stage stages[{names.index(ref)}], which runs "
                                      "later; expected the name of an earlier stage or a model")
            if not Path(ref).exists() and not (HUB_ID.match(ref) and not ref.startswith(".")):
                known = ", ".join(names[:i]) or "none"
                raise MergeInputError(f"{label}: {where} {ref!r} is neither the name of an earlier stage "
                                      f"({known}) nor an existing model folder or weights file")


def with_stage_paths(recipe: Recipe, done: dict[str, Path], recorded: str | None = None) -> Recipe:
    """``recipe`` (without stages) with every reference to a finished stage replaced by that stage's folder;
    ``recorded``: the text its output folder records instead (the whole multi-stage recipe, stage names and all,
    not the stages' temporary folders)."""
    def sub(ref: str | None) -> str | None:
        return str(done[ref]) if ref in done else ref

    data = recipe.model_dump()
    # keys the recipe did not set stay unset: some are refused when set alone (``fill`` without ``embeddings``)
    data = {k: v for k, v in data.items() if k in recipe.model_fields_set or k in ("models", "slices")}
    data.update(stages=[], base=sub(data.get("base")), tokenizer_from=sub(data.get("tokenizer_from")),
                chat_template_from=sub(data.get("chat_template_from")))
    for m in data["models"]:
        m["model"] = sub(m["model"])
    for sl in data["slices"]:
        for s in sl["sources"]:
            s["model"] = sub(s["model"])
    return Recipe.model_validate(data).recorded_as(recorded)


@contextmanager
def intermediate_folder(out: Path) -> Iterator[Path]:
    """A temporary folder beside ``out`` for the stages' results, removed on leaving (also on an error or
    SIGTERM, which :class:`~clmerge.merging.io.output.OutputTarget` turns into ``SystemExit``)."""
    with OutputTarget(Path(out), "folder") as target:  # never committed: always removed
        yield target.tmp
