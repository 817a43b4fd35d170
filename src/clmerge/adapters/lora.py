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
  ``||U||_F ||D||_F`` (SD-LoRA official code, spec 002 section 2.10 row 1).

:meth:`LoRAComponent.coefficient` is the only place the formula lives; ``forward``, ``delta_weight`` and
folding all use it.
"""

from __future__ import annotations

import math
import re
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LoRAComponent",
    "LoRALinear",
    "inject_lora",
    "lora_layers",
    "add_lora_component",
    "fold_component",
    "TARGET_ALIASES",
    "resolve_targets",
]

Normalize = Literal["none", "fro", "factor"]


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
        y = self.base_layer(x)
        for comp in self.components.values():
            c = comp.coefficient(self._magnitudes)
            y = y + c * F.linear(F.linear(x, comp.lora_down.to(x.dtype)), comp.lora_up.to(x.dtype))
        return y

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
