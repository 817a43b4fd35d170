"""Model Breadcrumbs (Davari & Belilovsky 2023, "Model Breadcrumbs: Scaling Multi-Task Model Merging with
Sparse Masks"): per layer, drop each task vector's largest-magnitude outliers and its small entries, then task
arithmetic."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .driver import map_keys
from .registry import register_merge
from .sources import open_models
from .ties import plain_task_vectors, ties_from_task_vectors
from .trim import TIE_ALL, keep_count, kth_smallest, top_magnitude_mask, work_dtype

__all__ = ["breadcrumbs", "breadcrumbs_mask", "breadcrumbs_ties"]


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


def top_spec(mag: Tensor, k: int) -> tuple[Tensor, int]:
    """:func:`.trim.top_magnitude_mask` ``(mag, k)`` as a threshold and a tie quota: the mask is ``mag > v``
    plus the first ``quota`` entries equal to ``v`` (``TIE_ALL``: all of them). All kept: ``(-inf,
    TIE_ALL)``; none: ``(nan, 0)`` (nothing compares above NaN)."""
    n = mag.numel()
    if k >= n:
        return mag.new_tensor(-math.inf), TIE_ALL
    if k <= 0:
        return mag.new_tensor(math.nan), 0
    v = kth_smallest(mag.reshape(-1), n - k + 1)
    return v, k - int(torch.count_nonzero(mag > v))


def band_spec(key: str, b: Tensor, xs: list[Tensor], density: float,
              beta: float) -> tuple[Tensor, list[int], tuple[Tensor, list[int]]]:
    """The breadcrumbs masks of one key for the streamed TIES kernel (:func:`.ties_kernels.ties_key_streamed`):
    the trim keeps the top ``n_top + n_keep`` magnitudes, the cut removes the top ``n_top`` (as
    :func:`breadcrumbs_mask`). One expert's magnitudes at a time, ``x - b`` in :func:`.trim.work_dtype` as the
    kernel computes them."""
    dt = work_dtype(b.dtype, *(x.dtype for x in xs))
    fb = b.to(dt)
    lo: list[tuple[Tensor, int]] = []
    hi: list[tuple[Tensor, int]] = []
    for x in xs:
        mag = torch.sub(x.to(dt), fb).abs_()
        n = mag.numel()
        n_keep = keep_count(density, n)
        n_top = min(keep_count(beta, n), n - n_keep)
        lo.append(top_spec(mag, n_top + n_keep))
        hi.append(top_spec(mag, n_top))
        del mag
    return (torch.stack([v for v, _ in lo]), [q for _, q in lo],
            (torch.stack([v for v, _ in hi]), [q for _, q in hi]))


def _check(density: float, beta: float) -> None:
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be in [0, 1], got {density}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")


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
    _check(density, beta)
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


@register_merge("breadcrumbs_ties", "per layer, mask each task vector's top-beta outliers and small entries, then "
                "TIES's sign election (mergekit's breadcrumbs_ties)")
def breadcrumbs_ties(*, base: Any, experts: Sequence[Any], density: float = 0.1, beta: float = 0.01,
                     scaling: float = 1.0, merge_fn: str = "sum") -> dict[str, Tensor]:
    """The breadcrumbs mask (Davari & Belilovsky 2023, :func:`breadcrumbs_mask`) in place of TIES's trim, then
    TIES's Elect and merge (Yadav et al. 2023): ``theta_0 + lambda * tau_m``, ``tau_m`` over the masked task
    vectors whose sign agrees with ``gamma = sgn(sum_t m_t tau_t)``.

    mergekit's ``breadcrumbs_ties`` sums the agreeing entries (its ``normalize`` is false by default), hence
    ``merge_fn="sum"``; ``"mean"`` is TIES's disjoint mean. With ``beta = 0`` this is ``ties`` with
    ``trim_scope="per_tensor"`` and the same density and ``merge_fn``. Zero sums take the model-wide majority
    sign, as ``ties`` (mergekit: ``+``).

    Args:
        density: fraction of each layer's task vector kept.
        beta: fraction of each layer's largest magnitudes masked as outliers (mergekit's ``gamma``, 0.01).
        scaling: ``lambda`` (mergekit's per-model ``weight``).
        merge_fn: ``"sum"`` (mergekit's default), ``"mean"`` (TIES's disjoint mean) or ``"max"``.
    """
    _check(density, beta)
    models = open_models(base, experts)

    def spec(key: str, b: Tensor, xs: list[Tensor]) -> tuple[Tensor, list[int], tuple[Tensor, list[int]]]:
        return band_spec(key, b, xs, density, beta)

    # the masks as thresholds found one expert at a time, then TIES's streamed kernel: the numbers of masking
    # whole (T, *shape) stacks, without the stacks
    return ties_from_task_vectors(models, plain_task_vectors, density=1.0, scaling=scaling,
                                  trim_scope="per_tensor", merge_fn=merge_fn, key_spec=spec)
