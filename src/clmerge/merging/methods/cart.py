"""CART: centered arithmetic with rank-reduced task vectors (Choi et al. 2024, "Revisiting Weight Averaging").

Eq. (4): ``theta_* = theta_avg + lambda * sum_t SVD_k(theta_t - theta_avg)`` for every weight matrix; other
tensors are averaged. CART-Indexing (App. C.2) keeps the per-task low-rank parts and rebuilds task ``t``'s
model as ``theta_avg + lambda * SVD_k(theta_t - theta_avg)``; its other tensors follow the official code,
``theta_avg + lambda * (theta_t - theta_avg)`` (``non_matrix="task"``), or are averaged (``"average"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .driver import map_keys
from .lowrank import DEFAULT_EXCLUDE, is_lowrank_param, low_rank_approx, mean64, svd_factors, target_rank
from .registry import register_merge
from .sources import open_models

__all__ = ["cart", "cart_indexing", "centered_low_rank_sum"]


def centered_low_rank_sum(experts: Sequence[Tensor], k: int, *, svd: str = "exact", seed: int = 0,
                          only: int | None = None) -> tuple[Tensor, Tensor]:
    """``(theta_avg, sum_t SVD_k(theta_t - theta_avg))`` for one matrix (float64 mean, fp32 SVD).

    Args:
        only: if given, the sum is over that single task (CART-Indexing).
    """
    # one expert in float64 at a time (never the (T, m, n) float64 stack: 3 LM heads of a 1.1B Llama = 1.5 GB)
    avg = mean64(experts)
    if svd == "randomized":
        return avg, _low_rank_sum_lean(experts, avg, k, seed, only)
    tasks = range(len(experts)) if only is None else [only]
    total = torch.zeros_like(avg)
    for t in tasks:
        centered = experts[t].to(torch.float64, copy=True).sub_(avg).float()
        total.add_(low_rank_approx(centered, k, method=svd, seed=seed + t))
        del centered
    return avg, total


_ROWS = 1 << 22  # entries per row block of the lean path's float64 work


def _row_blocks(rows: int, cols: int) -> range:
    return range(0, rows, max(1, _ROWS // max(1, cols)))


def _low_rank_sum_lean(experts: Sequence[Tensor], avg: Tensor, k: int, seed: int, only: int | None, *,
                       into: Tensor | None = None, alpha: float = 1.0) -> Tensor:
    """``sum_t SVD_k(theta_t - theta_avg)`` of the randomized path, holding one float32 centered matrix and
    the rank-``k`` factors: each centered delta is formed by row blocks (no full float64 copy), and the sum
    of the products ``(U_t S_t) Vh_t`` is formed by row blocks too, in float64 as the exact path adds them,
    so no full-size float32 product sits beside the average. Returns a float64 tensor of ``avg``'s shape, or,
    with ``into``, adds ``alpha`` times the sum to ``into`` block by block (no full-size accumulator) and
    returns it."""
    if k <= 0:
        return torch.zeros_like(avg) if into is None else into
    rows, cols = avg.shape
    tasks = range(len(experts)) if only is None else [only]
    factors, full = [], []
    for t in tasks:
        centered = torch.empty(avg.shape, dtype=torch.float32)
        for i in _row_blocks(rows, cols):
            j = i + max(1, _ROWS // max(1, cols))
            centered[i:j] = experts[t][i:j].to(torch.float64, copy=True).sub_(avg[i:j])  # rounded to float32
        if k >= min(avg.shape):
            full.append(centered)
            continue
        u, s, vh = svd_factors(centered, k, method="randomized", seed=seed + t)
        del centered
        factors.append((u.mul_(s), vh))
    out = torch.zeros_like(avg) if into is None else into
    step = max(1, _ROWS // max(1, cols))
    block = torch.empty((min(step, rows), cols), dtype=torch.float64)
    for i in _row_blocks(rows, cols):
        j = min(rows, i + step)
        acc = block[: j - i].zero_()
        for us, vh in factors:
            acc += us[i:j] @ vh
        for c in full:
            acc += c[i:j]
        out[i:j].add_(acc, alpha=alpha)
    return out


def _cart_kernel(rank_ratio: float, scaling: float, rounding: str, svd: str, seed: int, include: str | None,
                 exclude: str | None, task: int | None, non_matrix: str = "average"):
    def kernel(key: str, b: Tensor | None, xs: list[Tensor]) -> Tensor:
        shape = tuple(xs[0].shape)
        if not is_lowrank_param(key, shape, exclude, include):
            avg = mean64(xs)  # non-matrix (and excluded) parameters
            if task is None or non_matrix == "average" or rank_ratio == 0.0:
                return avg  # CART: the centered deltas sum to zero; the code zeroes them at gamma = 0 as well
            return avg + scaling * (xs[task].double() - avg)  # official CART-Indexing: the full centered delta
        k = target_rank(shape, rank_ratio, rounding)
        if svd == "randomized":  # the sum is added into the average block by block (no second float64 tensor)
            avg = mean64(xs)
            return _low_rank_sum_lean(xs, avg, k, seed, task, into=avg, alpha=scaling)
        avg, low = centered_low_rank_sum(xs, k, svd=svd, seed=seed, only=task)
        return avg.add_(low, alpha=scaling)

    return kernel


@register_merge("cart", "centered task vectors truncated per matrix to a low rank (CART, Choi et al. 2024)",
                needs_base=False)
def cart(*, base: Any = None, experts: Sequence[Any], rank_ratio: float = 0.08, scaling: float = 1.0,
         rounding: str = "ceil", svd: str = "exact", seed: int = 0, include: str | None = None,
         exclude: str | None = DEFAULT_EXCLUDE) -> dict[str, Tensor]:
    """CART, Eq. (4) / Alg. 1: ``theta_avg + lambda * sum_t SVD_k(theta_t - theta_avg)`` per weight matrix.

    At ``rank_ratio = 0`` and ``1`` this is weight averaging (the centered vectors sum to zero).

    Args:
        base: ignored (CART needs no pretrained weights).
        experts: the fine-tuned parameters.
        rank_ratio: ``gamma``; ``k = ceil(gamma * min(m, n))`` (paper: about 0.08 is near-optimal).
        scaling: ``lambda`` (paper grid 0.2..3.0; released configs use 1.5-2.0).
        rounding: ``"ceil"`` (paper) or ``"floor"`` (official code, ``max(1, int(gamma r))``).
        svd: ``"exact"`` or ``"randomized"`` (seeded range finder; faster for small ``k``).
        seed: seed of the randomized SVD.
        include: regex of keys to truncate, replacing the default rule (see ``lowrank.is_lowrank_param``).
        exclude: regex of 2-D ``*weight`` keys that are averaged instead (default: embeddings, norms).
    """
    models = open_models(base, experts)
    return map_keys(models, _cart_kernel(rank_ratio, scaling, rounding, svd, seed, include, exclude, None))


@register_merge("cart_indexing", "CART's compression variant: task t's model = average + its own low-rank part",
                needs_base=False)
def cart_indexing(*, base: Any = None, experts: Sequence[Any], task: int = 0, rank_ratio: float = 0.08,
                  scaling: float = 1.0, rounding: str = "ceil", svd: str = "exact", seed: int = 0,
                  include: str | None = None, exclude: str | None = DEFAULT_EXCLUDE,
                  non_matrix: str = "task") -> dict[str, Tensor]:
    """CART-Indexing, App. C.2: ``theta_avg + lambda * SVD_k(theta_task - theta_avg)`` per weight matrix.

    The paper's formula has no ``lambda`` (``scaling = 1``, the default); the official code applies its
    ``prior``. Other arguments as in :func:`cart`.

    Args:
        task: which expert's model to rebuild (the task identity is known at inference).
        non_matrix: the tensors that are not truncated (biases, norms, excluded keys). ``"task"`` (official
            code, ``_get_truncated_task_vectors`` then ``apply_to(scaling_coef=prior)``):
            ``theta_avg + lambda * (theta_task - theta_avg)``, so at ``lambda = 1`` the task's own values;
            ``"average"``: ``theta_avg`` (this library's rule before the audit). At ``rank_ratio = 0`` both
            give ``theta_avg``, as the code does.
    """
    if non_matrix not in ("task", "average"):
        raise ValueError(f"non_matrix must be 'task' or 'average', got {non_matrix!r}")
    models = open_models(base, experts)
    if not 0 <= task < models.num_experts:
        raise ValueError(f"task must be in [0, {models.num_experts}), got {task}")
    return map_keys(models, _cart_kernel(rank_ratio, scaling, rounding, svd, seed, include, exclude, task,
                                         non_matrix))
