"""Task arithmetic (Ilharco et al. 2023; CART Eq. 2)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .driver import CHUNK, map_keys
from .registry import register_merge
from .sources import open_models
from .trim import work_dtype

__all__ = ["task_arithmetic"]


@register_merge("task_arithmetic", "pretrained + scaling * sum of task vectors (Ilharco et al. 2023)")
def task_arithmetic(*, base: Any, experts: Sequence[Any], scaling: float = 0.3,
                    normalize: bool = False) -> dict[str, Tensor]:
    """Task arithmetic, CART Eq. (2): ``theta = theta_0 + lambda * sum_t (theta_t - theta_0)``.

    With ``scaling = 1/T`` this is weight averaging.

    Args:
        base: the pretrained parameters ``theta_0``.
        experts: the fine-tuned parameters ``theta_t``.
        scaling: ``lambda`` (0.3 is the value Ilharco et al. and FusionBench use by default; tune it on
            validation data).
        normalize: divide the weighted sum by the sum of the weights, as mergekit's ``normalize``: every expert
            has the weight ``lambda`` here, so this gives ``theta_0 + (1/T) sum_t tau_t`` whatever ``lambda``
            (a weight sum below 1e-8 in magnitude divides by 1, as mergekit).
    """
    models = open_models(base, experts)
    if normalize and abs(scaling * models.num_experts) >= 1e-8:
        scaling = 1.0 / models.num_experts

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        # theta_0 + lambda * sum_t (theta_t - theta_0): each difference formed first (exact for nearby
        # values), summed in place in the inputs' dtype (at least float32, unless compute_dtype says bfloat16,
        # float16 or input: trim.work_dtype), as FusionBench's state-dict sums
        dtype = work_dtype(b.dtype)
        b = b.to(dtype)
        acc, tmp = torch.sub(xs[0].to(dtype), b), torch.empty_like(b)
        for x in xs[1:]:
            acc.add_(torch.sub(x.to(dtype), b, out=tmp))
        return acc.mul_(scaling).add_(b)

    return map_keys(models, kernel, needs_base=True, chunk=CHUNK, propagates_nonfinite=True)
