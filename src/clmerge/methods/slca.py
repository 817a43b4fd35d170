"""``slca``: Zhang et al., "SLCA: Slow Learner with Classifier Alignment for Continual Learning on a
Pre-trained Model" (ICCV 2023).

Slow learner: full fine-tuning of backbone and linear head, the backbone at ``backbone_lr_scale`` times the
head's learning rate (the official code for ViT-B/16: backbone 1e-4, head 1e-2 with SGD, a ratio of 0.01).
The body's parameter group carries ``lr_scale``, which the engine's optimizer applies to the head's lr.
Classifier alignment: ``head.align`` (the engine's head suite, docs/heads.md), on by default for this
method through ``head_defaults``; a ``head.*`` key the user sets still wins. As in the official code, the
aligned head is evaluated and then discarded (``fc.backup()`` before alignment, ``fc.recall()`` after the
evaluation): each task end aligns a fresh copy of the trained head (``head.align_keep: discard``, the head
suite's default; ``persistent`` keeps the aligned copy and aligns it again, as InfLoRA-CA does).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from .base import ContinualMethod, MethodOptions, grid_rate, register_method

__all__ = ["SLCA", "SLCAOptions"]


class SLCAOptions(MethodOptions):
    backbone_lr_scale: float = Field(0.01, gt=0, le=1, description="backbone lr as a fraction of the head's "
                                     "(SLCA official code: 1e-4 / 1e-2)")


@register_method
class SLCA(ContinualMethod):
    name = "slca"
    description = ("SLCA (Zhang et al.): full fine-tuning with a slow backbone lr, classifier alignment from "
                   "per-class feature Gaussians")
    Options = SLCAOptions
    head_defaults: ClassVar[dict[str, Any]] = {"align": True, "align_keep": "discard"}
    optim_defaults, optim_source = grid_rate(1e-3, "the head's rate; the backbone trains at backbone_lr_scale of it; "
                                                   "align_keep discard: validation CIL 37.50 at 1e-3 against 32.50, "
                                                   "36.00, 30.00 at 1e-4, 3e-4, 3e-3 (1e-4 under persistent)")

    def parameter_groups(self, model) -> list[dict]:
        groups = super().parameter_groups(model)
        return [g if g["name"] == "head" else {**g, "lr_scale": self.options.backbone_lr_scale}
                for g in groups]
