"""``aper``: Zhou et al., "Revisiting Class-Incremental Learning with Pre-Trained Models: Generalizability and
Adaptivity are All You Need" (IJCV 2024; ADAM in its first version), APER.

First session: a parameter-efficient module (``variant``: AdaptFormer adapters, SSF, VPT-deep or VPT-shallow;
``adapters.bottleneck``) is trained with the linear head on task 1 only, then everything is frozen. Every
task: the prototype of class c is the mean over its training images of the concatenated feature
``[φ(x); φ*(x)]`` of the pretrained backbone φ and the adapted one φ* (dimension 2d; APER's
"aggregated embedding"), and a test image goes to the most cosine-similar prototype. The prototypes are the
engine's NCM head (``head.classifier: ncm``, ``head.ncm_metric: cosine``) on the features of the method's
inference model, so they are checkpointed and compared (``head.compare``) like SimpleCIL's; the pretrained
half of the feature is exactly SimpleCIL's.

PILOT (sun-hailong/LAMDA-PILOT, models/aper_*.py, exps/aper_*.json) trains the first session with SGD
(momentum 0.9), ``init_lr`` 0.01, ``tuned_epoch`` 20, cosine schedule, weight decay 5e-4, batch size 48: in this
library ``optim.name=sgd optim.lr=0.01 train.epochs=20 optim.schedule=cosine optim.weight_decay=5e-4
train.batch_size=48`` (the config's values are used; the method sets none of them). Differences from PILOT:
the first-session head is the library's linear head, not PILOT's cosine classifier with a learned scale; it
is discarded after the first task in both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from ..adapters.bottleneck import attach_adapters, attach_ssf, attach_vpt
from ..models.classifier import ContinualClassifier, IncrementalHead
from .base import ContinualMethod, MethodOptions, grid_rate, register_method
from .frozen_backbone import COSINE_PROTOTYPES, FrozenBackboneMethod

__all__ = ["APER", "APEROptions", "DualBranchFeatures"]


class APEROptions(MethodOptions):
    variant: Literal["adapter", "ssf", "vpt_deep", "vpt_shallow"] = Field(
        "adapter", description="first-session module: AdaptFormer adapter, SSF, VPT-deep or VPT-shallow (APER's "
        "four variants)")
    bottleneck: int = Field(64, ge=1, description="adapter: bottleneck width r (PILOT ffn_num 64 at ViT-B)")
    adapter_scale: float = Field(0.1, gt=0, description="adapter: output scale s (PILOT ffn_adapter_scalar 0.1)")
    adapter_dropout: float = Field(0.1, ge=0, lt=1, description="adapter: dropout in the bottleneck (PILOT 0.1)")
    prompt_tokens: int = Field(5, ge=1, description="vpt_*: prompt tokens per block (PILOT prompt_token_num 5)")


class DualBranchFeatures(nn.Module):
    """``[φ(x); φ*(x)]``: the backbone with its adapted module switched off, then on (dimension 2d)."""

    def __init__(self, backbone: nn.Module, switch: Callable[[bool], None]) -> None:
        super().__init__()
        self.backbone = backbone
        self.feature_dim = 2 * backbone.feature_dim
        self._switch = switch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            self._switch(False)
            pretrained = self.backbone(x)
        finally:
            self._switch(True)
        return torch.cat([pretrained, self.backbone(x)], dim=-1)


@register_method
class APER(FrozenBackboneMethod):
    name = "aper"
    description = ("APER / ADAM (Zhou et al., IJCV 2024): adapt on task 1 (adapter|ssf|vpt_deep|vpt_shallow), "
                   "freeze; cosine prototypes of [pretrained; adapted] features")
    head_defaults: ClassVar[dict[str, Any]] = COSINE_PROTOTYPES
    Options = APEROptions
    optim_defaults, optim_source = grid_rate(2e-2, "Adam; the paper's SGD rates do not carry over")

    def __init__(self, options, *, seed: int = 0) -> None:
        super().__init__(options, seed=seed)
        self._adapting = False
        self._tuned = None
        self._inference: ContinualClassifier | None = None

    def setup(self, model) -> None:
        super().setup(model)
        self._tuned = self._attach(model.backbone, torch.Generator().manual_seed(self.seed))
        self._tuned.requires_grad_(False)
        features = DualBranchFeatures(model.backbone, self._set_enabled)
        self._inference = ContinualClassifier(features, IncrementalHead(features.feature_dim))

    def _attach(self, backbone: nn.Module, generator: torch.Generator):
        o = self.options
        if o.variant == "adapter":
            return attach_adapters(backbone, bottleneck=o.bottleneck, scale=o.adapter_scale,
                                   dropout=o.adapter_dropout, name="aper", generator=generator)
        if o.variant == "ssf":
            return attach_ssf(backbone, generator=generator)
        return attach_vpt(backbone, n_tokens=o.prompt_tokens, deep=o.variant == "vpt_deep", generator=generator)

    def _set_enabled(self, flag: bool) -> None:
        self._tuned.enabled = flag

    def begin_task(self, task, ctx) -> None:
        super().begin_task(task, ctx)
        self._adapting = task.index == 0
        if self._adapting:
            self._tuned.requires_grad_(True)
            self.model.head.requires_grad_(True)

    def parameter_groups(self, model) -> list[dict]:
        return ContinualMethod.parameter_groups(self, model) if self._adapting else []

    def end_task(self, task, ctx) -> None:
        if self._adapting:
            self.model.requires_grad_(False)
            self._adapting = False

    def inference_model(self) -> nn.Module:
        return self._inference
