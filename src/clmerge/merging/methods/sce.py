"""SCE (Wan et al. 2024, "FuseChat: Knowledge Fusion of Chat Models"): Select, Calculate, Erase,
per tensor, as mergekit's ``sce``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .driver import chunk_for, map_keys, task_vectors64
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
        tvs = tvs * select_mask(tvs.var(dim=0, unbiased=False), select_topk)
    return fuse(tvs, eta_of(tvs.reshape(tvs.shape[0], -1).pow(2).sum(1)))


def select_mask(var: Tensor, select_topk: float) -> Tensor:
    """SCE's Select mask from the per-position variances over the experts (all true where none is nonzero)."""
    m = int(torch.count_nonzero(var))
    return top_magnitude_mask(var, keep_count(select_topk, m)) if m > 0 else torch.ones_like(var, dtype=torch.bool)


def eta_of(energy: Tensor) -> Tensor:
    """SCE's Calculate step: ``eta_t`` ``(T,)`` from the energies ``sum(delta_t^2)`` (equal if all are 0)."""
    total = float(energy.sum())
    return torch.full_like(energy, 1.0 / len(energy)) if total == 0.0 else energy / total


def fuse(tvs: Tensor, eta: Tensor) -> Tensor:
    """SCE's Erase and Fuse, position by position, of (selected, float64) task vectors ``(T, ...)``."""
    eta = eta.reshape(-1, *([1] * (tvs.dim() - 1)))
    majority = torch.where(tvs.sum(0) >= 0, 1.0, -1.0).to(tvs.dtype)
    kept = eta * (torch.sign(tvs) == majority)
    divisor = kept.sum(0)
    return (tvs * kept).sum(0) / torch.where(divisor == 0, 1.0, divisor)


def sce_key(b: Tensor, xs: list[Tensor], select_topk: float) -> Tensor:
    """``theta_0 + sce_tensor(theta_t - theta_0)`` of one key, streamed in flat blocks of
    :func:`.driver.chunk_for` entries: a pass that sums the energies (and, for ``select_topk < 1``, one that
    finds the selected positions from a float64 vector of the variances), then a pass that writes the output.
    Per position the arithmetic is :func:`sce_tensor`'s; the energies are summed block by block, a different
    order than one sum over the tensor, so ``eta`` (and the output) agree to float64 rounding. Returned in
    the experts' dtype."""
    fb, fx = b.reshape(-1), [x.reshape(-1) for x in xs]
    n, chunk = fb.numel(), chunk_for(b)
    spans = [(i, min(i + chunk, n)) for i in range(0, n, chunk)]

    def tvs(i: int, j: int) -> Tensor:
        return task_vectors64(fb[i:j], [x[i:j] for x in fx])

    keep = None
    if select_topk < 1.0:
        var = torch.empty(n, dtype=torch.float64)
        for i, j in spans:
            var[i:j] = tvs(i, j).var(dim=0, unbiased=False)
        keep = select_mask(var, select_topk)
        del var
    energy = torch.zeros(len(xs), dtype=torch.float64)
    for i, j in spans:
        d = tvs(i, j) if keep is None else tvs(i, j) * keep[i:j]
        energy += d.pow(2).sum(1)
    eta = eta_of(energy)
    out = torch.empty(b.shape, dtype=xs[0].dtype)
    for i, j in spans:
        d = tvs(i, j) if keep is None else tvs(i, j) * keep[i:j]
        out.view(-1)[i:j] = fb[i:j].double() + fuse(d, eta)
    return out


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
        return sce_key(b, xs, select_topk)

    return map_keys(models, kernel, needs_base=True)
