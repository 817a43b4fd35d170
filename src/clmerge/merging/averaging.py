"""Weight averaging (CART Eq. 1; Wortsman et al. 2022 "model soups")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from .driver import bshape, check_experts_weights, map_keys, stack64
from .registry import register_merge
from .sources import open_models

__all__ = ["weight_average", "average_tensor"]


def average_tensor(experts: Sequence[Tensor], weights: Tensor | None = None) -> Tensor:
    """``(1/T) sum_t theta_t``, or ``sum_t w_t theta_t / sum_t w_t`` with weights (float64)."""
    x = stack64(experts)  # (T, *shape)
    if weights is None:
        return x.mean(0)
    return (bshape(weights, x) * x).sum(0) / weights.sum()


@register_merge("weight_average", "plain (or weighted) mean of the experts' parameters", needs_base=False)
def weight_average(*, base: Any = None, experts: Sequence[Any],
                   weights: Sequence[float] | None = None) -> dict[str, Tensor]:
    """Weight averaging, CART Eq. (1): ``theta = (1/T) sum_t theta_t``.

    Args:
        base: ignored (accepted so every method has the same call shape).
        experts: parameter dicts or weight files.
        weights: optional per-expert weights ``w_t``: ``sum_t w_t theta_t / sum_t w_t``.
    """
    models = open_models(base, experts)
    w = check_experts_weights(weights, models.num_experts)
    return map_keys(models, lambda key, b, xs: average_tensor(xs, w))
