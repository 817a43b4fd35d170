"""Task arithmetic (Ilharco et al. 2023; CART Eq. 2)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .driver import CHUNK, map_keys
from .registry import register_merge
from .sources import open_models

__all__ = ["task_arithmetic"]


@register_merge("task_arithmetic", "pretrained + scaling * sum of task vectors (Ilharco et al. 2023)")
def task_arithmetic(*, base: Any, experts: Sequence[Any], scaling: float = 0.3) -> dict[str, Tensor]:
    """Task arithmetic, CART Eq. (2): ``theta = theta_0 + lambda * sum_t (theta_t - theta_0)``.

    With ``scaling = 1/T`` this is weight averaging.

    Args:
        base: the pretrained parameters ``theta_0``.
        experts: the fine-tuned parameters ``theta_t``.
        scaling: ``lambda`` (0.3 is the value Ilharco et al. and FusionBench use by default; tune it on
            validation data).
    """
    models = open_models(base, experts)

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        # theta_0 + lambda * (sum_t theta_t - T theta_0), accumulated in place in float64
        acc = xs[0].to(torch.float64, copy=True)
        for x in xs[1:]:
            acc.add_(x)
        return acc.sub_(b, alpha=len(xs)).mul_(scaling).add_(b)

    return map_keys(models, kernel, needs_base=True, chunk=CHUNK)
