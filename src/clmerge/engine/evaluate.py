"""Evaluation of a model on a list of tasks: class-incremental and task-id-known accuracies in one pass."""

from __future__ import annotations

import torch
from torch import nn

from ..data.scenarios import Task
from ..utils.progress import phase

__all__ = ["evaluate_tasks", "eval_batches", "TaskAccuracy"]


class TaskAccuracy(dict):
    """``{"acc": %, "til_acc": %, "n": test size, "loss": mean CE over the seen outputs}`` for one task
    (``acc`` and ``loss`` are None when only ``til_acc`` was asked for)."""


def eval_batches(tasks: list[Task], split: str, batch_size: int) -> int | None:
    """How many batches an evaluation of ``tasks``' ``split`` reads (its progress total; None where a split
    cannot say, e.g. a stand-in data object without ``num_batches``)."""
    total = 0
    for t in tasks:
        data = getattr(t, split, None)
        if data is None:
            continue
        count = getattr(data, "num_batches", None)
        if count is None:
            return None
        total += count(batch_size)
    return total


def _routed(model: nn.Module, task: Task, n_outputs: int) -> bool:
    """Whether ``model`` can give task ``task``'s own logits alone (``task_logits``, e.g. TaskRoutedModel)."""
    if not (hasattr(model, "task_logits") and hasattr(model, "task_range")):
        return False
    lo, hi = task.class_range
    rng = model.task_range(task.index)
    return rng is not None and tuple(rng) == (lo, hi) and hi <= n_outputs


@torch.no_grad()
def evaluate_tasks(model: nn.Module, tasks: list[Task], *, n_outputs: int, batch_size: int = 500,
                   device: torch.device | str = "cpu", split: str = "test",
                   til_only: bool = False) -> list[TaskAccuracy]:
    """Accuracy (percent) of ``model`` on each task's ``split``.

    ``acc`` takes the argmax over the first ``n_outputs`` logits (all classes seen so far; no task id);
    ``til_acc`` takes it within the task's own range (task id known).

    With ``til_only`` only ``til_acc`` is computed (``acc`` and ``loss`` are None). A model with
    ``task_logits(x, t)`` / ``task_range(t)`` (:class:`~clmerge.adapters.task_modules.TaskRoutedModel`) is then
    asked for task t's own logits only, one routed backbone pass per batch instead of one per task; they are the
    same numbers as the ``[lo, hi)`` slice of its full output, so ``til_acc`` does not change.
    """
    was_training = model.training
    model.eval()
    out = []
    bar = phase(desc=f"evaluation ({split})", total=eval_batches(tasks, split, batch_size))
    for task in tasks:
        data = getattr(task, split)
        if data is None or len(data) == 0:
            raise ValueError(f"task {task.index} has no {split} data")
        lo, hi = task.class_range
        routed = til_only and _routed(model, task, n_outputs)
        correct = correct_til = 0
        loss_sum = 0.0
        for x, y in bar.track(data.batches(batch_size)):
            x, y = x.to(device), y.to(device)
            if routed:
                correct_til += int((model.task_logits(x, task.index).argmax(-1) + lo == y).sum())
                continue
            logits = model(x)[:, :n_outputs]
            correct_til += int((logits[:, lo:hi].argmax(-1) + lo == y).sum())
            if til_only:
                continue
            correct += int((logits.argmax(-1) == y).sum())
            loss_sum += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
        n = len(data)
        if til_only:
            out.append(TaskAccuracy(acc=None, til_acc=100.0 * correct_til / n, n=n, loss=None))
        else:
            out.append(TaskAccuracy(acc=100.0 * correct / n, til_acc=100.0 * correct_til / n, n=n,
                                    loss=loss_sum / n))
    bar.close()
    model.train(was_training)
    return out
