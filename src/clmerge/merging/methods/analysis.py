"""Analysis tools the merging papers plot.

- :func:`task_vector_spectra`: singular values of each task vector per weight matrix, original
  (``theta_t - theta_0``) or centered (``theta_t - theta_avg``; CART Sec. 4).
- :func:`row_space_interference`: CART Eq. (5) (Choi et al. 2024, "Revisiting Weight Averaging") read as follows:
  ``I(k) = sum_{i != j} || Sigma~_i (V~_i^T V~_j) Sigma~_j ||_F`` with ``V~_t`` the ``n x k`` top right singular
  vectors and ``Sigma~_t = Sigma_t[:k] / ||tau_t||_F``. The literal n x n reading depends on singular values
  only, so it measures no overlap.
- :func:`reconstruction_error`: CART Eq. (7), ``R(k) = sum_t ||tau_t - SVD_k(tau_t)||_F^2``.
- :func:`interference_curves`: ``I(k)`` and ``R(k)`` for every weight matrix, centered and original.
- :func:`loss_along_line`: a metric at ``(1 - a) theta_A + a theta_B`` for a grid of ``a``.
- :func:`rank_ratio_curve`: a metric of CART (or low-rank TA) as a function of the rank ratio (the bell curve).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .driver import stack64
from .lowrank import DEFAULT_EXCLUDE, is_lowrank_param
from .sources import open_models

__all__ = ["task_vector_spectra", "row_space_interference", "reconstruction_error", "interference_curves",
           "interpolate", "loss_along_line", "rank_ratio_curve"]


def _vectors(b: Tensor | None, xs: list[Tensor], centered: bool) -> Tensor:
    x = stack64(xs)  # (T, m, n)
    if centered:
        return x - x.mean(0)
    if b is None:
        raise ValueError("original (uncentered) task vectors need base=")
    return x - b.double()


def task_vector_spectra(*, base: Any = None, experts: Sequence[Any], centered: bool = False,
                        include: str | None = None, exclude: str | None = DEFAULT_EXCLUDE) -> dict[str, Tensor]:
    """``{key: (T, min(m, n))}`` singular values (descending) of each expert's task vector, per weight matrix."""
    models = open_models(base, experts)
    out = {}
    for key in models.keys():
        shape, dtype = models.meta(key)
        if dtype.is_floating_point and is_lowrank_param(key, shape, exclude, include):
            b, xs = models.load(key)
            out[key] = torch.linalg.svdvals(_vectors(b, xs, centered))
    return out


def row_space_interference(vectors: Sequence[Tensor] | Tensor, k: int) -> float:
    """CART Eq. (5), k x k cross-Gram reading: ``sum_{i != j} ||Sigma~_i V~_i^T V~_j Sigma~_j||_F``.

    Args:
        vectors: ``T`` task vectors of one weight matrix, each ``(m, n)``.
        k: number of top singular directions kept (``1 <= k <= min(m, n)``).
    """
    parts = []
    for tau in vectors:
        _, s, vh = torch.linalg.svd(tau.double(), full_matrices=False)
        norm = s.norm()  # = ||tau||_F: the proof's normalisation by all singular values
        s_n = s[:k] / norm if norm > 0 else s[:k] * 0
        parts.append(s_n[:, None] * vh[:k])  # (k, n): Sigma~ V~^T
    total = 0.0
    for i, a in enumerate(parts):
        for j, b in enumerate(parts):
            if i != j:
                total += float(torch.linalg.matrix_norm(a @ b.T))  # (k, k)
    return total


def reconstruction_error(vectors: Sequence[Tensor] | Tensor, k: int) -> float:
    """CART Eq. (7): ``sum_t ||tau_t - SVD_k(tau_t)||_F^2 = sum_t sum_{i > k} sigma_{t,i}^2``."""
    return float(sum(torch.linalg.svdvals(t.double())[k:].pow(2).sum() for t in vectors))


def interference_curves(*, base: Any, experts: Sequence[Any], ks: Sequence[int],
                        include: str | None = None, exclude: str | None = DEFAULT_EXCLUDE) -> dict[str, dict[str, list[float]]]:
    """``{key: {"I_centered", "I_original", "R_centered", "R_original": [value per k]}}`` per weight matrix.

    ``k`` larger than a matrix's rank is clipped to its rank.
    """
    models = open_models(base, experts)
    out: dict[str, dict[str, list[float]]] = {}
    for key in models.keys():
        shape, dtype = models.meta(key)
        if not (dtype.is_floating_point and is_lowrank_param(key, shape, exclude, include)):
            continue
        b, xs = models.load(key)
        row: dict[str, list[float]] = {}
        for name, centered in (("centered", True), ("original", False)):
            vecs = _vectors(b, xs, centered)
            row[f"I_{name}"] = [row_space_interference(vecs, min(k, min(shape))) for k in ks]
            row[f"R_{name}"] = [reconstruction_error(vecs, min(k, min(shape))) for k in ks]
        out[key] = row
    return out


def interpolate(a: Mapping[str, Tensor], b: Mapping[str, Tensor], alpha: float) -> dict[str, Tensor]:
    """``(1 - alpha) a + alpha b`` for floating tensors (others from ``a``); dtypes kept."""
    if set(a) != set(b):
        raise ValueError(f"interpolate: key sets differ, e.g. {sorted(set(a) ^ set(b))[:3]}")
    return {k: ((1 - alpha) * v.double() + alpha * b[k].double()).to(v.dtype) if v.is_floating_point() else v
            for k, v in a.items()}


def loss_along_line(a: Mapping[str, Tensor], b: Mapping[str, Tensor], evaluate: Callable[[dict[str, Tensor]], float],
                    alphas: Sequence[float] | None = None) -> list[tuple[float, float]]:
    """``[(alpha, evaluate((1 - alpha) a + alpha b)), ...]``; default 11 points from 0 to 1."""
    alphas = [i / 10 for i in range(11)] if alphas is None else alphas
    return [(float(al), float(evaluate(interpolate(a, b, al)))) for al in alphas]


def rank_ratio_curve(*, experts: Sequence[Any], evaluate: Callable[[dict[str, Tensor]], float],
                     ratios: Sequence[float], base: Any = None, method: str = "cart",
                     **hp: Any) -> list[tuple[float, float]]:
    """``[(gamma, evaluate(merge(method, rank_ratio=gamma, **hp)))]`` (CART Fig. 1 / 6)."""
    from .registry import merge

    return [(float(g), float(evaluate(merge(method, base=base, experts=experts, rank_ratio=g, **hp))))
            for g in ratios]
