"""Bottleneck adapters (AdaptFormer), scale-and-shift (SSF) and VPT prompts for frozen transformer backbones.

- :class:`BottleneckAdapter`: AdaptFormer's parallel MLP adapter (Chen et al., NeurIPS 2022, Eq. 3-4):
  ``a(x) = s · W_up ReLU(W_down x)``, ``W_down`` (d -> r), ``W_up`` (r -> d); the block's MLP output becomes
  ``mlp(LN(x)) + a(x)`` where x is the block's input to its MLP branch before the LayerNorm (PILOT's
  ``ffn_option='parallel'``, ``ffn_adapter_layernorm_option='none'``, backbone/vit_adapter.py). Initialised as
  PILOT's ``init_option='lora'``: ``W_down`` Kaiming-uniform (a=√5), ``W_up`` and both biases zero, so an
  untrained adapter adds exactly 0. PILOT's defaults: ``scale`` 0.1, ``bottleneck`` 64 (ViT-B), dropout 0.1 on
  the bottleneck activations while training.
- :func:`attach_adapters`: one adapter per transformer block, by forward hooks (no module is replaced). The
  adapters live in ``backbone.bottleneck_adapters`` (an :class:`AdapterBank`), so they are in the model's
  state dict, move with ``.to()`` and are rebuilt on resume (``get_structure``/``set_structure``). Several
  named sets can exist at once (EASE and MOS keep one per task); each is switched on and off; the MLP output
  gets the sum of the enabled sets' outputs, and with none enabled the block runs exactly as pretrained.
- :class:`SSF`: Scaling and Shifting of Features (Lian et al., NeurIPS 2022, Eq. 3): ``y = γ ⊙ x + β`` per
  feature after chosen modules (PILOT's vit_ssf.py puts one after qkv, proj, fc1, fc2, the norms and the patch
  embedding); :func:`attach_ssf` adds one after every ``nn.Linear``, ``nn.LayerNorm`` and ``nn.Conv2d`` of the
  transformer (per output channel for a convolution).
- :class:`VPTPrompts`: Visual Prompt Tuning (Jia et al., ECCV 2022). Shallow: ``n`` learned tokens join the
  sequence after the embeddings (the prompt-token path of :mod:`.prompt`). Deep: a new set of ``n`` tokens at
  the input of every block, whose outputs the next block discards. A token that is replaced before the next
  block only acts through the keys and values it adds to the block's attention, so deep VPT equals a key/value
  prefix per block computed as ``(W_k LN(P_l) + b_k, W_v LN(P_l) + b_v)`` with the block's own frozen
  LayerNorm and projections; that is how it is run here (the prefix path of :mod:`.prompt`), with the
  first block's prompts entering as tokens, as in VPT.

Backbones: HF ``ViTModel`` (the shipped ``vit-tiny-fmnist``, ``vit-b16``, ``hf-vit``), ``CLIPVisionModel``,
and BERT-style text encoders (MiniLM) for the adapters and SSF; VPT needs a vision backbone (:mod:`.prompt`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .prompt import PromptInput, PromptMechanism

__all__ = ["BottleneckAdapter", "AdapterBank", "AdapterSet", "adapter_bank", "attach_adapters",
           "adapter_sets", "only_adapters", "SSF", "SSFBank", "attach_ssf", "VPTPrompts", "attach_vpt"]

BANK = "bottleneck_adapters"


class BottleneckAdapter(nn.Module):
    """``x -> scale · up(dropout(ReLU(down(x))))`` (AdaptFormer; PILOT's ``Adapter`` with no LayerNorm).

    Args:
        dim: the block's hidden size d.
        bottleneck: r, the width of the bottleneck (PILOT ``ffn_num`` 64 at ViT-B).
        scale: s, a fixed float (PILOT ``ffn_adapter_scalar`` 0.1).
        dropout: dropout on the bottleneck activations while training (PILOT 0.1).
        generator: RNG of ``W_down``'s initialisation.
    """

    def __init__(self, dim: int, bottleneck: int, *, scale: float = 0.1, dropout: float = 0.1,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        if bottleneck < 1:
            raise ValueError(f"adapter bottleneck must be >= 1, got {bottleneck}")
        self.scale, self.dropout = float(scale), float(dropout)
        self.down = nn.Linear(dim, bottleneck)
        self.up = nn.Linear(bottleneck, dim)
        with torch.no_grad():
            bound = math.sqrt(6.0 / ((1 + 5.0) * dim))  # kaiming_uniform_(a=sqrt(5)) on (r, d)
            self.down.weight.uniform_(-bound, bound, generator=generator)
            for t in (self.down.bias, self.up.weight, self.up.bias):
                t.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.relu(self.down(x)), p=self.dropout, training=self.training)
        return self.up(h) * self.scale


@dataclass
class _Block:
    """Where block i's MLP-branch input is read (``capture``) and where the adapter output is added."""

    capture: nn.Module  # a forward pre-hook reads its first argument: the MLP branch's input x
    add: nn.Module
    add_to: str  # "output": added to ``add``'s output; "input": added to ``add``'s first argument


def _blocks(inner: nn.Module) -> list[_Block]:
    name = type(inner).__name__
    if name == "ViTModel":  # x + dropout(mlp(layernorm_after(x)))
        return [_Block(b.layernorm_after, b.mlp, "output") for b in inner.layers]
    if name == "CLIPVisionModel":  # x + mlp(layer_norm2(x))
        return [_Block(b.layer_norm2, b.mlp, "output") for b in inner.encoder.layers]
    if hasattr(inner, "encoder") and hasattr(inner.encoder, "layer"):  # BERT: LN(x + out.dense(inter(x)))
        return [_Block(b.intermediate, b.output.LayerNorm, "input") for b in inner.encoder.layer]
    raise ValueError(f"model.name: adapters need a transformer backbone (an HF ViT, CLIP vision tower or BERT-style "
                     f"text encoder), not {name!r}; e.g. model.name=vit-tiny-fmnist")


class AdapterBank(nn.Module):
    """Every named adapter set of one backbone (``sets[name][str(layer)]``) and the hooks that apply them."""

    def __init__(self, blocks: list[_Block]) -> None:
        super().__init__()
        self.sets = nn.ModuleDict()
        self.enabled: dict[str, bool] = {}
        self._blocks = blocks  # a plain list: the blocks belong to the backbone, not to the bank
        self._x: dict[int, torch.Tensor] = {}
        self._handles = []
        for i, blk in enumerate(blocks):
            self._handles.append(blk.capture.register_forward_pre_hook(self._capturer(i)))
            hook = self._output_adder(i) if blk.add_to == "output" else self._input_adder(i)
            register = blk.add.register_forward_hook if blk.add_to == "output" else blk.add.register_forward_pre_hook
            self._handles.append(register(hook))

    @property
    def num_layers(self) -> int:
        return len(self._blocks)

    def _delta(self, i: int) -> torch.Tensor | None:
        x = self._x.pop(i, None)
        active = [s[str(i)] for n, s in self.sets.items() if self.enabled[n] and str(i) in s]
        if x is None or not active:
            return None
        out = active[0](x)
        for a in active[1:]:
            out = out + a(x)
        return out

    def _capturer(self, i: int):
        def hook(module, args):
            self._x[i] = args[0]
        return hook

    def _output_adder(self, i: int):
        def hook(module, args, output):
            delta = self._delta(i)
            return None if delta is None else output + delta.to(output.dtype)
        return hook

    def _input_adder(self, i: int):
        def hook(module, args):
            delta = self._delta(i)
            return None if delta is None else (args[0] + delta.to(args[0].dtype), *args[1:])
        return hook

    def add_set(self, name: str, *, dim: int, bottleneck: int, scale: float, dropout: float,
                layers: list[int], generator: torch.Generator | None = None) -> None:
        if name in self.sets:
            raise ValueError(f"adapters: a set named {name!r} already exists")
        bad = [i for i in layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"adapters: layer(s) {bad} do not exist (the backbone has {self.num_layers} layers)")
        device = next(iter(self._blocks[0].add.parameters()), torch.empty(0)).device
        self.sets[name] = nn.ModuleDict({str(i): BottleneckAdapter(dim, bottleneck, scale=scale, dropout=dropout,
                                                                   generator=generator) for i in layers}).to(device)
        self.sets[name].train(self.training)  # a set added to an eval-mode backbone starts in eval mode
        self.enabled[name] = True

    def get_structure(self) -> dict:
        out = {}
        for name, s in self.sets.items():
            first = next(iter(s.values()))
            out[name] = {"layers": [int(k) for k in s], "dim": first.up.out_features, "enabled": self.enabled[name],
                         "bottleneck": first.down.out_features, "scale": first.scale, "dropout": first.dropout}
        return {"sets": out}

    def set_structure(self, structure: dict) -> None:
        for name, st in structure["sets"].items():
            if name not in self.sets:
                self.add_set(name, dim=st["dim"], bottleneck=st["bottleneck"], scale=st["scale"],
                             dropout=st["dropout"], layers=list(st["layers"]))
            self.enabled[name] = bool(st["enabled"])

    def remove(self) -> None:
        """Detach the hooks (the adapters stay as modules, inert)."""
        for h in self._handles:
            h.remove()
        self._handles = []


class AdapterSet:
    """A view of one named set of a backbone's :class:`AdapterBank`."""

    def __init__(self, bank: AdapterBank, name: str) -> None:
        self.bank, self.name = bank, name

    @property
    def layers(self) -> list[int]:
        return [int(k) for k in self.bank.sets[self.name]]

    def modules(self) -> list[BottleneckAdapter]:
        """The adapters, one per layer, in layer order."""
        return list(self.bank.sets[self.name].values())

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.bank.sets[self.name].parameters()

    @property
    def enabled(self) -> bool:
        return self.bank.enabled[self.name]

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self.bank.enabled[self.name] = bool(value)

    def requires_grad_(self, flag: bool = True) -> "AdapterSet":
        self.bank.sets[self.name].requires_grad_(flag)
        return self


def adapter_bank(backbone: nn.Module) -> AdapterBank:
    """The backbone's adapter bank, created (empty, hooks attached) on first use.

    A method that adds sets during a run calls this in ``setup`` so that a resumed run finds the bank to
    rebuild its sets into.
    """
    bank = getattr(backbone, BANK, None)
    if bank is None:
        bank = AdapterBank(_blocks(backbone.inner)).train(backbone.training)
        backbone.add_module(BANK, bank)
    return bank


def _hidden_size(backbone: nn.Module) -> int:
    return int(backbone.inner.config.hidden_size)


def attach_adapters(backbone: nn.Module, *, bottleneck: int, scale: float = 0.1, layers: Iterable[int] | None = None,
                    name: str = "default", dropout: float = 0.1,
                    generator: torch.Generator | None = None) -> AdapterSet:
    """Add a named set of :class:`BottleneckAdapter` in parallel to the MLP of the blocks ``layers`` (all by
    default) of ``backbone`` (a VisionBackbone or TextBackbone over an HF transformer); it starts enabled."""
    bank = adapter_bank(backbone)
    layers = list(range(bank.num_layers)) if layers is None else sorted(set(layers))
    bank.add_set(name, dim=_hidden_size(backbone), bottleneck=bottleneck, scale=scale, dropout=dropout,
                 layers=layers, generator=generator)
    return AdapterSet(bank, name)


def adapter_sets(backbone: nn.Module) -> dict[str, AdapterSet]:
    """The backbone's adapter sets by name, in the order they were added (empty without a bank)."""
    bank = getattr(backbone, BANK, None)
    return {} if bank is None else {n: AdapterSet(bank, n) for n in bank.sets}


@contextlib.contextmanager
def only_adapters(backbone: nn.Module, names: Iterable[str]) -> Iterator[None]:
    """Forward passes inside use only the named sets (none: the pretrained backbone); the flags are restored."""
    bank = adapter_bank(backbone)
    keep, names = dict(bank.enabled), set(names)
    unknown = names - set(bank.sets)
    if unknown:
        raise ValueError(f"adapters: no set named {sorted(unknown)} (have {list(bank.sets)})")
    bank.enabled = {n: n in names for n in bank.sets}
    try:
        yield
    finally:
        bank.enabled = keep


# -- SSF -------------------------------------------------------------------------------------------------------
class SSF(nn.Module):
    """``y = γ ⊙ x + β`` over the feature axis ``dim`` (SSF Eq. 3). PILOT initialises γ ~ N(1, 0.02²) and
    β ~ N(0, 0.02²) (``init_ssf_scale_shift``); ``std=0`` gives the identity."""

    def __init__(self, features: int, *, dim: int = -1, std: float = 0.02,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.dim = dim
        self.scale = nn.Parameter(torch.ones(features))
        self.shift = nn.Parameter(torch.zeros(features))
        if std > 0:
            with torch.no_grad():
                self.scale.normal_(1.0, std, generator=generator)
                self.shift.normal_(0.0, std, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = [1] * x.dim()
        shape[self.dim] = -1
        return x * self.scale.view(shape).to(x.dtype) + self.shift.view(shape).to(x.dtype)


def _ssf_targets(inner: nn.Module) -> list[tuple[str, nn.Module, int, int]]:
    """(name, module, features, axis) of every Linear, LayerNorm and Conv2d of the transformer."""
    out = []
    for name, m in inner.named_modules():
        if isinstance(m, nn.Linear):
            out.append((name, m, m.out_features, -1))
        elif isinstance(m, nn.LayerNorm):
            out.append((name, m, m.normalized_shape[-1], -1))
        elif isinstance(m, nn.Conv2d):
            out.append((name, m, m.out_channels, 1))
    return out


class SSFBank(nn.Module):
    """The SSF modules of a backbone (``ssf[name]``, module path dots as ``__``) and their forward hooks."""

    def __init__(self, inner: nn.Module, *, std: float, generator: torch.Generator | None) -> None:
        super().__init__()
        self.ssf = nn.ModuleDict()
        self.enabled = True
        self._handles = []
        for name, m, n, axis in _ssf_targets(inner):
            key = name.replace(".", "__")
            self.ssf[key] = SSF(n, dim=axis, std=std, generator=generator)
            self._handles.append(m.register_forward_hook(self._hook(key)))

    def _hook(self, key: str):
        def hook(module, args, output):
            return self.ssf[key](output) if self.enabled else None
        return hook


def attach_ssf(backbone: nn.Module, *, std: float = 0.02, generator: torch.Generator | None = None) -> SSFBank:
    """SSF after every Linear, LayerNorm and Conv2d of ``backbone.inner`` (kept as ``backbone.ssf``)."""
    if hasattr(backbone, "ssf"):
        raise ValueError("ssf: the backbone already has SSF modules")
    bank = SSFBank(backbone.inner, std=std, generator=generator).train(backbone.training)
    backbone.add_module("ssf", bank)
    return bank


# -- VPT ---------------------------------------------------------------------------------------------------------
class VPTPrompts(nn.Module):
    """VPT prompts for a ViT backbone, run through a :class:`~.prompt.PromptMechanism` (see the module notes).

    Args:
        backbone: a VisionBackbone over an HF ``ViTModel``.
        n_tokens: prompt tokens per block (PILOT ``prompt_token_num`` 5).
        deep: one set per block as key/value prefixes (VPT-deep) or one set of input tokens (VPT-shallow).
        generator: RNG of the initialisation, uniform in ±√(6 / (c·patch² + d)) (VPT's Xavier-style init).
    """

    def __init__(self, backbone: nn.Module, *, n_tokens: int = 5, deep: bool = True,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        inner = backbone.inner
        if type(inner).__name__ != "ViTModel":
            raise ValueError(f"model.name: VPT prompts need an HF ViT backbone (vit-tiny-fmnist, vit-b16, hf-vit), "
                             f"not {type(inner).__name__!r}")
        cfg = inner.config
        self.deep = deep
        n_sets = len(inner.layers) if deep else 1
        bound = math.sqrt(6.0 / (cfg.num_channels * cfg.patch_size ** 2 + cfg.hidden_size))
        self.prompts = nn.Parameter(torch.empty(n_sets, n_tokens, cfg.hidden_size))
        with torch.no_grad():
            self.prompts.uniform_(-bound, bound, generator=generator)
        self.enabled = True
        self._layers = list(inner.layers)  # a plain list: the blocks belong to the backbone
        mechanism = PromptMechanism(backbone, prefix_layers=range(n_sets) if deep else ())
        mechanism.provider = lambda x: self.prompt_input(len(x))
        object.__setattr__(self, "mechanism", mechanism)

    def _prefix(self, layer: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``layer``'s keys and values of its prompts: ``W_k LN(P_l) + b_k``, ``W_v LN(P_l) + b_v``."""
        blk = self._layers[layer]
        p = blk.layernorm_before(self.prompts[layer])  # (n, d)
        k, v = blk.attention.k_proj(p), blk.attention.v_proj(p)
        return k.expand(batch, -1, -1), v.expand(batch, -1, -1)

    def prompt_input(self, batch: int) -> PromptInput:
        if not self.enabled:
            return PromptInput()
        if self.deep:
            return PromptInput(prefixes={i: self._prefix(i, batch) for i in range(len(self.prompts))})
        return PromptInput(tokens=self.prompts[0].expand(batch, -1, -1))


def attach_vpt(backbone: nn.Module, *, n_tokens: int = 5, deep: bool = True,
               generator: torch.Generator | None = None) -> VPTPrompts:
    """VPT prompts for ``backbone`` (kept as ``backbone.vpt``, so they are in the model's state dict)."""
    if hasattr(backbone, "vpt"):
        raise ValueError("vpt: the backbone already has prompts")
    vpt = VPTPrompts(backbone, n_tokens=n_tokens, deep=deep, generator=generator)
    backbone.add_module("vpt", vpt)
    return vpt
