"""Mixture-of-experts assembly (``clmerge moe``): an MoE model from a dense base and dense experts fine-tuned
from it, as mergekit-moe builds one: Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 or dots.llm1
(:mod:`.moe_layouts`: the targets, their tensors in the fused or per-expert layout, their config).

```yaml
base_model: path/to/base            # attention, norms, embeddings and lm_head come from here
architecture: qwen2_moe             # default: from the base's model_type (llama/mistral -> mixtral, ...)
gate_mode: hidden                   # hidden | cheap_embed | random: how each layer's router is initialised
experts_per_token: 2                # num_experts_per_tok
layout: auto                        # auto | fused | per_expert (auto: what the installed transformers builds)
dtype: bfloat16                     # default: the base's
experts:
  - source_model: path/to/code_expert          # its MLP becomes routed expert 0 of every MoE layer
    positive_prompts: ["def main():", "import numpy as np"]
    negative_prompts: ["Once upon a time"]     # optional
  - source_model: path/to/story_expert
    positive_prompts: ["Once upon a time"]
shared_experts:                     # qwen2_moe: exactly one (its prompts set its gate); deepseek_v3, dots1: >= 1
  - source_model: path/to/generalist
    positive_prompts: ["Hello"]
```

Each MoE layer's router (``gate.weight``, ``[E, hidden]``) holds one row per routed expert. The router
logits of a token are ``gate @ x`` for the normalised residual ``x`` entering the MLP, so a row pointing where
an expert's prompts lie sends those tokens to that expert:

- ``hidden``: row ``e`` of layer ``l`` is the base's hidden state entering layer ``l`` (``hidden_states[l]``,
  the embedding output for ``l = 0``) at the last token of each positive prompt, averaged over the prompts,
  minus the same for the negative prompts, normalised to unit length (mergekit-moe's ``hidden``).
- ``cheap_embed``: the sum of the input embeddings of every token of the positive prompts, normalised, minus
  that of the negative prompts, normalised again; the same row in every layer (no forward pass).
- ``random``: standard normal rows (seeded by ``seed``; a Qwen2-MoE shared expert's gate by ``seed + 1``).

A Qwen2-MoE shared expert's gate (``shared_expert_gate.weight``, ``[1, hidden]``) is its prompts' row, made
the same way (mergekit-moe's rule).

Prompts are tokenised one by one with the tokenizer's BOS token in front (mergekit pads a batch, so its
``hidden`` takes the last position of shorter prompts from padding; here every prompt's own last token).
The base runs in float32 on the CPU for ``hidden``. Tensors stream into the output one at a time.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch
import yaml
from pydantic import Field
from torch import Tensor

from ..config import ConfigError, StrictModel, check_keys, validate_strict
from ..utils import inpaths
from ..utils.dtypes import DtypeName, to_dtype
from ..utils.yaml_io import read_yaml_mapping
from .io.base import MergeInputError
from .io.output import FolderJob, OutputFolder, model_files
from .preflight import check_architectures
from .io.readers import open_checkpoint
from .io.staging import staged_model
from .io.writer import parse_size
from .moe_layouts import MoeShape, Target, check_against_transformers, out_config, resolve_target, tensor_entries

__all__ = ["MoeExpert", "MoePlan", "MoeRecipe", "execute_moe", "load_moe_recipe", "plan_moe", "router_rows"]

_PROJ = ("gate_proj", "up_proj", "down_proj")


class MoeExpert(StrictModel):
    source_model: str
    positive_prompts: list[str] = Field(default_factory=list)
    negative_prompts: list[str] = Field(default_factory=list)


class MoeRecipe(StrictModel):
    base_model: str
    experts: list[MoeExpert] = Field(min_length=2)
    shared_experts: list[MoeExpert] = Field(default_factory=list)
    architecture: str | None = None
    layout: Literal["auto", "fused", "per_expert"] = "auto"
    first_k_dense_replace: int = Field(0, ge=0)
    gate_mode: Literal["hidden", "cheap_embed", "random"] = "hidden"
    experts_per_token: int = Field(2, ge=1)
    dtype: DtypeName | None = None
    seed: int = 0
    out_shard_size: str | int = "5GB"


_SETTINGS = ("layout", "first_k_dense_replace", "gate_mode", "experts_per_token", "seed")  # recorded even at defaults


def load_moe_recipe(path: str | Path) -> MoeRecipe:
    """Read and validate an MoE recipe (unknown keys name the nearest valid key)."""
    data = read_yaml_mapping(path, "moe recipe")
    if data.get("shared_experts") is None:
        data.pop("shared_experts", None)  # mergekit-moe writes ``shared_experts: null`` for none
    for group in ("experts", "shared_experts"):
        for i, e in enumerate(data.get(group) or []):
            check_keys(e, MoeExpert, f"{group}[{i}].")
    try:
        recipe = validate_strict(MoeRecipe, data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if recipe.experts_per_token > len(recipe.experts):
        raise ConfigError(f"{path}: experts_per_token: {recipe.experts_per_token} is more than the "
                          f"{len(recipe.experts)} experts")
    if recipe.gate_mode != "random":
        for i, e in enumerate(recipe.experts):
            if not e.positive_prompts:
                raise ConfigError(f"{path}: experts[{i}].positive_prompts: gate_mode {recipe.gate_mode} needs at "
                                  "least one prompt per expert (or use gate_mode: random)")
    return recipe


def _check_shared_prompts(recipe: MoeRecipe, target: Target) -> None:
    """A Qwen2-MoE shared expert's gate comes from its prompts; DeepSeek-style shared experts have no gate."""
    for i, e in enumerate(recipe.shared_experts):
        if target.shared == "summed" and (e.positive_prompts or e.negative_prompts):
            raise MergeInputError(f"shared_experts[{i}]: {target.model_type}'s shared experts have no gate; drop "
                                  "their positive_prompts / negative_prompts")
        if target.shared == "gated" and recipe.gate_mode != "random" and not e.positive_prompts:
            raise MergeInputError(f"shared_experts[{i}].positive_prompts: the shared expert's gate of "
                                  f"{target.model_type} is made from its prompts under gate_mode "
                                  f"{recipe.gate_mode} (or use gate_mode: random)")


def _base_config(base: Any) -> dict:
    """The base's ``config.json``; its config and tokenizer files are all checked here, before any work
    (:func:`~clmerge.merging.io.output.model_files`: inside the folder, regular files), and read only through
    the input boundary."""
    folder = getattr(base, "folder", None)
    files = model_files(Path(folder), Path(folder)) if folder is not None else {}
    if "config.json" not in files:
        raise MergeInputError(f"base_model {base.name}: no config.json; expected a dense model folder (Llama, "
                              "Mistral, Qwen2, Qwen3 or DeepSeek-V3)")
    config = inpaths.read_json(files["config.json"], within=folder, what=f"base_model {base.name}")
    if not isinstance(config, dict):
        raise MergeInputError(f"base_model {base.name}: {files['config.json']} is not a JSON object")
    return config


def _mlp(layer: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.{proj}.weight"


def _check_expert(what: str, expert: Any, base: Any, layers: int) -> None:
    for layer in range(layers):
        for proj in _PROJ:
            key = _mlp(layer, proj)
            try:
                ref = base.meta(key)[0]
            except KeyError:
                raise MergeInputError(f"base_model {base.name}: no key {key!r}; expected a dense model (every "
                                      "layer an MLP with gate_proj, up_proj, down_proj)") from None
            try:
                shape = expert.meta(key)[0]
            except KeyError:
                raise MergeInputError(f"{what} {expert.name}: no key {key!r}; expected a dense model of "
                                      "the base's architecture") from None
            if tuple(shape) != tuple(ref):
                raise MergeInputError(f"{what} {expert.name}: key {key!r} has shape {list(shape)}, the base "
                                      f"has {list(ref)}; expected equal shapes")


def _open(ref: str, what: str) -> Any:
    try:
        return open_checkpoint(ref, name=ref)
    except FileNotFoundError as exc:
        raise MergeInputError(f"{what}: {exc}") from None


def _open_inputs(recipe: MoeRecipe) -> tuple[Any, list[Any], list[Any], dict]:
    base = _open(recipe.base_model, "base_model")
    config = _base_config(base)
    layers = int(config.get("num_hidden_layers", 0))
    opened: dict[str, list[Any]] = {"experts": [], "shared_experts": []}
    for group, items in (("experts", recipe.experts), ("shared_experts", recipe.shared_experts)):
        for i, e in enumerate(items):
            opened[group].append(_open(e.source_model, f"{group}[{i}].source_model"))
    every = [(f"{group}[{i}] ({src.name})", src) for group, srcs in opened.items() for i, src in enumerate(srcs)]
    # headers and configs only: another architecture is named as such before any key is compared
    check_architectures([base, *(s for _, s in every)],
                        [f"base_model ({base.name})", *(label for label, _ in every)])
    for group, srcs in opened.items():
        for i, src in enumerate(srcs):
            _check_expert(f"{group}[{i}]", src, base, layers)
    return base, opened["experts"], opened["shared_experts"], config


def _tokenizer(base: Any) -> Any:
    """The base's tokenizer, loaded from its checked files only (:func:`~.io.staging.staged_model`)."""
    from transformers import AutoTokenizer

    with staged_model(base.folder, weights=False) as staged:
        try:
            return AutoTokenizer.from_pretrained(str(staged))
        except (OSError, ValueError) as exc:
            why = str(exc).splitlines()[0].replace(str(staged), str(base.folder)) if str(exc) else type(exc).__name__
            raise MergeInputError(f"base_model {base.name}: no usable tokenizer ({why[:120]}); gate modes hidden "
                                  "and cheap_embed tokenize the prompts: use gate_mode random or add the tokenizer "
                                  "files") from None


def _ids(tok: Any, prompt: str) -> Tensor:
    ids = tok((tok.bos_token or "") + prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return ids[0]


def _unit(v: Tensor) -> Tensor:
    return v / v.norm(dim=-1, keepdim=True).clamp(min=1e-8)


def _cheap_embed(embed: Tensor, tok: Any, prompts: list[str]) -> Tensor:
    """Unit vector of the summed input embeddings of every token of ``prompts``, shape ``[hidden]``."""
    return _unit(sum(embed[_ids(tok, p)].sum(0) for p in prompts))


def _hidden(model: Any, tok: Any, prompts: list[str]) -> Tensor:
    """Mean over ``prompts`` of the hidden state entering each layer at the last token, ``[layers, hidden]``."""
    rows = []
    with torch.no_grad():
        for p in prompts:
            out = model(_ids(tok, p)[None], output_hidden_states=True)
            rows.append(torch.stack([h[0, -1] for h in out.hidden_states[:-1]]).float())
    return torch.stack(rows).mean(0)


def router_rows(recipe: MoeRecipe, base: Any, layers: int, hidden: int,
                groups: list[list[MoeExpert]] | None = None) -> list[Tensor]:
    """One ``[layers, experts, hidden]`` float32 tensor of router rows per group of experts (default: the
    routed experts; the module docstring); under ``random`` group ``g`` is seeded by ``seed + g``."""
    groups = [recipe.experts] if groups is None else groups
    if recipe.gate_mode == "random":
        return [torch.randn((layers, len(g), hidden), generator=torch.Generator().manual_seed(recipe.seed + j))
                for j, g in enumerate(groups)]
    tok = _tokenizer(base)
    if recipe.gate_mode == "cheap_embed":
        embed = base.get("model.embed_tokens.weight").float()
        def vec(prompts: list[str]) -> Tensor:
            return _cheap_embed(embed, tok, prompts).expand(layers, hidden)
    else:
        from transformers import AutoModelForCausalLM

        with staged_model(base.folder) as staged:  # the base's checked files only
            model = AutoModelForCausalLM.from_pretrained(str(staged), dtype=torch.float32).eval()
        def vec(prompts: list[str]) -> Tensor:
            return _hidden(model, tok, prompts)
    out = []
    for g in groups:
        rows = []
        for e in g:
            v = vec(e.positive_prompts)
            rows.append(_unit(v - vec(e.negative_prompts) if e.negative_prompts else v))
        out.append(torch.stack(rows, dim=1))
    return out


@dataclass
class MoePlan:
    """An MoE recipe checked and its inputs opened (:func:`plan_moe`); the routers are computed when it runs."""

    recipe: MoeRecipe
    base: Any
    experts: list[Any]
    shared: list[Any]
    config: dict  # the output's config.json
    shape: MoeShape
    entries: list  # (key, shape, dtype, make) of every output tensor, in write order

    @property
    def layers(self) -> int:
        return self.shape.layers

    @property
    def plan(self) -> list[tuple[str, tuple, torch.dtype]]:
        return [(k, s, d) for k, s, d, _ in self.entries]

    def inputs(self) -> list[Any]:
        return [self.base, *self.experts, *self.shared]

    def text(self) -> str:
        """The dry run's plan."""
        r, s = self.recipe, self.shape
        shared = f" + {s.shared} shared" if s.shared else ""
        dense = f" after {s.dense} dense layers" if s.dense else ""
        lines = [f"moe: {s.target.model_type} ({s.layout} experts), {len(self.experts)} experts{shared} x "
                 f"{s.layers - s.dense} layers{dense}, {r.experts_per_token} per token, {r.gate_mode} routers; "
                 f"tensors: {len(self.entries)}"]
        lines += [f"  expert {i}: {e.source_model}" for i, e in enumerate(r.experts)]
        lines += [f"  shared expert {i}: {e.source_model}" for i, e in enumerate(r.shared_experts)]
        return "\n".join(lines)


def plan_moe(recipe: MoeRecipe) -> MoePlan:
    """Open and check the base and the experts (headers only), choose the target and the layout, and check the
    planned tensors against the model the installed transformers builds from the output's config (on the meta
    device); nothing is written and no router is computed yet."""
    base, experts, shared, config = _open_inputs(recipe)
    target = resolve_target(recipe.architecture, config.get("model_type"), len(shared), "")
    _check_shared_prompts(recipe, target)
    layers = int(config["num_hidden_layers"])
    if recipe.first_k_dense_replace and target.shared != "summed":
        raise MergeInputError(f"first_k_dense_replace: {target.model_type} has no dense layers before its MoE "
                              "layers (only deepseek_v3 and dots1 do)")
    if recipe.first_k_dense_replace >= layers:
        raise MergeInputError(f"first_k_dense_replace: {recipe.first_k_dense_replace} leaves no MoE layer of the "
                              f"base's {layers}; expected less than {layers}")
    embed_shape, embed_dtype = base.meta("model.embed_tokens.weight")
    shape = MoeShape(target, len(experts), len(shared), layers, recipe.first_k_dense_replace, int(embed_shape[1]),
                     int(base.meta(_mlp(0, "gate_proj"))[0][0]), to_dtype(recipe.dtype) or embed_dtype, "fused",
                     keep_base_dtypes=recipe.dtype is None)
    cfg = out_config(config, shape, recipe.experts_per_token)
    installed = check_against_transformers(
        cfg, lambda layout: tensor_entries(dataclasses.replace(shape, layout=layout), base), "")
    shape.layout = installed if recipe.layout == "auto" else recipe.layout
    return MoePlan(recipe, base, experts, shared, cfg, shape, tensor_entries(shape, base))


def execute_moe(mp: MoePlan, output: OutputFolder, *, log: Callable[[str], None] = lambda s: None) -> dict:
    """Initialise the routers (and a Qwen2-MoE shared expert's gate), then stream the MoE model into ``output``
    (checked by the runner: a folder) through the one writer."""
    recipe, base, s = mp.recipe, mp.base, mp.shape
    gated = s.target.shared == "gated"
    rows = router_rows(recipe, base, s.layers, s.hidden, [recipe.experts] + ([recipe.shared_experts] if gated else []))
    inputs = SimpleNamespace(base=base, experts=mp.experts, shared=mp.shared, gates=rows[0],
                             shared_gates=rows[1] if gated else None)
    # every assembly setting as used, defaults written out (the recorded recipe outlives a changed default)
    text = yaml.safe_dump(recipe.model_dump(exclude_defaults=True)
                          | {k: getattr(recipe, k) for k in _SETTINGS}, sort_keys=False)

    def fill(writer: Any) -> None:
        for key, _, _, make in mp.entries:
            writer.write(key, make(inputs))

    def write_config(folder: Path) -> None:
        (folder / "config.json").write_text(json.dumps(mp.config, indent=2, sort_keys=True) + "\n")

    output.write([FolderJob(mp.plan, fill, parse_size(recipe.out_shard_size),
                            {"clmerge_method": "moe", "clmerge_moe_layout": s.layout},
                            files=dict(model_folder=Path(base.folder), tokenizer_folder=Path(base.folder),
                                       dtype=s.dtype, recipe_file="clmerge_moe.yaml", recipe_yaml=text,
                                       base_model=recipe.base_model, inputs=[("base", base.name, base.files)]
                                       + [("model", e.name, getattr(e, "files", [])) for e in mp.experts]
                                       + [("shared", e.name, getattr(e, "files", [])) for e in mp.shared],
                                       after_copy=write_config))])
    log(f"assembled {s.target.model_type}: {len(mp.experts)} experts x {s.layers - s.dense} layers "
        f"({recipe.gate_mode} routers, {s.layout} layout)")
    return {"out": str(output.out), "keys": len(mp.entries), "experts": len(mp.experts), "layers": s.layers}
