"""Fisher-weighted averaging (Matena & Raffel 2022, "Merging Models with Fisher-Weighted Averaging")."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .driver import bshape, check_experts_weights, map_keys, stack64
from .registry import register_merge
from ..io import MergeInputError
from .sources import open_models

__all__ = ["fisher_merging", "fisher_tensor"]


def fisher_tensor(experts: Sequence[Tensor], fishers: Sequence[Tensor], weights: Tensor | None = None,
                  min_fisher: float = 1e-6) -> Tensor:
    """Eq. (4) on one key: ``sum_t w_t F_t theta_t / sum_t w_t F_t`` with ``F_t`` floored at ``min_fisher``."""
    x = stack64(experts)  # (T, *shape)
    f = stack64(fishers).clamp(min=0.0) + min_fisher
    if weights is not None:
        f = bshape(weights, f) * f
    return (f * x).sum(0) / f.sum(0)


@register_merge("fisher_merging", "per-entry average weighted by each expert's diagonal Fisher information",
                needs_base=False)
def fisher_merging(*, base: Any = None, experts: Sequence[Any], fishers: Sequence[Mapping[str, Tensor]] | None = None,
                   weights: Sequence[float] | None = None, min_fisher: float = 1e-6) -> dict[str, Tensor]:
    """Fisher merging, Matena & Raffel Eq. (4): ``theta*_j = sum_t w_t F_t,j theta_t,j / sum_t w_t F_t,j``.

    Keys that have no Fisher in any of ``fishers`` are averaged (``weights`` apply). Compute Fishers with
    ``clmerge.params.diagonal_fisher`` on each expert's data.

    Args:
        fishers: one ``{key: diagonal Fisher}`` dict per expert (same keys in each).
        weights: optional per-expert model weights ``w_t`` (paper's ``lambda_i``).
        min_fisher: added to every Fisher entry so that entries no expert is sensitive to get averaged
            (the authors' code uses a 1e-6 floor as well).
    """
    models = open_models(base, experts)
    if fishers is None or len(fishers) != models.num_experts:
        raise ValueError(f"fishers: need one Fisher dict per expert ({models.num_experts})")
    w = check_experts_weights(weights, models.num_experts)
    fkeys = set(fishers[0])
    for i, f in enumerate(fishers):
        if set(f) != fkeys:
            raise MergeInputError(f"fishers[{i}] has different keys from fishers[0]")

    def kernel(key: str, b: Tensor | None, xs: list[Tensor]) -> Tensor:
        if key not in fkeys:
            return fisher_tensor(xs, [torch.ones_like(x) for x in xs], w, 0.0)
        fs = [f[key] for f in fishers]
        if any(tuple(f.shape) != tuple(xs[0].shape) for f in fs):
            raise MergeInputError(f"fisher of key {key!r} has shape {list(fs[0].shape)}, "
                                  f"parameter has {list(xs[0].shape)}")
        return fisher_tensor(xs, fs, w, min_fisher)

    return map_keys(models, kernel)
