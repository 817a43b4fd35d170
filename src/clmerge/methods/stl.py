"""``stl``: single-task learning, one independently initialised network per task (a baseline of HALRP, Sec. 5.1).

The backbone's inner network is replaced by :class:`PerTaskCopies`; task t trains copy t and head block t only,
so earlier tasks never change (BWT = 0 by construction). Evaluation routes each head block through its own
copy (:class:`TaskRoutedModel`). Memory grows by one full network per task.
"""

from __future__ import annotations

from pydantic import Field

from ..adapters.task_modules import PerTaskCopies, TaskRoutedModel, set_active_task
from .base import ContinualMethod, MethodOptions, grid_rate, register_method

__all__ = ["STL", "STLOptions"]


class STLOptions(MethodOptions):
    reinit: bool = Field(True, description="draw each task's network afresh (false: copy task 0's initial weights)")


@register_method
class STL(ContinualMethod):
    name = "stl"
    description = "single-task learning: a separate network (and head) per task"
    Options = STLOptions
    optim_defaults, optim_source = grid_rate(3e-4, "finetune's rate (each task fine-tunes a whole copy; not in the grid)")

    def setup(self, model) -> None:
        super().setup(model)
        model.backbone.inner = PerTaskCopies(model.backbone.inner)
        self._initial = {k: v.clone() for k, v in model.backbone.inner.copies[0].state_dict().items()}

    def begin_task(self, task, ctx) -> None:
        super().begin_task(task, ctx)
        t = task.index
        copies: PerTaskCopies = self.model.backbone.inner
        if len(self.model.head.blocks) != t + 1:
            raise ValueError("stl needs one head block per task (scenario.kind: task_incremental)")
        while len(copies.copies) <= t:
            new = copies.add_task(reinit=self.options.reinit)
            if not self.options.reinit:
                new.load_state_dict(self._initial)
            new.to(ctx.device)
        self.model.requires_grad_(False)
        copies.copies[t].requires_grad_(True)
        self.model.head.blocks[t].requires_grad_(True)
        set_active_task(self.model, t)

    def end_task(self, task, ctx) -> None:
        n = sum(p.numel() for p in self.model.backbone.inner.copies[task.index].parameters())
        n += sum(p.numel() for p in self.model.head.blocks[task.index].parameters())
        self.record("bytes_per_task", 4 * n)

    def inference_model(self):
        return TaskRoutedModel(self.model)
