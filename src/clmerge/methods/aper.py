"""``aper`` and ``aper_finetune``: Zhou et al., "Revisiting Class-Incremental Learning with Pre-Trained
Models: Generalizability and Adaptivity are All You Need" (IJCV 2024; ADAM in its first version), APER.

First session: the backbone is adapted on task 1 only, then everything is frozen. ``aper`` attaches a
parameter-efficient module (``variant``: AdaptFormer adapters, SSF, VPT-deep or VPT-shallow;
``adapters.bottleneck``; PILOT models/aper_adapter.py, aper_ssf.py, aper_vpt.py); ``aper_finetune`` trains
the whole backbone (PILOT models/aper_finetune.py, on a copy, so the pretrained one stays). Every task: the
prototype of class c is the mean over its training images of the concatenated feature ``[φ(x); φ*(x)]`` of
the pretrained backbone φ and the adapted one φ* (dimension 2d; APER's "aggregated embedding", PILOT's
``MultiBranchCosineIncrementalNet``), and a test image goes to the most cosine-similar prototype. The
prototypes are the engine's NCM head (``head.classifier: ncm``, ``head.ncm_metric: cosine``) on the features
of the method's inference model, so they are checkpointed and compared (``head.compare``) like SimpleCIL's;
the pretrained half of the feature is exactly SimpleCIL's.

The first session trains with PILOT's cosine classifier with a learned scale (``adapt_head: cosine``,
``methods.first_session``); ``adapt_head: linear`` trains the model's linear head instead. Either is discarded
after the first task. PILOT (exps/aper_*.json) trains the first session with SGD (momentum 0.9), ``init_lr``
0.01, ``tuned_epoch`` 20 (6 for ``aper_finetune``), cosine schedule, weight decay 5e-4 (0.05 for
``aper_finetune``), batch size 48 (128): in this library ``optim.name=sgd optim.lr=0.01 train.epochs=20
optim.schedule=cosine optim.weight_decay=5e-4 train.batch_size=48``; the methods' own ``optim_defaults`` are
the Adam rates the validation grid selected.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from ..models.classifier import ContinualClassifier, IncrementalHead
from .base import MethodOptions, grid_rate, register_method
from .first_session import ADAPT_HEAD_DESCRIPTION, PETLOptions, attach_petl
from .frozen_backbone import COSINE_PROTOTYPES, FirstSessionMethod

__all__ = ["APER", "APERFinetune", "APERFinetuneOptions", "APEROptions", "DualBranchFeatures",
           "TwoBackboneFeatures"]


class APEROptions(PETLOptions):
    pass


class APERFinetuneOptions(MethodOptions):
    adapt_head: Literal["cosine", "linear"] = Field("cosine", description=ADAPT_HEAD_DESCRIPTION)


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


class TwoBackboneFeatures(nn.Module):
    """``[φ(x); φ*(x)]`` of two backbones: the pretrained copy and the fine-tuned one (dimension 2d)."""

    def __init__(self, pretrained: nn.Module, tuned: nn.Module) -> None:
        super().__init__()
        self.pretrained, self.tuned = pretrained, tuned
        self.feature_dim = pretrained.feature_dim + tuned.feature_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.pretrained(x), self.tuned(x)], dim=-1)


@register_method
class APER(FirstSessionMethod):
    name = "aper"
    description = ("APER / ADAM (Zhou et al., IJCV 2024): adapt on task 1 (adapter|ssf|vpt_deep|vpt_shallow) "
                   "with a cosine head, freeze; cosine prototypes of [pretrained; adapted] features")
    head_defaults: ClassVar[dict[str, Any]] = COSINE_PROTOTYPES
    Options = APEROptions
    optim_defaults, optim_source = grid_rate(1e-2, "Adam, the cosine first-session head (2e-2 with the former "
                                             "linear one); the paper's SGD rates do not carry over")

    def setup(self, model) -> None:
        super().setup(model)
        self._tuned = attach_petl(model.backbone, self.options, name="aper",
                                  generator=torch.Generator().manual_seed(self.seed))
        self._tuned.requires_grad_(False)
        features = DualBranchFeatures(model.backbone, self._set_enabled)
        self._inference = ContinualClassifier(features, IncrementalHead(features.feature_dim))

    def _set_enabled(self, flag: bool) -> None:
        self._tuned.enabled = flag

    def _start_first_session(self, task, ctx) -> None:
        self._tuned.requires_grad_(True)


@register_method
class APERFinetune(FirstSessionMethod):
    name = "aper_finetune"
    description = ("APER's full fine-tuning variant (PILOT aper_finetune): fine-tune the whole backbone on "
                   "task 1 with a cosine head, freeze; cosine prototypes of [pretrained; fine-tuned] "
                   "features")
    head_defaults: ClassVar[dict[str, Any]] = COSINE_PROTOTYPES
    Options = APERFinetuneOptions
    optim_defaults, optim_source = grid_rate(1e-3, "Adam, full fine-tuning of the first task")

    def setup(self, model) -> None:
        super().setup(model)
        self._pretrained = copy.deepcopy(model.backbone).requires_grad_(False)
        features = TwoBackboneFeatures(self._pretrained, model.backbone)
        self._inference = ContinualClassifier(features, IncrementalHead(features.feature_dim))

    def _start_first_session(self, task, ctx) -> None:
        self.model.backbone.requires_grad_(True)

    def inference_model(self) -> nn.Module:
        self._pretrained.to(next(self.model.parameters()).device)  # the model moves after setup
        return self._inference

    # the pretrained copy is part of the method's state: a resumed run does not rebuild it from the weights
    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"pretrained.{k}": v.detach().clone() for k, v in self._pretrained.state_dict().items()}

    def load_state(self, tensors, meta) -> None:
        super().load_state(tensors, meta)
        prefix = "pretrained."
        own = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        self._pretrained.load_state_dict(own, strict=True)
