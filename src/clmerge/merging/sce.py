"""SCE (Wan et al. 2024, "FuseChat: Knowledge Fusion of Chat Models"): Select, Calculate, Erase,
per tensor, as mergekit's ``sce``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .driver import map_keys, task_vectors64
from .registry import register_merge
from .sources import open_models
from .trim import keep_count, top_magnitude_mask

__all__ = ["sce", "sce_tensor"]


def sce_tensor(tvs: Tensor, select_topk: float) -> Tensor:
    """The fused task vector of one tensor from the experts' task vectors ``tvs`` ``(T, *shape)``.

    1. Select: with ``select_topk < 1``, keep only the positions whose variance over the experts is among the
       top ``round(select_topk * m)``, ``m`` the number of positions of nonzero variance (ties to the lower
       flat index); the rest are zeroed in every task vector. Where no position has nonzero variance (one
       expert, or identical ones) there is nothing to select and all are kept (mergekit zeroes them all).
    2. Calculate: matrix-level weights ``eta_t = sum(delta_t^2) / sum_s sum(delta_s^2)`` (equal if all zero).
    3. Erase: per position, drop the entries whose sign differs from ``sgn(sum_t delta_t)`` (``+`` where that
       sum is 0; a zero entry never agrees).
    Fuse: ``sum_t eta_t m_t delta_t / sum_t eta_t m_t`` (a zero divisor counts as 1).
    """
    tvs = tvs.double()
    if select_topk < 1.0:
        var = tvs.var(dim=0, unbiased=False)
        m = int(torch.count_nonzero(var))
        if m > 0:
            tvs = tvs * top_magnitude_mask(var, keep_count(select_topk, m))
    energy = tvs.reshape(tvs.shape[0], -1).pow(2).sum(1)
    total = float(energy.sum())
    eta = torch.full_like(energy, 1.0 / len(energy)) if total == 0.0 else energy / total
    eta = eta.reshape(-1, *([1] * (tvs.dim() - 1)))
    majority = torch.where(tvs.sum(0) >= 0, 1.0, -1.0).to(tvs.dtype)
    kept = eta * (torch.sign(tvs) == majority)
    divisor = kept.sum(0)
    return (tvs * kept).sum(0) / torch.where(divisor == 0, 1.0, divisor)


@register_merge("sce", "select high-variance positions, weight experts by task-vector energy, erase minority "
                "signs (FuseChat's SCE)")
def sce(*, base: Any, experts: Sequence[Any], select_topk: float = 1.0) -> dict[str, Tensor]:
    """SCE, Wan et al. 2024 (FuseChat): ``theta_0 + sce(theta_t - theta_0)`` per tensor, see
    :func:`sce_tensor`.

    mergekit's count of selected positions is ``int(select_topk * m)``; here ``round`` with halves up and a
    fixed tie order, the exact-density rule of every magnitude trim (``merging.trim``).

    Args:
        select_topk: fraction of positions (of nonzero variance) kept by the Select step (mergekit's
            ``select_topk``, default 1.0: no selection).
    """
    if not 0.0 <= select_topk <= 1.0:
        raise ValueError(f"select_topk must be in [0, 1], got {select_topk}")
    models = open_models(base, experts)

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        return b.double() + sce_tensor(task_vectors64(b, xs), select_topk)

    return map_keys(models, kernel, needs_base=True)
