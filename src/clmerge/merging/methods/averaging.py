"""Weight averaging (CART Eq. 1; Wortsman et al. 2022 "model soups")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .driver import CHUNK, check_experts_weights, map_keys
from .registry import register_merge
from .sources import open_models

__all__ = ["weight_average", "average_tensor"]


def average_tensor(experts: Sequence[Tensor], weights: Tensor | None = None) -> Tensor:
    """``(1/T) sum_t theta_t``, or ``sum_t w_t theta_t / sum_t w_t`` with weights.

    Accumulated in place in one buffer of the inputs' dtype (at least float32; no ``(T, *shape)`` stack),
    the arithmetic of FusionBench's running ``state_dict_add``.
    """
    acc = experts[0].to(torch.promote_types(experts[0].dtype, torch.float32), copy=True)
    if weights is None:
        for x in experts[1:]:
            acc.add_(x)
        return acc.div_(len(experts))
    acc.mul_(float(weights[0]))
    for x, w in zip(experts[1:], weights[1:]):
        acc.add_(x, alpha=float(w))
    return acc.div_(float(weights.sum()))


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
    return map_keys(models, lambda key, b, xs: average_tensor(xs, w), chunk=CHUNK, propagates_nonfinite=True)
