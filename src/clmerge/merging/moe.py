"""Mixture-of-experts assembly (``clmerge moe``): a Mixtral-style MoE from a dense Llama / Mistral base and
dense experts fine-tuned from it, as mergekit-moe builds one.

```yaml
base_model: path/to/base            # attention, norms, embeddings and lm_head come from here
gate_mode: hidden                   # hidden | cheap_embed | random: how each layer's router is initialised
experts_per_token: 2                # Mixtral's num_experts_per_tok
dtype: bfloat16                     # default: the base's
experts:
  - source_model: path/to/code_expert          # its MLP becomes expert 0 of every layer
    positive_prompts: ["def main():", "import numpy as np"]
    negative_prompts: ["Once upon a time"]     # optional
  - source_model: path/to/story_expert
    positive_prompts: ["Once upon a time"]
```

Each layer's dense MLP of expert ``e`` becomes ``block_sparse_moe.experts.{e}.w1`` (``gate_proj``), ``w2``
(``down_proj``) and ``w3`` (``up_proj``); ``block_sparse_moe.gate.weight`` (``[E, hidden]``) holds one router
row per expert. The router logits of a token are ``gate @ x`` for the normalised residual ``x`` entering the
MLP, so a row pointing where an expert's prompts lie sends those tokens to that expert:

- ``hidden``: row ``e`` of layer ``l`` is the base's hidden state entering layer ``l`` (``hidden_states[l]``,
  the embedding output for ``l = 0``) at the last token of each positive prompt, averaged over the prompts,
  minus the same for the negative prompts, normalised to unit length (mergekit-moe's ``hidden``).
- ``cheap_embed``: the sum of the input embeddings of every token of the positive prompts, normalised, minus
  that of the negative prompts, normalised again; the same row in every layer (no forward pass).
- ``random``: standard normal rows (seeded by ``seed``).

Prompts are tokenised one by one with the tokenizer's BOS token in front (mergekit pads a batch, so its
``hidden`` takes the last position of shorter prompts from padding; here every prompt's own last token).
The base runs in float32 on the CPU for ``hidden``. Tensors stream into the output one at a time.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from pydantic import Field
from torch import Tensor

from ..config import ConfigError, StrictModel, check_keys, validate_strict
from ..utils.yaml_io import read_yaml_mapping
from ..utils import inpaths
from ..utils.dtypes import DtypeName, to_dtype
from .io.base import MergeInputError
from .io.output import FolderJob, OutputFolder, model_files
from .io.readers import open_checkpoint
from .io.staging import staged_model
from .io.writer import ShardedWriter, parse_size

__all__ = ["MoeExpert", "MoePlan", "MoeRecipe", "execute_moe", "load_moe_recipe", "plan_moe", "router_rows"]

_MLP = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_FAMILIES = ("llama", "mistral")


class MoeExpert(StrictModel):
    source_model: str
    positive_prompts: list[str] = Field(default_factory=list)
    negative_prompts: list[str] = Field(default_factory=list)


class MoeRecipe(StrictModel):
    base_model: str
    experts: list[MoeExpert] = Field(min_length=2)
    gate_mode: Literal["hidden", "cheap_embed", "random"] = "hidden"
    experts_per_token: int = Field(2, ge=1)
    dtype: DtypeName | None = None
    seed: int = 0
    out_shard_size: str | int = "5GB"


def load_moe_recipe(path: str | Path) -> MoeRecipe:
    """Read and validate an MoE recipe (unknown keys name the nearest valid key)."""
    data = read_yaml_mapping(path, "moe recipe")
    for i, e in enumerate(data.get("experts") or []):
        check_keys(e, MoeExpert, f"experts[{i}].")
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


def _base_config(base: Any) -> dict:
    """The base's ``config.json``; its config and tokenizer files are all checked here, before any work
    (:func:`~clmerge.merging.io.output.model_files`: inside the folder, regular files), and read only through
    the input boundary."""
    folder = getattr(base, "folder", None)
    files = model_files(Path(folder), Path(folder)) if folder is not None else {}
    if "config.json" not in files:
        raise MergeInputError(f"base_model {base.name}: no config.json; expected a Llama or Mistral model folder")
    config = inpaths.read_json(files["config.json"], within=folder, what=f"base_model {base.name}")
    if not isinstance(config, dict):
        raise MergeInputError(f"base_model {base.name}: {files['config.json']} is not a JSON object")
    if config.get("model_type") not in _FAMILIES:
        raise MergeInputError(f"base_model {base.name}: model_type {config.get('model_type')!r}; expected one of "
                              f"{', '.join(_FAMILIES)} (a dense model with Mixtral's attention layout)")
    return config


def _check_expert(i: int, expert: Any, base: Any, layers: int) -> None:
    for layer in range(layers):
        for proj in _MLP.values():
            key = f"model.layers.{layer}.mlp.{proj}.weight"
            try:
                shape = expert.meta(key)[0]
            except KeyError:
                raise MergeInputError(f"experts[{i}] {expert.name}: no key {key!r}; expected a dense model of "
                                      "the base's architecture") from None
            if tuple(shape) != tuple(base.meta(key)[0]):
                raise MergeInputError(f"experts[{i}] {expert.name}: key {key!r} has shape {list(shape)}, the base "
                                      f"has {list(base.meta(key)[0])}; expected equal shapes")


def _open_inputs(recipe: MoeRecipe) -> tuple[Any, list[Any], dict]:
    try:
        base = open_checkpoint(recipe.base_model, name=recipe.base_model)
    except FileNotFoundError as exc:
        raise MergeInputError(f"base_model: {exc}") from None
    config = _base_config(base)
    experts = []
    for i, e in enumerate(recipe.experts):
        try:
            experts.append(open_checkpoint(e.source_model, name=e.source_model))
        except FileNotFoundError as exc:
            raise MergeInputError(f"experts[{i}].source_model: {exc}") from None
        _check_expert(i, experts[-1], base, config["num_hidden_layers"])
    return base, experts, config


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


def router_rows(recipe: MoeRecipe, base: Any, layers: int, hidden: int) -> Tensor:
    """The router weights of every layer, ``[layers, experts, hidden]`` float32 (the module docstring)."""
    n = len(recipe.experts)
    if recipe.gate_mode == "random":
        return torch.randn((layers, n, hidden), generator=torch.Generator().manual_seed(recipe.seed))
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
    rows = []
    for e in recipe.experts:
        v = vec(e.positive_prompts)
        rows.append(_unit(v - vec(e.negative_prompts) if e.negative_prompts else v))
    return torch.stack(rows, dim=1)


def _plan(base: Any, n: int, layers: int, dtype: torch.dtype | None) -> list[tuple[str, tuple, torch.dtype]]:
    """The output tensors: the base's keys except its MLPs, then per layer the router and the experts."""
    def out(shape: tuple, d: torch.dtype) -> tuple:
        return tuple(shape), (dtype if dtype is not None and d.is_floating_point else d)

    mlp = {f"model.layers.{i}.mlp.{p}.weight" for i in range(layers) for p in _MLP.values()}
    plan = [(k, *out(*base.meta(k))) for k in base.keys() if k not in mlp]
    ref_dtype = base.meta("model.embed_tokens.weight")[1]
    hidden = base.meta("model.embed_tokens.weight")[0][1]
    for i in range(layers):
        plan.append((f"model.layers.{i}.block_sparse_moe.gate.weight", *out((n, hidden), ref_dtype)))
        for e in range(n):
            for w, p in _MLP.items():
                plan.append((f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight",
                             *out(*base.meta(f"model.layers.{i}.mlp.{p}.weight"))))
    return plan


def _write(writer: ShardedWriter, base: Any, experts: list[Any], gates: Tensor, layers: int) -> None:
    mlp = {f"model.layers.{i}.mlp.{p}.weight" for i in range(layers) for p in _MLP.values()}
    for k in base.keys():
        if k not in mlp:
            writer.write(k, base.get(k))
    for i in range(layers):
        writer.write(f"model.layers.{i}.block_sparse_moe.gate.weight", gates[i])
        for e, src in enumerate(experts):
            for w, p in _MLP.items():
                writer.write(f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight",
                             src.get(f"model.layers.{i}.mlp.{p}.weight"))


def _mixtral_config(config: dict, recipe: MoeRecipe, dtype: torch.dtype) -> dict:
    out = {k: v for k, v in config.items() if k not in ("mlp_bias", "pretraining_tp", "torch_dtype")}
    out.update(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=len(recipe.experts),
               num_experts_per_tok=recipe.experts_per_token, dtype=str(dtype).removeprefix("torch."))
    return out


@dataclass
class MoePlan:
    """An MoE recipe checked and its inputs opened (:func:`plan_moe`); the routers are computed when it runs."""

    recipe: MoeRecipe
    base: Any
    experts: list[Any]
    config: dict
    layers: int
    plan: list[tuple[str, tuple, torch.dtype]]
    dtype: torch.dtype

    def inputs(self) -> list[Any]:
        return [self.base, *self.experts]

    def text(self) -> str:
        """The dry run's plan."""
        r = self.recipe
        lines = [f"moe: {len(self.experts)} experts x {self.layers} layers, {r.experts_per_token} per token, "
                 f"{r.gate_mode} routers; tensors: {len(self.plan)}"]
        lines += [f"  expert {i}: {e.source_model}" for i, e in enumerate(r.experts)]
        return "\n".join(lines)


def plan_moe(recipe: MoeRecipe) -> MoePlan:
    """Open and check the base and the experts (headers only) and plan the output's tensors; nothing is
    written and no router is computed yet."""
    base, experts, config = _open_inputs(recipe)
    layers = int(config["num_hidden_layers"])
    plan = _plan(base, len(experts), layers, to_dtype(recipe.dtype))
    return MoePlan(recipe, base, experts, config, layers, plan, {k: d for k, _, d in plan}["model.embed_tokens.weight"])


def execute_moe(mp: MoePlan, output: OutputFolder, *, log: Callable[[str], None] = lambda s: None) -> dict:
    """Initialise the routers, then stream the MoE model into ``output`` (checked by the runner: a folder)."""
    recipe, base, experts, layers = mp.recipe, mp.base, mp.experts, mp.layers
    hidden = base.meta("model.embed_tokens.weight")[0][1]
    gates = router_rows(recipe, base, layers, hidden)
    text = yaml.safe_dump(recipe.model_dump(exclude_defaults=True), sort_keys=False)

    def mixtral_config(folder: Path) -> None:
        (folder / "config.json").write_text(json.dumps(_mixtral_config(mp.config, recipe, mp.dtype), indent=2,
                                                       sort_keys=True) + "\n")

    output.write([FolderJob(mp.plan, lambda w: _write(w, base, experts, gates, layers), parse_size(recipe.out_shard_size),
                            {"clmerge_method": "moe"},
                            files=dict(model_folder=Path(base.folder), tokenizer_folder=Path(base.folder),
                                       dtype=mp.dtype, recipe_file="clmerge_moe.yaml", recipe_yaml=text,
                                       base_model=recipe.base_model, inputs=[("base", base.name, base.files)]
                                       + [("model", e.name, getattr(e, "files", [])) for e in experts],
                                       after_copy=mixtral_config))])
    log(f"assembled {len(experts)} experts x {layers} layers ({recipe.gate_mode} routers)")
    return {"out": str(output.out), "keys": len(mp.plan), "experts": len(experts), "layers": layers}
