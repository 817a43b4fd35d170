"""Model Breadcrumbs (Davari & Belilovsky 2023, "Model Breadcrumbs: Scaling Multi-Task Model Merging with
Sparse Masks"): per layer, drop each task vector's largest-magnitude outliers and its small entries, then task
arithmetic."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .driver import map_keys
from .registry import register_merge
from .sources import open_models
from .trim import keep_count, top_magnitude_mask

__all__ = ["breadcrumbs", "breadcrumbs_mask"]


def breadcrumbs_mask(tv: Tensor, density: float, beta: float) -> Tensor:
    """The breadcrumbs mask of one layer's task vector: entries ranked ``n_top + 1 .. n_top + n_keep`` by
    magnitude, with ``n_top = round(beta * n)`` outliers and ``n_keep = round(density * n)`` kept (halves up).

    Ranking is by ``|tau|`` descending, ties to the lower flat index (the exact-density rule of ``merging.trim``).
    If ``n_top + n_keep > n`` the outlier cut shrinks so that ``n_keep`` entries are kept (as mergekit).
    """
    mag = tv.abs()
    n = mag.numel()
    n_keep = keep_count(density, n)
    n_top = min(keep_count(beta, n), n - n_keep)
    return top_magnitude_mask(mag, n_top + n_keep) & ~top_magnitude_mask(mag, n_top)


@register_merge("breadcrumbs", "per layer, mask each task vector's top-beta outliers and small entries, then "
                "task arithmetic")
def breadcrumbs(*, base: Any, experts: Sequence[Any], density: float = 0.1, beta: float = 0.01,
                scaling: float = 0.3) -> dict[str, Tensor]:
    """Model Breadcrumbs, Davari & Belilovsky 2023 (Sec. 3): ``theta = theta_0 + alpha * sum_t m_t * tau_t``
    where, in every layer, the mask ``m_t`` removes the top-``beta`` fraction of ``|tau_t|`` (outliers) and the
    smallest entries, keeping exactly ``round(density * n)`` entries (see :func:`breadcrumbs_mask`).

    ``beta = 0`` and ``density = 1`` is task arithmetic. mergekit's ``breadcrumbs`` calls ``beta`` ``gamma`` and
    counts with ``int()``: ``int(density*n)`` kept, ``int(gamma*n)`` outliers.

    Args:
        density: fraction of each layer's task vector kept (the rest of the bottom is masked).
        beta: fraction of each layer's largest-magnitude entries masked as outliers (mergekit's ``gamma``,
            default 0.01 there too).
        scaling: ``alpha``, the task-arithmetic coefficient (tune on validation data).
    """
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be in [0, 1], got {density}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    models = open_models(base, experts)

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        dtype = torch.promote_types(b.dtype, torch.float32)
        b32 = b.to(dtype)
        acc = torch.zeros_like(b32)
        for x in xs:
            tv = x.to(dtype) - b32
            acc.add_(tv * breadcrumbs_mask(tv, density, beta))
        return acc.mul_(scaling).add_(b32)

    return map_keys(models, kernel, needs_base=True)
