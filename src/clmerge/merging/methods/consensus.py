"""TALL masks and Consensus merging (Wang et al. 2024, "Localizing Task Information for Improved Model
Merging and Compression").

TALL mask of task ``t`` (Eq. 5): ``m_t = 1{ |tau_t| > lambda_t * |tau_MTL - tau_t| }`` with ``tau_MTL`` the
merged multi-task vector (``sum_t tau_t`` for task arithmetic). Consensus mask (Eq. 7):
``m_cons = 1{ sum_t m_t >= k }``; Consensus TA: ``theta_0 + alpha * (m_cons * sum_t tau_t)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .driver import CHUNK, map_keys, task_vectors64
from .registry import register_merge
from .sources import open_models

__all__ = ["tall_masks_tensor", "tall_masks", "consensus"]


def tall_masks_tensor(tvs: Tensor, multi: Tensor, tall_lambda: float) -> Tensor:
    """TALL masks of one key: ``|tau_t| > lambda |tau_MTL - tau_t|``, bool ``(T, *shape)``."""
    return tvs.abs() > tall_lambda * (multi.unsqueeze(0) - tvs).abs()


def tall_masks(*, base: Any, experts: Sequence[Any], tall_lambda: float = 0.4) -> list[dict[str, Tensor]]:
    """Per-task TALL masks over the floating keys (``tau_MTL = sum_t tau_t``): one bool dict per expert."""
    models = open_models(base, experts)
    out: list[dict[str, Tensor]] = [{} for _ in range(models.num_experts)]
    for key, b, xs in models.items():
        if models.is_float(key):
            tvs = task_vectors64(b, xs)
            for t, m in enumerate(tall_masks_tensor(tvs, tvs.sum(0), tall_lambda)):
                out[t][key] = m
    return out


@register_merge("consensus", "task arithmetic restricted to entries that at least k tasks' TALL masks select")
def consensus(*, base: Any, experts: Sequence[Any], k: int = 2, tall_lambda: float = 0.4,
              scaling: float = 0.3) -> dict[str, Tensor]:
    """Consensus TA, TALL-masks paper Eq. (7): ``theta_0 + alpha * (1{sum_t m_t >= k} * sum_t tau_t)``.

    Args:
        k: agreement threshold (paper default 2; ``k = 0`` is task arithmetic, ``k = 1`` drops "catastrophic"
            weights no task selects).
        tall_lambda: ``lambda`` of the TALL masks (paper searches 0.2..0.6, one value for all tasks here).
        scaling: ``alpha``.
    """
    models = open_models(base, experts)

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        tvs = task_vectors64(b, xs)
        multi = tvs.sum(0)
        votes = tall_masks_tensor(tvs, multi, tall_lambda).sum(0)
        return b.double() + scaling * torch.where(votes >= k, multi, torch.zeros_like(multi))

    # elementwise (masks, votes and the sum are per entry): cache-sized slices, not float64 model-sized stacks
    return map_keys(models, kernel, needs_base=True, chunk=CHUNK)
