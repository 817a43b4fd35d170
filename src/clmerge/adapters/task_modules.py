"""Per-task modules: a BatchNorm with one copy per task, an active-task switch, and a router for evaluation.

Task-incremental methods that keep task-private parameters (HALRP, STL) hold them in modules with an
``active_task`` attribute. :func:`set_active_task` switches every such module of a model at once, and
:class:`TaskRoutedModel` evaluates each head block with its own task's parameters: the logits of task t's
range come from the network with task t active, so the engine's task-masked evaluation measures exactly the
per-task models.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .wrappers import register_wrapper

__all__ = ["TaskBatchNorm", "PerTaskCopies", "set_active_task", "TaskRoutedModel", "wrap_batchnorms"]

_BN = (nn.BatchNorm1d, nn.BatchNorm2d)


def set_active_task(model: nn.Module, task: int) -> None:
    """Make every per-task module of ``model`` use task ``task``'s parameters."""
    for m in model.modules():
        if hasattr(m, "active_task"):
            m.active_task = int(task)


class TaskBatchNorm(nn.Module):
    """One BatchNorm per task; copy 0 is the original module (HALRP's official code keeps per-task BN).

    Args:
        base: the BatchNorm of the freshly built network (becomes task 0's copy).
    """

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        if not isinstance(base, _BN):
            raise TypeError(f"TaskBatchNorm wraps BatchNorm1d/2d, got {type(base).__name__}")
        self.per_task = nn.ModuleList([base])
        self.active_task = 0

    def add_task(self, source: nn.Module | None = None) -> nn.Module:
        """Append a copy of ``source`` (default: task 0's BN) as the next task's BN and return it."""
        new = copy.deepcopy(source if source is not None else self.per_task[0])
        self.per_task.append(new)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.active_task >= len(self.per_task):
            raise RuntimeError(f"no BatchNorm for task {self.active_task} (have {len(self.per_task)})")
        return self.per_task[self.active_task](x)

    def get_structure(self) -> dict:
        return {"n_tasks": len(self.per_task)}

    def set_structure(self, structure: dict) -> None:
        while len(self.per_task) < int(structure["n_tasks"]):
            self.add_task()


register_wrapper(TaskBatchNorm, TaskBatchNorm)


def wrap_batchnorms(module: nn.Module) -> list[str]:
    """Replace every BatchNorm in ``module`` by a :class:`TaskBatchNorm`; return the replaced names."""
    names = [n for n, m in module.named_modules() if isinstance(m, _BN) and n]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        if isinstance(parent, nn.ModuleList) and isinstance(parent[0], _BN):
            continue  # already inside a TaskBatchNorm
        setattr(parent, child, TaskBatchNorm(getattr(parent, child)))
    return names


class TaskRoutedModel(nn.Module):
    """Evaluation view of a per-task model: head block t is fed by the network with task t active.

    Args:
        model: a ``ContinualClassifier`` whose head has one block per task, in task order.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = self.model.head.blocks
        outs = []
        for t, block in enumerate(blocks):
            set_active_task(self.model, t)
            outs.append(block(self.model.backbone(x)))  # (B, n_t)
        set_active_task(self.model, len(blocks) - 1)
        return torch.cat(outs, dim=-1)

    def task_range(self, task: int) -> tuple[int, int] | None:
        """The outputs ``[lo, hi)`` of head block ``task`` in :meth:`forward`'s concatenation (None: no block)."""
        blocks = self.model.head.blocks
        if not 0 <= task < len(blocks):
            return None
        lo = sum(int(b.out_features) for b in blocks[:task])
        return lo, lo + int(blocks[task].out_features)

    def task_logits(self, x: torch.Tensor, task: int) -> torch.Tensor:
        """Head block ``task`` fed by the network with ``task`` active: the ``task`` slice of :meth:`forward`,
        computed with one backbone pass instead of one per task (task-id-known evaluation)."""
        blocks = self.model.head.blocks
        set_active_task(self.model, task)
        out = blocks[task](self.model.backbone(x))  # (B, n_task)
        set_active_task(self.model, len(blocks) - 1)
        return out


class PerTaskCopies(nn.Module):
    """One independent copy of a network per task (STL); copy 0 is the original module.

    Args:
        base: the freshly built network (task 0's copy; later copies are re-initialised deep copies).
    """

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.copies = nn.ModuleList([base])
        self.active_task = 0

    @property
    def out_features(self) -> int:
        return int(getattr(self.copies[0], "out_features"))

    def add_task(self, *, reinit: bool = True) -> nn.Module:
        """Append a copy of copy 0; with ``reinit`` its parameters are drawn afresh (torch's global RNG)."""
        new = copy.deepcopy(self.copies[0])
        if reinit:
            for m in new.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        self.copies.append(new)
        return new

    def forward(self, *args, **kwargs):  # as the wrapped network (a Hugging Face ViT: pixel_values=)
        return self.copies[self.active_task](*args, **kwargs)

    def get_structure(self) -> dict:
        return {"n_tasks": len(self.copies)}

    def set_structure(self, structure: dict) -> None:
        while len(self.copies) < int(structure["n_tasks"]):
            self.add_task(reinit=False)


register_wrapper(PerTaskCopies, PerTaskCopies)
