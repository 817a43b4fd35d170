"""The mixture-of-experts models ``clmerge moe`` writes: which dense models each target takes, the names and
shapes of the output's tensors in either expert layout, and its ``config.json``.

Targets (the output's ``model_type``; docs/moe.md):

- ``mixtral`` from Llama or Mistral: routed experts only.
- ``qwen2_moe`` from Qwen2 (or Llama / Mistral without attention biases): routed experts plus exactly one
  shared expert, scaled per token by ``sigmoid(shared_expert_gate @ x)``.
- ``qwen3_moe`` from Qwen3: routed experts only.
- ``deepseek_v3`` from a dense DeepSeek-V3-shaped model (every layer dense: ``first_k_dense_replace`` at least
  its layer count; the attention is DeepSeek's MLA, which no Llama maps onto), and ``dots1`` from Qwen3 (the
  same MoE block behind Qwen3's attention): routed experts, ``n_shared_experts`` shared experts summed into
  one ungated MLP (their intermediate rows side by side), a sigmoid router with ``e_score_correction_bias``
  (zeros) and the first ``first_k_dense_replace`` layers kept dense from the base.

Layouts. ``fused`` (transformers 5's own parameters): per layer ``mlp.experts.gate_up_proj`` ``[E, 2I, H]``
(expert ``e``'s ``gate_proj`` rows, then its ``up_proj`` rows) and ``mlp.experts.down_proj`` ``[E, H, I]``,
router ``mlp.gate.weight``. ``per_expert`` (transformers 4's parameters and the hub checkpoints' names, which
transformers 5 converts while loading): ``block_sparse_moe.experts.{e}.w1/w3/w2`` and
``block_sparse_moe.gate.weight`` for Mixtral, ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` and
``mlp.gate.weight`` for the others. ``auto`` is the layout the installed transformers builds.

Before anything is read, the output is checked against the model the installed transformers builds from the
output's config (on the meta device: no memory): every key it expects is planned with its shape and nothing
else is, so a base with attention biases a target lacks, say, is refused by name before any work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from .io.base import MergeInputError

__all__ = ["DEFAULT_TARGET", "TARGETS", "MoeShape", "Target", "check_against_transformers", "out_config",
           "resolve_target", "tensor_entries"]

_PROJ = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Target:
    """One output architecture: its ``model_type``, class, the dense ``model_type``\\ s it takes, how it holds
    shared experts (``none``; ``gated``: one, with a sigmoid gate; ``summed``: one or more, no gate), the
    per-expert names of gate / up / down and the MoE block's name in that layout, whether its router is kept in
    float32 (with an ``e_score_correction_bias``), and the config key of the number of routed experts."""

    model_type: str
    architecture: str
    sources: tuple[str, ...]
    shared: Literal["none", "gated", "summed"]
    per_expert: tuple[str, str, str]
    block: str
    router_fp32: bool
    experts_key: str


TARGETS = {t.model_type: t for t in [
    Target("mixtral", "MixtralForCausalLM", ("llama", "mistral"), "none", ("w1", "w3", "w2"), "block_sparse_moe",
           False, "num_local_experts"),
    Target("qwen2_moe", "Qwen2MoeForCausalLM", ("qwen2", "llama", "mistral"), "gated", _PROJ, "mlp", False,
           "num_experts"),
    Target("qwen3_moe", "Qwen3MoeForCausalLM", ("qwen3",), "none", _PROJ, "mlp", False, "num_experts"),
    Target("deepseek_v3", "DeepseekV3ForCausalLM", ("deepseek_v3",), "summed", _PROJ, "mlp", True,
           "n_routed_experts"),
    Target("dots1", "Dots1ForCausalLM", ("qwen3",), "summed", _PROJ, "mlp", True, "n_routed_experts"),
]}
#: the target a base's ``model_type`` gets when the recipe names no ``architecture``
DEFAULT_TARGET = {"llama": "mixtral", "mistral": "mixtral", "qwen2": "qwen2_moe", "qwen3": "qwen3_moe",
                  "deepseek_v3": "deepseek_v3"}
#: mergekit-moe's names of its output architectures (it matches ``architecture:`` as a prefix of them)
_MERGEKIT_NAMES = {"mixtral": "mixtral", "qwen moe": "qwen2_moe", "qwen": "qwen2_moe", "qwen3 moe": "qwen3_moe",
                   "qwen3": "qwen3_moe"}


def resolve_target(architecture: str | None, base_type: str | None, n_shared: int, where: str) -> Target:
    """The target of a recipe (``architecture:``, else the base's default) checked against the base's
    ``model_type`` and the number of shared experts; raises one-line errors (``where`` names the recipe)."""
    name = architecture
    if name is not None:
        key = name.strip().lower()
        if key in ("deepseek", "deepseek moe"):
            raise MergeInputError(f"{where}architecture: {name!r} is mergekit's DeepSeek-MoE (custom code that "
                                  "transformers does not ship); expected deepseek_v3 (from a dense DeepSeek-V3 "
                                  "model) or dots1 (from Qwen3): the same routed + shared experts")
        name = _MERGEKIT_NAMES.get(key, key)
        if name not in TARGETS:
            raise MergeInputError(f"{where}architecture: {architecture!r}; expected one of {', '.join(TARGETS)}")
    else:
        name = DEFAULT_TARGET.get(str(base_type))
        if name is None:
            raise MergeInputError(f"{where}base_model: model_type {base_type!r}; expected one of "
                                  f"{', '.join(DEFAULT_TARGET)} (a dense model), or name an architecture")
        if base_type == "qwen3" and n_shared:
            raise MergeInputError(f"{where}shared_experts: qwen3_moe has no shared experts; set architecture: "
                                  "dots1 for routed plus shared experts from Qwen3 models")
    target = TARGETS[name]
    if base_type not in target.sources:
        raise MergeInputError(f"{where}base_model: model_type {base_type!r}; {name} is built from "
                              f"{' or '.join(target.sources)} models")
    if target.shared == "none" and n_shared:
        raise MergeInputError(f"{where}shared_experts: {name} has no shared experts; drop them or choose "
                              "qwen2_moe, deepseek_v3 or dots1")
    if target.shared == "gated" and n_shared != 1:
        raise MergeInputError(f"{where}shared_experts: {name} needs exactly one shared expert (each Qwen2-MoE "
                              f"block has one), got {n_shared}")
    if target.shared == "summed" and n_shared < 1:
        raise MergeInputError(f"{where}shared_experts: {name} needs at least one shared expert (each of its MoE "
                              "blocks has n_shared_experts >= 1)")
    return target


@dataclass
class MoeShape:
    """What the output's tensors depend on: experts (routed, shared), layers, the first dense layers, sizes,
    dtypes and the layout written."""

    target: Target
    experts: int
    shared: int
    layers: int
    dense: int  # first_k_dense_replace: layers 0..dense-1 keep the base's MLP
    hidden: int
    inter: int  # the dense experts' intermediate size
    dtype: torch.dtype  # the weights' output dtype
    layout: Literal["fused", "per_expert"]
    keep_base_dtypes: bool = False  # no dtype asked: the base's tensors keep theirs

    @property
    def router_dtype(self) -> torch.dtype:
        return torch.float32 if self.target.router_fp32 else self.dtype


#: ``(key, shape, dtype, make)``: ``make(inputs)`` returns the tensor (``inputs``: :class:`MoeInputs`-like)
Entry = tuple[str, tuple[int, ...], torch.dtype, Callable[[Any], Tensor]]


def _mlp(i: int, p: str) -> str:
    return f"model.layers.{i}.mlp.{p}.weight"


def _routed(s: MoeShape, i: int) -> list[Entry]:
    t, n, h, inter, d = s.target, s.experts, s.hidden, s.inter, s.dtype
    if s.layout == "fused":
        pre = f"model.layers.{i}.mlp"
        return [
            (f"{pre}.gate.weight", (n, h), s.router_dtype, lambda x: x.gates[i]),
            (f"{pre}.experts.gate_up_proj", (n, 2 * inter, h), d,
             lambda x: torch.stack([torch.cat([e.get(_mlp(i, "gate_proj")), e.get(_mlp(i, "up_proj"))])
                                    for e in x.experts])),
            (f"{pre}.experts.down_proj", (n, h, inter), d,
             lambda x: torch.stack([e.get(_mlp(i, "down_proj")) for e in x.experts]))]
    pre = f"model.layers.{i}.{t.block}"
    out: list[Entry] = [(f"{pre}.gate.weight", (n, h), s.router_dtype, lambda x: x.gates[i])]
    for e in range(n):
        for name, src, shape in zip(t.per_expert, _PROJ, [(inter, h), (inter, h), (h, inter)]):
            out.append((f"{pre}.experts.{e}.{name}.weight", shape, d,
                        lambda x, e=e, src=src: x.experts[e].get(_mlp(i, src))))
    return out


def _shared(s: MoeShape, i: int) -> list[Entry]:
    h, inter, d, pre = s.hidden, s.inter, s.dtype, f"model.layers.{i}.mlp"
    if s.target.shared == "gated":  # Qwen2-MoE: one shared MLP and its sigmoid gate
        out: list[Entry] = [(f"{pre}.shared_expert.{p}.weight", shape, d, lambda x, p=p: x.shared[0].get(_mlp(i, p)))
                            for p, shape in zip(_PROJ, [(inter, h), (inter, h), (h, inter)])]
        return out + [(f"{pre}.shared_expert_gate.weight", (1, h), d, lambda x: x.shared_gates[i])]
    if s.target.shared == "summed":  # DeepSeek: the shared MLPs side by side are one MLP that sums them
        m = s.shared * inter
        return [(f"{pre}.shared_experts.gate_proj.weight", (m, h), d,
                 lambda x: torch.cat([e.get(_mlp(i, "gate_proj")) for e in x.shared])),
                (f"{pre}.shared_experts.up_proj.weight", (m, h), d,
                 lambda x: torch.cat([e.get(_mlp(i, "up_proj")) for e in x.shared])),
                (f"{pre}.shared_experts.down_proj.weight", (h, m), d,
                 lambda x: torch.cat([e.get(_mlp(i, "down_proj")) for e in x.shared], dim=1))]
    return []


def tensor_entries(s: MoeShape, base: Any) -> list[Entry]:
    """Every output tensor in write order: the base's keys except the MoE layers' MLPs (the first ``dense``
    layers keep theirs), then per MoE layer the router, the routed experts and the shared ones."""
    def cast(d: torch.dtype) -> torch.dtype:
        return s.dtype if d.is_floating_point and not s.keep_base_dtypes else d

    moe_mlps = {_mlp(i, p) for i in range(s.dense, s.layers) for p in _PROJ}
    out: list[Entry] = [(k, tuple(base.meta(k)[0]), cast(base.meta(k)[1]), lambda x, k=k: x.base.get(k))
                        for k in base.keys() if k not in moe_mlps]
    for i in range(s.dense, s.layers):
        out += _routed(s, i)
        if s.target.router_fp32:
            out.append((f"model.layers.{i}.mlp.gate.e_score_correction_bias", (s.experts,), torch.float32,
                        lambda x: torch.zeros(s.experts)))
        out += _shared(s, i)
    return out


def out_config(config: dict, s: MoeShape, per_token: int) -> dict:
    """The output's ``config.json``: the base's, its ``model_type`` and class replaced by the target's, with
    the MoE fields (routers normalise the top-k weights to sum 1, as Mixtral's softmax over the top k does)."""
    t = s.target
    out = {k: v for k, v in config.items() if k not in ("mlp_bias", "pretraining_tp", "torch_dtype", "auto_map")}
    out.update(model_type=t.model_type, architectures=[t.architecture], num_experts_per_tok=per_token,
               dtype=str(s.dtype).removeprefix("torch."))
    out[t.experts_key] = s.experts
    if t.model_type in ("qwen2_moe", "qwen3_moe"):
        out.update(decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=s.inter, norm_topk_prob=True)
    if t.model_type == "qwen2_moe":
        out.update(shared_expert_intermediate_size=s.inter,
                   qkv_bias=bool(config.get("model_type") == "qwen2" or config.get("attention_bias")))
    if t.shared == "summed":
        out.update(n_shared_experts=s.shared, first_k_dense_replace=s.dense, moe_intermediate_size=s.inter,
                   n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True)
    return out


def _meta_model(config: dict) -> Any:
    """The model the installed transformers builds from ``config`` (a dict), on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k not in ("architectures",)})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def check_against_transformers(config: dict, entries_of: Callable[[str], list[Entry]], where: str) -> str:
    """Refuse (one line) an output whose keys or shapes differ from the model the installed transformers builds
    from its config (``entries_of(layout)``: the output's entries in ``layout``); returns the installed
    layout (``fused`` when that model holds its experts as 3-D tensors, else ``per_expert``)."""
    model = _meta_model(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    layout = "fused" if any(k.endswith(".experts.gate_up_proj") for k in expected) else "per_expert"
    planned = {k: shape for k, shape, _, _ in entries_of(layout)}
    if getattr(model.config, "tie_word_embeddings", False):  # a tied lm_head is not stored
        expected.pop("lm_head.weight", None)
        planned.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(planned))
    extra = sorted(set(planned) - set(expected))
    wrong = sorted(k for k in set(expected) & set(planned) if expected[k] != planned[k])
    for what, keys in (("lacks", missing), ("has keys the model does not", extra), ("has wrong shapes at", wrong)):
        if keys:
            shown = ", ".join(keys[:3]) + (f" (+{len(keys) - 3} more)" if len(keys) > 3 else "")
            raise MergeInputError(f"{where}the {config['model_type']} output {what}: {shown}; expected the "
                                  f"base's non-MLP weights to be those of a {config['model_type']} model")
    return layout
