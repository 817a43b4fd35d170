"""``ewc`` and ``l2``: full fine-tuning with a quadratic penalty towards earlier solutions.

- EWC (Kirkpatrick et al. 2017), online form: after task t, F <- gamma * F + F_t (diagonal empirical Fisher of
  the task's training data at the trained weights) and theta* <- theta_t; the loss adds
  (lambda / 2) * sum_i F_i (theta_i - theta*_i)^2.
- L2: the same penalty with F = 1, i.e. (lambda / 2) * ||theta - theta_{t-1}||^2.
Both regularise the trainable backbone parameters (the head is task-specific and left free).
"""

from __future__ import annotations

import torch
from pydantic import Field

from ..models.losses import task_logits
from ..params import diagonal_fisher
from .base import ContinualMethod, MethodOptions, grid_rate, register_method
from ..utils.progress import phase

__all__ = ["EWC", "L2", "EWCOptions", "L2Options"]


class L2Options(MethodOptions):
    reg_lambda: float = Field(1.0, ge=0, description="penalty weight lambda")


class EWCOptions(MethodOptions):
    reg_lambda: float = Field(100.0, ge=0, description="penalty weight lambda")
    gamma: float = Field(1.0, ge=0, le=1, description="online-EWC decay of the accumulated Fisher (1: plain sum)")
    fisher_samples: int | None = Field(512, ge=1, description="training samples for the Fisher (None: all)")
    fisher_batch: int = Field(32, ge=1, description="batch size of the vectorised per-sample gradients")


class _Anchored(ContinualMethod):
    """Shared machinery: anchor values and per-parameter weights, penalty, checkpointed state."""

    def setup(self, model) -> None:
        super().setup(model)
        model.backbone.requires_grad_(True)
        self.names = [f"backbone.{n}" for n, p in model.backbone.named_parameters() if p.requires_grad]
        self.anchor: dict[str, torch.Tensor] = {}
        self.weight: dict[str, torch.Tensor] = {}

    def loss(self, model, x, y, ctx) -> torch.Tensor:
        base = super().loss(model, x, y, ctx)
        if not self.anchor:
            return base
        params = dict(model.named_parameters())
        pen = sum((self.weight.get(n, 1.0) * (params[n] - self.anchor[n]).pow(2)).sum() for n in self.names)
        return base + 0.5 * self.options.reg_lambda * pen

    def _set_anchor(self) -> None:
        params = dict(self.model.named_parameters())
        self.anchor = {n: params[n].detach().clone() for n in self.names}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"anchor/{n}": v for n, v in self.anchor.items()}
        out.update({f"weight/{n}": v for n, v in self.weight.items()})
        return out

    def load_state(self, tensors, meta) -> None:
        super().load_state(tensors, meta)
        self.anchor = {k[len("anchor/"):]: v for k, v in tensors.items() if k.startswith("anchor/")}
        self.weight = {k[len("weight/"):]: v for k, v in tensors.items() if k.startswith("weight/")}


@register_method
class L2(_Anchored):
    name = "l2"
    description = "full fine-tuning with an L2 penalty towards the previous task's weights"
    Options = L2Options
    optim_defaults, optim_source = grid_rate(3e-4, "finetune's rate (l2 is finetune plus a penalty; not in the grid)")

    def end_task(self, task, ctx) -> None:
        self._set_anchor()


@register_method
class EWC(_Anchored):
    name = "ewc"
    description = "elastic weight consolidation: diagonal-Fisher-weighted penalty (online form)"
    Options = EWCOptions
    optim_defaults, optim_source = grid_rate(3e-4)

    def end_task(self, task, ctx) -> None:
        o = self.options
        batches = task.train.batches(o.fisher_batch, shuffle=True, generator=ctx.generator)
        lo = task.offset
        batches = phase(((x.to(ctx.device), y.to(ctx.device) - lo) for x, y in batches),
                        f"ewc: Fisher of task {task.index + 1}", total=task.train.num_batches(o.fisher_batch))
        fisher = diagonal_fisher(self.model, self.names, batches, max_samples=o.fisher_samples,
                                 logits_fn=lambda m, x: task_logits(m(x), task))
        for n, f in fisher.items():
            self.weight[n] = f if n not in self.weight else o.gamma * self.weight[n] + f
        self._set_anchor()
        self.record("fisher_mean", float(torch.stack([f.mean() for f in fisher.values()]).mean()))
