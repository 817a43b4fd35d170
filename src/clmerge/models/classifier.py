"""Backbone + incremental head, the model every continual method trains.

The head is a list of per-task linear blocks whose outputs are concatenated: task t owns the logit range
``[offset_t, offset_t + n_t)``. This one structure is both the "one growing head" of SD-LoRA's code and the
"per-task heads concatenated" of InfLoRA; the two differ only in the loss (see ``models.losses``). A
task-incremental scenario uses the same head and masks logits to the task's range at evaluation.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["IncrementalHead", "ContinualClassifier"]


class IncrementalHead(nn.Module):
    """Concatenation of per-task linear blocks; ``grow(n)`` appends a block of n outputs.

    Args:
        in_features: feature dimension D.
        bias: whether blocks have a bias.
    """

    def __init__(self, in_features: int, *, bias: bool = True) -> None:
        super().__init__()
        self.in_features = in_features
        self.bias = bias
        self.blocks = nn.ModuleList()

    @property
    def num_classes(self) -> int:
        return sum(b.out_features for b in self.blocks)

    def grow(self, n: int, *, generator: torch.Generator | None = None) -> None:
        if n <= 0:
            raise ValueError(f"head block size must be positive, got {n}")
        ref = next(iter(self.parameters()), None)
        block = nn.Linear(self.in_features, n, bias=self.bias)
        # kaiming-uniform rows, zero bias (PILOT SimpleLinear init), drawn from an explicit generator
        bound = 1.0 / math.sqrt(self.in_features)
        with torch.no_grad():
            block.weight.uniform_(-bound, bound, generator=generator)
            if block.bias is not None:
                block.bias.zero_()
        if ref is not None:
            block = block.to(device=ref.device, dtype=ref.dtype)
        self.blocks.append(block)

    def ensure_classes(self, total: int, *, generator: torch.Generator | None = None) -> None:
        """Grow by one block so that the head has at least ``total`` outputs."""
        if total > self.num_classes:
            self.grow(total - self.num_classes, generator=generator)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        if not self.blocks:
            raise RuntimeError("the head has no classes yet: call grow() in begin_task")
        return torch.cat([b(feats) for b in self.blocks], dim=-1)  # (B, num_classes)

    # structure for checkpoint rebuild ------------------------------------------------------------
    def get_structure(self) -> dict:
        return {"blocks": [b.out_features for b in self.blocks], "bias": self.bias}

    def set_structure(self, structure: dict) -> None:
        self.blocks = nn.ModuleList()
        self.bias = bool(structure.get("bias", True))
        for n in structure["blocks"]:
            self.grow(int(n))


class ContinualClassifier(nn.Module):
    """``backbone`` (images -> features) followed by an :class:`IncrementalHead`.

    ``forward_features``/``forward_head`` follow timm's model interface. ``lora_magnitudes`` holds scalars
    shared by many adapter components (SD-LoRA's one magnitude per task); it lives here so that it is saved
    once in the state dict and moves with ``.to()``.
    """

    def __init__(self, backbone: nn.Module, head: IncrementalHead) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.lora_magnitudes = nn.ParameterDict()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def forward_head(self, feats: torch.Tensor) -> torch.Tensor:
        return self.head(feats)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))
