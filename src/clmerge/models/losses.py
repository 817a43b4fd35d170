"""Classification losses over an incremental head.

- ``local``: cross-entropy over the current task's logit range only, targets shifted into it (SD-LoRA's and
  InfLoRA's official code; old-class rows get no gradient);
- ``seen``: cross-entropy over every output up to the end of the current task's range.
In a domain-incremental scenario the range is the whole shared head, so both modes coincide.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

__all__ = ["classification_loss", "task_logits"]


class Task(Protocol):
    """What the losses read of a scenario's task (:class:`clmerge.data.scenarios.Task` has it): its
    ``[lo, hi)`` slice of the head's outputs. A protocol, since models sit below data in the layers."""

    @property
    def class_range(self) -> tuple[int, int]: ...


def task_logits(logits: torch.Tensor, task: Task) -> torch.Tensor:
    lo, hi = task.class_range
    return logits[:, lo:hi]


def classification_loss(logits: torch.Tensor, y: torch.Tensor, task: Task, mode: str = "local",
                        reduction: str = "mean") -> torch.Tensor:
    lo, hi = task.class_range
    if mode == "local":
        return F.cross_entropy(logits[:, lo:hi], y - lo, reduction=reduction)
    if mode == "seen":
        return F.cross_entropy(logits[:, :hi], y, reduction=reduction)
    raise ValueError(f"head.loss: unknown mode {mode!r} (expected 'local' or 'seen')")
