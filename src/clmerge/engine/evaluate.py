"""Evaluation of a model on a list of tasks: class-incremental and task-id-known accuracies in one pass."""

from __future__ import annotations

import torch
from torch import nn

from ..data.scenarios import Task

__all__ = ["evaluate_tasks", "TaskAccuracy"]


class TaskAccuracy(dict):
    """``{"acc": %, "til_acc": %, "n": test size, "loss": mean CE over the seen outputs}`` for one task."""


@torch.no_grad()
def evaluate_tasks(model: nn.Module, tasks: list[Task], *, n_outputs: int, batch_size: int = 500,
                   device: torch.device | str = "cpu", split: str = "test") -> list[TaskAccuracy]:
    """Accuracy (percent) of ``model`` on each task's ``split``.

    ``acc`` takes the argmax over the first ``n_outputs`` logits (all classes seen so far; no task id);
    ``til_acc`` takes it within the task's own range (task id known).
    """
    was_training = model.training
    model.eval()
    out = []
    for task in tasks:
        data = getattr(task, split)
        if data is None or len(data) == 0:
            raise ValueError(f"task {task.index} has no {split} data")
        lo, hi = task.class_range
        correct = correct_til = 0
        loss_sum = 0.0
        for x, y in data.batches(batch_size):
            x, y = x.to(device), y.to(device)
            logits = model(x)[:, :n_outputs]
            correct += int((logits.argmax(-1) == y).sum())
            correct_til += int((logits[:, lo:hi].argmax(-1) + lo == y).sum())
            loss_sum += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
        n = len(data)
        out.append(TaskAccuracy(acc=100.0 * correct / n, til_acc=100.0 * correct_til / n, n=n, loss=loss_sum / n))
    model.train(was_training)
    return out
