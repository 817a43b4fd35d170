"""``finetune``: sequential full fine-tuning of the backbone (the lower bound of the LoRA papers' tables)."""

from __future__ import annotations

from pydantic import Field

from .base import ContinualMethod, MethodOptions, grid_rate, register_method

__all__ = ["Finetune", "FinetuneOptions"]


class FinetuneOptions(MethodOptions):
    train_backbone: bool = Field(True, description="train every backbone parameter (false: head only)")


@register_method
class Finetune(ContinualMethod):
    name = "finetune"
    description = "sequential full fine-tuning of backbone and head (no protection against forgetting)"
    Options = FinetuneOptions
    optim_defaults, optim_source = grid_rate(3e-4)

    def setup(self, model) -> None:
        super().setup(model)
        model.backbone.requires_grad_(self.options.train_backbone)
