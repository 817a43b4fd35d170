"""LoRA layers with several components per layer, and their injection into a model.

A :class:`LoRALinear` wraps a frozen ``nn.Linear`` (``base_layer``) and holds named components. Component k
adds ``c_k * U_k D_k`` to the weight, where ``D_k`` (r x in) is the down-projection applied to the input first,
``U_k`` (out x r) the up-projection, and the coefficient

    c_k = scale_k * magnitude_k * multiplier_k / norm_k

- ``scale``: a fixed float (LoRA's alpha / r; 1 by default);
- ``magnitude``: a scalar looked up by key in the model-wide ``lora_magnitudes`` dict, shared across layers
  (SD-LoRA Eq. 4: one alpha_k per task shared by every projection); 1 when the component has no key;
- ``multiplier``: a runtime value (not saved), e.g. LoRA-P&M's perturbation ``1 + eps`` (Eq. 12);
- ``norm``: 1, ``||U D||_F`` (SD-LoRA Eq. 3, from r x r Gram matrices, never forming U D), or the code's
  ``||U||_F ||D||_F`` (SD-LoRA official code, ``models/sdlora.py`` of WuYichen-97/SD-Lora-CL).

:meth:`LoRAComponent.coefficient` is the only place the formula lives; ``forward``, ``delta_weight`` and
folding all use it.

Two equivalent ways to apply the components in :meth:`LoRALinear.forward` (``LoRALinear.compute``):

- ``"lowrank"``: ``y = W_0 x + sum_k c_k U_k (D_k x)``, one low-rank path per component (the original path);
- ``"dense"``: ``y = (W_0 + sum_k c_k U_k D_k) x``, the delta formed each call from the stacked factors
  ``[c_1 U_1 | c_2 U_2 | ...] @ [D_1; D_2; ...]`` (O(out in sum r_k), no per-token work) and added to the
  weight, so the layer costs one matmul; gradients flow to every ``c_k`` (hence to shared magnitudes) and to
  trainable factors through that product. When any of them needs a gradient, backward forms the dense weight
  gradient ``g^T x`` (O(tokens in out)) once, instead of per-component low-rank backward paths;
- ``"auto"``: ``dense`` when a FLOP estimate (:func:`dense_is_cheaper`) says so, else ``lowrank``.

Both give the same outputs and gradients up to float rounding (tests/adapters/test_lora_compute.py). The default is
``"lowrank"``; methods with many components per layer (SD-LoRA) switch to ``"auto"`` with
:func:`set_lora_compute`.
"""

from __future__ import annotations

import math
import re
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "TARGET_ALIASES",
    "LoRAComponent",
    "LoRALinear",
    "add_lora_component",
    "dense_is_cheaper",
    "fold_component",
    "inject_lora",
    "lora_layers",
    "resolve_targets",
    "set_lora_compute",
]

Normalize = Literal["none", "fro", "factor"]
Compute = Literal["lowrank", "dense", "auto"]
COMPUTE_MODES: tuple[str, ...] = ("lowrank", "dense", "auto")

# Weight of one element of a per-token elementwise op (memory-bound: scaling a component's output by c_k,
# adding it to y, and their backward) relative to one multiply-add of a matmul, in dense_is_cheaper.
_ELEMENTWISE_COST = 4.0


def gram_frobenius_norm(up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``||U D||_F`` from r x r Gram matrices: ``sqrt(trace((U^T U)(D D^T)))``; O(r^2 (m + n)), not O(m n r)."""
    gu = up.t() @ up  # (r, r)
    gd = down @ down.t()  # (r, r)
    return torch.sqrt(torch.clamp((gu * gd).sum(), min=0.0))  # trace(A B) = sum(A * B^T); both symmetric


class LoRAComponent(nn.Module):
    """One low-rank component: ``lora_down`` (r, in) and ``lora_up`` (out, r).

    Args:
        in_features, out_features, rank: shapes.
        init: ``"lora"`` (down Kaiming-uniform with a=sqrt(5), up zero: the update starts at 0),
            ``"small"`` (both small Gaussian, std ``init_std``; needed when the direction is normalised from
            the start, as Theorem 1 of SD-LoRA assumes), or ``"zeros"`` (values to be loaded).
        scale, normalize, magnitude: see the module docstring.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        *,
        init: Literal["lora", "small", "zeros"] = "lora",
        init_std: float = 1e-3,
        scale: float = 1.0,
        normalize: Normalize = "none",
        magnitude: str | None = None,
        eps: float = 1e-12,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.rank, self.scale, self.normalize, self.magnitude, self.eps = rank, float(scale), normalize, magnitude, eps
        self.lora_down = nn.Parameter(torch.zeros(rank, in_features))
        self.lora_up = nn.Parameter(torch.zeros(out_features, rank))
        self.multiplier: float | torch.Tensor = 1.0
        with torch.no_grad():
            if init == "lora":
                bound = math.sqrt(6.0 / ((1 + 5.0) * in_features))  # kaiming_uniform_(a=sqrt(5)) on (r, in)
                self.lora_down.uniform_(-bound, bound, generator=generator)
            elif init == "small":
                self.lora_down.normal_(0.0, init_std, generator=generator)
                self.lora_up.normal_(0.0, init_std, generator=generator)
            elif init != "zeros":
                raise ValueError(f"unknown LoRA init {init!r}")

    def norm(self) -> torch.Tensor | float:
        if self.normalize == "none":
            return 1.0
        if not (self.lora_up.requires_grad or self.lora_down.requires_grad):
            # frozen direction (SD-LoRA's old tasks): the norm is a constant; recompute only when the factors
            # change (in-place version, storage, normaliser). Same expression, so the same value.
            up, down = self.lora_up, self.lora_down
            key = (up.data_ptr(), up._version, down.data_ptr(), down._version, up.device, self.normalize, self.eps)
            cached = self.__dict__.get("_norm_cache")
            if cached is None or cached[0] != key:
                with torch.no_grad():
                    value = self._norm_value()
                object.__setattr__(self, "_norm_cache", (key, value))
                return value
            return cached[1]
        return self._norm_value()

    def _norm_value(self) -> torch.Tensor:
        up, down = self.lora_up.float(), self.lora_down.float()
        if self.normalize == "fro":
            return gram_frobenius_norm(up, down) + self.eps
        if self.normalize == "factor":
            return up.norm() * down.norm() + self.eps
        raise ValueError(f"unknown normalize {self.normalize!r}")

    def coefficient(self, magnitudes: nn.ParameterDict | None) -> torch.Tensor | float:
        """``scale * magnitude * multiplier / norm`` (the only definition of a component's weight)."""
        c = self.scale * self.multiplier
        if self.magnitude is not None:
            if magnitudes is None or self.magnitude not in magnitudes:
                raise KeyError(f"LoRA component needs magnitude {self.magnitude!r}, which the model does not have")
            c = c * magnitudes[self.magnitude]
        return c / self.norm()

    def delta_weight(self, magnitudes: nn.ParameterDict | None = None) -> torch.Tensor:
        """The dense update ``c * U D`` (out, in), computed in fp32."""
        return self.coefficient(magnitudes) * (self.lora_up.float() @ self.lora_down.float())

    def spec(self) -> dict:
        return {"rank": self.rank, "scale": self.scale, "normalize": self.normalize, "magnitude": self.magnitude,
                "in": self.lora_down.shape[1], "out": self.lora_up.shape[0]}


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus named LoRA components (peft's wrapper shape)."""

    def __init__(self, base_layer: nn.Linear) -> None:
        super().__init__()
        if not isinstance(base_layer, nn.Linear):
            raise TypeError(f"LoRALinear wraps nn.Linear, got {type(base_layer).__name__}")
        self.base_layer = base_layer
        self.components = nn.ModuleDict()
        object.__setattr__(self, "_magnitudes", None)  # shared ParameterDict, owned (and saved) by the model
        self.compute: Compute = "lowrank"  # how forward applies the components (module docstring); not saved

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    def attach_magnitudes(self, magnitudes: nn.ParameterDict | None) -> None:
        object.__setattr__(self, "_magnitudes", magnitudes)

    def add_component(self, name: str, rank: int, **kwargs) -> LoRAComponent:
        if name in self.components:
            raise ValueError(f"LoRA component {name!r} already exists")
        w = self.base_layer.weight
        comp = LoRAComponent(self.in_features, self.out_features, rank, **kwargs).to(device=w.device)
        self.components[name] = comp
        return comp

    def delta_weight(self, name: str) -> torch.Tensor:
        return self.components[name].delta_weight(self._magnitudes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.components:
            return self.base_layer(x)
        mode = self.compute
        if mode == "auto":
            mode = "dense" if dense_is_cheaper(self, x) else "lowrank"
        if mode == "dense":
            return self.forward_dense(x)
        if mode != "lowrank":
            raise ValueError(f"unknown LoRA compute mode {mode!r} (expected one of {COMPUTE_MODES})")
        return self.forward_lowrank(x)

    def forward_lowrank(self, x: torch.Tensor) -> torch.Tensor:
        """``W_0 x + sum_k c_k U_k (D_k x)``: one low-rank path per component."""
        y = self.base_layer(x)
        for comp in self.components.values():
            c = comp.coefficient(self._magnitudes)
            y = y + c * F.linear(F.linear(x, comp.lora_down.to(x.dtype)), comp.lora_up.to(x.dtype))
        return y

    def _dense_dtype(self) -> torch.dtype:
        return torch.promote_types(self.base_layer.weight.dtype, torch.float32)

    def dense_delta(self) -> torch.Tensor:
        """``sum_k c_k U_k D_k`` (out, in) in fp32 (fp64 for fp64 weights) as one product of the stacked factors
        (differentiable)."""
        comps = list(self.components.values())
        dt = self._dense_dtype()
        ups = [comp.coefficient(self._magnitudes) * comp.lora_up.to(dt) for comp in comps]
        downs = [comp.lora_down.to(dt) for comp in comps]
        if len(comps) == 1:
            return ups[0] @ downs[0]
        return torch.cat(ups, dim=1) @ torch.cat(downs, dim=0)

    def forward_dense(self, x: torch.Tensor) -> torch.Tensor:
        """``(W_0 + sum_k c_k U_k D_k) x``: the components added to the weight, one matmul."""
        w = self.base_layer.weight
        weight = (w.to(self._dense_dtype()) + self.dense_delta()).to(x.dtype)
        bias = self.base_layer.bias
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))

    @torch.no_grad()
    def fold(self, name: str) -> None:
        """Add component ``name`` into the base weight (in fp32, cast back) and remove it."""
        w = self.base_layer.weight
        w.copy_((w.float() + self.delta_weight(name)).to(w.dtype))
        del self.components[name]

    def merged_weight(self) -> torch.Tensor:
        """Base weight plus every component (fp32): what a folded layer would hold."""
        w = self.base_layer.weight.float()
        for name in self.components:
            w = w + self.delta_weight(name)
        return w

    def get_structure(self) -> dict:
        return {"components": {n: c.spec() for n, c in self.components.items()}}

    def set_structure(self, structure: dict) -> None:
        self.components = nn.ModuleDict()
        for name, s in structure["components"].items():
            self.add_component(name, int(s["rank"]), init="zeros", scale=float(s["scale"]),
                               normalize=s["normalize"], magnitude=s["magnitude"])


# --------------------------------------------------------------------------------------------------------
# Names of attention projections across HF architectures (transformers 5.x ViT/CLIP, 4.x ViT, BERT).
TARGET_ALIASES: dict[str, list[str]] = {
    "query": ["q_proj", "query", "attention.attention.query"],
    "key": ["k_proj", "key", "attention.attention.key"],
    "value": ["v_proj", "value", "attention.attention.value"],
    "output": ["o_proj", "out_proj", "attention.output.dense"],
    "fc1": ["fc1", "intermediate.dense"],
    "fc2": ["fc2", "output.dense"],
}


def resolve_targets(targets: list[str]) -> list[str]:
    out: list[str] = []
    for t in targets:
        out.extend(TARGET_ALIASES.get(t, [t]))
    return out


def _matches(name: str, patterns: list[str]) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.fullmatch(p[3:], name):
                return True
        elif name == p or name.endswith("." + p):
            return True
    return False


def inject_lora(model: nn.Module, targets: list[str], *, magnitudes: nn.ParameterDict | None = None) -> list[str]:
    """Wrap every ``nn.Linear`` whose name matches ``targets`` in a :class:`LoRALinear`; return the names.

    ``targets`` are suffixes of module names (``"q_proj"``, aliases such as ``"query"`` work across
    architectures) or full-name regexes prefixed with ``re:``. Already wrapped layers are kept as they are.
    Raises ``ValueError`` listing candidate Linear names if nothing matches.
    """
    patterns = resolve_targets(targets)
    replaced: list[str] = []
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            if _matches(name, patterns):
                module.attach_magnitudes(magnitudes)
                replaced.append(name)
            continue
        if not isinstance(module, nn.Linear) or ".base_layer" in name or name.endswith("base_layer"):
            continue
        if _matches(name, patterns):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            wrapper = LoRALinear(module)
            wrapper.attach_magnitudes(magnitudes)
            setattr(parent, child, wrapper)
            replaced.append(name)
    if not replaced:
        linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        raise ValueError(f"LoRA targets {targets} matched no Linear layer; Linear layers include: {linear[:12]}")
    return replaced


def dense_is_cheaper(layer: LoRALinear, x: torch.Tensor) -> bool:
    """FLOP estimate (multiply-adds, elementwise ops weighted by ``_ELEMENTWISE_COST``) of one forward and,
    when grad mode is on, one backward of ``layer`` on ``x``: the dense form vs the low-rank paths.

    With T tokens, R = sum_k r_k over K components:
    lowrank: forward T R (in + out) + 2 T out K elementwise; backward T R (in + out) for the input gradient,
    T r_k (in + out) more per component with trainable factors, T out elementwise per component (plus T out
    per component whose coefficient needs a gradient);
    dense: out in R to form the delta (3x with backward); backward T in out for the weight gradient if any
    factor or coefficient needs one (the input gradient goes through the base matmul, which both forms share).
    """
    comps = list(layer.components.values())
    n_in, n_out = layer.in_features, layer.out_features
    tokens = x.numel() // max(1, n_in)
    ranks = [c.rank for c in comps]
    grad_on = torch.is_grad_enabled()
    mags = layer._magnitudes
    factor_grad = [grad_on and (c.lora_up.requires_grad or c.lora_down.requires_grad) for c in comps]
    coef_grad = [grad_on and c.magnitude is not None and mags is not None and c.magnitude in mags
                 and mags[c.magnitude].requires_grad for c in comps]
    e = _ELEMENTWISE_COST
    low = tokens * sum(ranks) * (n_in + n_out) + 2 * e * tokens * n_out * len(comps)
    dense = n_out * n_in * sum(ranks)
    if grad_on:
        low += tokens * sum(ranks) * (n_in + n_out) + e * tokens * n_out * len(comps)
        low += sum(tokens * r * (n_in + n_out) for r, g in zip(ranks, factor_grad) if g)
        low += sum(e * tokens * n_out for g in coef_grad if g)
        dense += 2 * n_out * n_in * sum(ranks)
        if any(factor_grad) or any(coef_grad):
            dense += tokens * n_in * n_out
    return dense < low


def set_lora_compute(model: nn.Module, mode: Compute) -> None:
    """Set :attr:`LoRALinear.compute` (``lowrank``, ``dense`` or ``auto``) on every LoRA layer of ``model``."""
    if mode not in COMPUTE_MODES:
        raise ValueError(f"unknown LoRA compute mode {mode!r} (expected one of {COMPUTE_MODES})")
    for layer in lora_layers(model).values():
        layer.compute = mode


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def add_lora_component(model: nn.Module, name: str, rank: int, *, generator: torch.Generator | None = None,
                       **kwargs) -> list[LoRAComponent]:
    """Add component ``name`` to every LoRA layer of ``model`` (in module order, one shared generator)."""
    return [layer.add_component(name, rank, generator=generator, **kwargs) for layer in lora_layers(model).values()]


def fold_component(model: nn.Module, name: str) -> None:
    """Fold component ``name`` into the base weights of every LoRA layer that has it."""
    for layer in lora_layers(model).values():
        if name in layer.components:
            layer.fold(name)
