"""``lwf``: Learning without Forgetting (Li & Hoiem, ECCV 2016 / TPAMI 2017), class-incremental as in PyCIL.

After each task the model is frozen as the previous model. From the second task on the loss is

    L = CE(f(x)[new classes], y - known) + lamda * KD(f(x)[old classes], f_old(x); T)

with KD(p, q; T) = -sum_c softmax(q / T)_c log softmax(p / T)_c, summed over the old classes and averaged over
the batch (PyCIL ``models/lwf.py``: ``_KD_loss``, T = 2, lamda = 3). The new-class cross-entropy is
``head.loss: local`` (this method's head default); ``head.loss: seen`` gives a cross-entropy over every seen
class instead. The first task trains with the plain cross-entropy (docs/classic_baselines.md).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from pydantic import Field

from ..models.losses import classification_loss
from .base import ContinualMethod, MethodOptions, grid_rate, register_method

__all__ = ["LwF", "LwFOptions", "kd_loss", "frozen_copy"]


class LwFOptions(MethodOptions):
    temperature: float = Field(2.0, gt=0, description="distillation temperature T (PyCIL's and the paper's: 2)")
    lamda: float = Field(3.0, ge=0, description="distillation weight (PyCIL's models/lwf.py: 3; the paper's "
                                                "lambda_o: 1)")
    train_backbone: bool = Field(True, description="train every backbone parameter (false: head only)")


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """PyCIL's ``_KD_loss``: the cross-entropy of the softened teacher and student, summed over classes,
    averaged over the batch (no T^2 factor)."""
    log_p = torch.log_softmax(student.float() / temperature, dim=1)
    q = torch.softmax(teacher.float() / temperature, dim=1)
    return -(q * log_p).sum() / student.shape[0]


@register_method
class LwF(ContinualMethod):
    name = "lwf"
    description = "learning without forgetting: new-class cross-entropy plus distillation to the previous model"
    Options = LwFOptions
    head_defaults = {"loss": "local"}  # PyCIL: the cross-entropy covers the new classes only
    optim_defaults, optim_source = grid_rate(1e-4, "Adam, split_mnist5k seed 0: validation CIL 42.00 at "
                                                   "1e-4 against 38.50, 40.50, 27.00 at 3e-5, 3e-4, 1e-3")

    def __init__(self, options: LwFOptions, *, seed: int = 0) -> None:
        super().__init__(options, seed=seed)
        self.old = None  # the frozen model after the previous task

    def setup(self, model) -> None:
        model.backbone.requires_grad_(self.options.train_backbone)

    def loss(self, model, x, y, ctx) -> torch.Tensor:
        logits = model(x)
        loss = classification_loss(logits, y, ctx.task, ctx.head_loss)
        if self.old is None:  # the first task: the plain cross-entropy
            return loss
        with torch.no_grad():
            old = self.old(x)
        known = old.shape[1]
        return loss + self.options.lamda * kd_loss(logits[:, :known], old, self.options.temperature)

    def end_task(self, task, ctx) -> None:
        self.old = frozen_copy(self.model)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        if self.old is None:
            return {}
        return {f"old/{k}": v for k, v in self.old.state_dict().items()}

    def load_state(self, tensors, meta) -> None:
        super().load_state(tensors, meta)
        old = {k[len("old/"):]: v for k, v in tensors.items() if k.startswith("old/")}
        if old:  # saved after end_task: the model's structure then is the old model's
            self.old = frozen_copy(self.model)
            self.old.load_state_dict(old, strict=True)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with no gradients, in eval mode (PyCIL's ``copy().freeze()``)."""
    old = copy.deepcopy(model)
    old.requires_grad_(False)
    return old.eval()
