"""Low-rank (uncentered) task arithmetic: CART's "original task vector" baseline (Fig. 1, 6; P6)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .driver import map_keys, task_vectors64
from .lowrank import DEFAULT_EXCLUDE, is_lowrank_param, low_rank_approx, target_rank
from .registry import register_merge
from .sources import open_models

__all__ = ["low_rank_task_arithmetic"]


@register_merge("low_rank_task_arithmetic", "task arithmetic with each task vector truncated per matrix by SVD")
def low_rank_task_arithmetic(*, base: Any, experts: Sequence[Any], rank_ratio: float = 0.08,
                             scaling: float = 0.3, rounding: str = "ceil", svd: str = "exact", seed: int = 0,
                             non_matrix: str = "task_arithmetic", include: str | None = None,
                             exclude: str | None = DEFAULT_EXCLUDE) -> dict[str, Tensor]:
    """``theta_0 + lambda * sum_t SVD_k(tau_t)`` on weight matrices (CART Sec. 4.1, the low-rank TA curve).

    Args:
        rank_ratio, rounding, svd, seed, include, exclude: as in ``cart``.
        scaling: ``lambda``.
        non_matrix: ``"task_arithmetic"`` (other tensors get ``theta_0 + lambda sum_t tau_t``) or ``"base"``
            (they stay at ``theta_0``, so ``rank_ratio = 0`` returns the pretrained model exactly). The paper
            does not say which it used.
    """
    if non_matrix not in ("task_arithmetic", "base"):
        raise ValueError(f"non_matrix must be 'task_arithmetic' or 'base', got {non_matrix!r}")
    models = open_models(base, experts)

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        tv = task_vectors64(b, xs)  # (T, *shape)
        if not is_lowrank_param(key, tuple(b.shape), exclude, include):
            return b.double() + (scaling * tv.sum(0) if non_matrix == "task_arithmetic" else 0.0)
        k = target_rank(tuple(b.shape), rank_ratio, rounding)
        low = torch.zeros_like(tv[0])
        for t in range(len(xs)):
            low += low_rank_approx(tv[t].float(), k, method=svd, seed=seed + t).double()
        return b.double() + scaling * low

    return map_keys(models, kernel, needs_base=True)
