"""First-session adaptation, shared by ``aper``, ``aper_finetune`` and ``ranpac``.

The backbone (a parameter-efficient module attached to it, or all of it) is trained on the first task only,
with a classifier that exists for that training alone and is discarded when the task ends; afterwards the
backbone is frozen and a feature head predicts. LAMDA-PILOT (models/aper_adapter.py, aper_ssf.py, aper_vpt.py,
aper_finetune.py, ranpac.py at 2647455) trains the first session through ``SimpleVitNet``, whose ``fc`` is
``CosineLinear`` (utils/inc_net.py, ``SimpleVitNet.generate_fc``): logits ``σ · cos(f, w_c)`` with a learned
scale σ (backbone/linears.py, ``CosineLinear``: σ starts at 1, ``w`` uniform in ±1/√d). That is
``adapt_head: cosine``, the default; ``adapt_head: linear`` trains the model's linear head instead (what
clmerge did before).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from ..adapters.bottleneck import attach_adapters, attach_ssf, attach_vpt
from .base import MethodOptions

__all__ = ["CosineClassifier", "FirstSessionHead", "PETLOptions", "attach_petl"]

ADAPT_HEAD_DESCRIPTION = (
    "the classifier trained with the first session, discarded after it: cosine (PILOT's CosineLinear, "
    "sigma * cos(f, w_c) with a learned scale sigma; the official code) or linear (the model's linear head)")


class CosineClassifier(nn.Module):
    """``σ · cos(f, w_c)`` with a learned scale σ (PILOT backbone/linears.py ``CosineLinear``, sigma=True).

    Initialised as PILOT's ``reset_parameters``: ``w`` uniform in ``[-1/√d, 1/√d]``, σ = 1.
    """

    def __init__(self, in_dim: int, n_classes: int, *, generator: torch.Generator) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(in_dim)
        self.weight = nn.Parameter((torch.rand(n_classes, in_dim, generator=generator) * 2 - 1) * bound)
        self.sigma = nn.Parameter(torch.ones(1))

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        cos = F.linear(F.normalize(feats, p=2, dim=-1), F.normalize(self.weight, p=2, dim=-1))
        return self.sigma * cos


class FirstSessionHead:
    """The first-session classifier of a method: PILOT's cosine head, or the model's linear head.

    ``start`` builds it for the first task (a private generator: the run's RNG streams are untouched),
    ``groups`` are the optimizer groups of that session, ``loss`` the cross-entropy of its logits, ``stop``
    discards it. It lives for one task, between checkpoints (they are written at task ends), so it is never
    part of a checkpoint.
    """

    def __init__(self, kind: str, seed: int) -> None:
        if kind not in ("cosine", "linear"):
            raise ValueError(f"adapt_head: unknown {kind!r} (cosine, linear)")
        self.kind, self.seed = kind, seed
        self.cosine: CosineClassifier | None = None

    def start(self, model, task, feature_dim: int) -> None:
        if self.kind == "linear":
            model.head.requires_grad_(True)
            return
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + 7)
        device = next(model.parameters()).device
        self.cosine = CosineClassifier(feature_dim, task.offset + task.n_classes, generator=gen).to(device)

    def groups(self, body: list[nn.Parameter], model) -> list[dict]:
        head = list(model.head.parameters()) if self.kind == "linear" else list(self.cosine.parameters())
        groups = ({"params": body, "name": "body"}, {"params": head, "name": "head"})
        return [g for g in groups if g["params"]]

    def loss(self, model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Cross-entropy over the first task's classes (PILOT: ``F.cross_entropy`` of the fc's logits)."""
        return F.cross_entropy(self.cosine(model.forward_features(x)), y)

    def stop(self) -> None:
        self.cosine = None


class PETLOptions(MethodOptions):
    """The first-session module of APER and RanPAC (PILOT ``backbone_type`` *_adapter, *_ssf, *_vpt)."""

    variant: Literal["adapter", "ssf", "vpt_deep", "vpt_shallow"] = Field(
        "adapter", description="first-session module: AdaptFormer adapter, SSF, VPT-deep or VPT-shallow "
        "(APER's four variants; RanPAC's Phase 1 uses the same, PILOT exps/ranpac.json: adapter)")
    bottleneck: int = Field(64, ge=1, description="adapter: bottleneck width r (PILOT ffn_num 64 at ViT-B)")
    adapter_scale: float = Field(0.1, gt=0, description="adapter: output scale s (PILOT ffn_adapter_scalar "
                                 "0.1)")
    adapter_dropout: float = Field(0.1, ge=0, lt=1, description="adapter: dropout in the bottleneck (PILOT "
                                   "0.1)")
    prompt_tokens: int = Field(5, ge=1, description="vpt_*: prompt tokens per block (PILOT prompt_token_num "
                               "5)")
    adapt_head: Literal["cosine", "linear"] = Field("cosine", description=ADAPT_HEAD_DESCRIPTION)


def attach_petl(backbone: nn.Module, options: PETLOptions, *, name: str, generator: torch.Generator):
    """Attach the options' first-session module to ``backbone``; returns it (``.enabled`` switches it)."""
    o = options
    if o.variant == "adapter":
        return attach_adapters(backbone, bottleneck=o.bottleneck, scale=o.adapter_scale,
                               dropout=o.adapter_dropout, name=name, generator=generator)
    if o.variant == "ssf":
        return attach_ssf(backbone, generator=generator)
    return attach_vpt(backbone, n_tokens=o.prompt_tokens, deep=o.variant == "vpt_deep", generator=generator)
