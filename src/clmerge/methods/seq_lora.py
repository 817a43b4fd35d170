"""``seq_lora``: plain sequential LoRA (the "LoRA" row of the P&M and SD-LoRA tables).

Each task adds a new rank-r LoRA component on the query and value projections of every block, trains it (and
the head) with the backbone frozen, and folds it into the base weights at the end of the task:
W <- W + (alpha_lora / r) * U_t D_t. Inference is the plain backbone.
"""

from __future__ import annotations

from pydantic import Field

from ..adapters import add_lora_component, fold_component, inject_lora, lora_layers
from .base import ContinualMethod, MethodOptions, grid_rate, register_method

__all__ = ["SeqLoRA", "SeqLoRAOptions", "LoRAMethodOptions"]


class LoRAMethodOptions(MethodOptions):
    """Options shared by LoRA-based methods."""

    rank: int = Field(10, ge=1, description="LoRA rank (r = 10 in SD-LoRA, InfLoRA and P&M)")
    targets: list[str] = Field(default_factory=lambda: ["query", "value"],
                               description="projections to adapt (aliases: query, key, value, output, fc1, fc2)")
    lora_alpha: float | None = Field(None, gt=0, description="LoRA scaling numerator: scale = lora_alpha / rank "
                                     "(None: scale 1, as the papers' code)")

    def scale(self) -> float:
        return 1.0 if self.lora_alpha is None else self.lora_alpha / self.rank


class SeqLoRAOptions(LoRAMethodOptions):
    fold: bool = Field(True, description="fold each task's LoRA into the base weights at task end")


@register_method
class SeqLoRA(ContinualMethod):
    name = "seq_lora"
    description = (f"sequential LoRA: a new LoRA on {'/'.join(SeqLoRAOptions().targets)} (method.targets) "
                   "per task, folded into the backbone after the task")
    Options = SeqLoRAOptions
    optim_defaults, optim_source = grid_rate(5e-3)

    def setup(self, model) -> None:
        super().setup(model)
        model.backbone.requires_grad_(False)
        inject_lora(model.backbone, self.options.targets, magnitudes=model.lora_magnitudes)

    def begin_task(self, task, ctx) -> None:
        super().begin_task(task, ctx)
        add_lora_component(self.model.backbone, f"task{task.index}", self.options.rank, generator=ctx.generator,
                           scale=self.options.scale())

    def end_task(self, task, ctx) -> None:
        name = f"task{task.index}"
        if self.options.fold:
            fold_component(self.model.backbone, name)
        else:  # keep it as a frozen component
            for layer in lora_layers(self.model.backbone).values():
                layer.components[name].requires_grad_(False)
