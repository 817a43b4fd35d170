"""Closed forms of HALRP (Li et al., TKDE 2024): least-squares scalings, residual SVD, Hessian-aware global rank selection.

Pure functions over tensors; reductions accumulate in float64. Weights are ``(J, I)`` for linear
layers and ``(J, I, d_h, d_w)`` for convolutions (PyTorch layout).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "least_squares_scalings",
    "scaled_base",
    "residual_matrix",
    "residual_svd",
    "factors_from_svd",
    "svd_factors",
    "truncation_error",
    "component_scores",
    "global_rank_selection",
]

_EPS = 1e-20  # denominator clamp of the official code in Eq. 19-20


def _expand(v: torch.Tensor, dim: int, ndim: int) -> torch.Tensor:
    shape = [1] * ndim
    shape[dim] = -1
    return v.view(shape)


def least_squares_scalings(w_free: torch.Tensor, w_base: torch.Tensor, *,
                           column_scale: str = "paper") -> tuple[torch.Tensor, torch.Tensor]:
    """Row scalings r (Eq. 19) then column scalings s given r (Eq. 20), one pass.

    r_j = sum_i w^free_ji w^base_ji / sum_i (w^base_ji)^2 minimises ||W^free - R W^base||_F row by row;
    s_i = sum_j r_j w^free_ji w^base_ji / sum_j (r_j w^base_ji)^2 minimises ||W^free - R W^base S||_F column by
    column for that r. For convolutions the sums also run over the kernel positions (official code).

    Args:
        w_free: the warmed-up weight W^free, (J, I) or (J, I, d_h, d_w).
        w_base: the frozen base weight W_base, same shape.
        column_scale: ``paper`` (Eq. 20 above) or ``code``: the official code's column loop multiplies r, shaped
            (J, 1[, 1, 1]), by the column slice w[:, i], shaped (J[, d_h, d_w]); broadcasting forms the outer
            product r_a w_ji, so r decouples from the row and
            s_i = (sum_a r_a / sum_a r_a^2) * sum_j w^free_ji w^base_ji / sum_j (w^base_ji)^2 (docs/halrp.md).

    Returns:
        ``(r, s)`` of shapes (J,) and (I,), float64.
    """
    if w_free.shape != w_base.shape or w_free.dim() not in (2, 4):
        raise ValueError(f"expected equal (J, I) or (J, I, d, d) shapes, got {tuple(w_free.shape)}, "
                         f"{tuple(w_base.shape)}")
    if column_scale not in ("paper", "code"):
        raise ValueError(f"column_scale must be 'paper' or 'code', got {column_scale!r}")
    wf, wb = w_free.double(), w_base.double()
    other_r = [d for d in range(wf.dim()) if d != 0]
    r = (wf * wb).sum(other_r) / (wb * wb).sum(other_r).clamp_min(_EPS)  # (J,)  Eq. 19
    other_s = [d for d in range(wf.dim()) if d != 1]
    if column_scale == "code":  # the outer-product sums factor: (sum_a r_a)(sum_j ...) / ((sum_a r_a^2)(sum_j ...))
        num = r.sum() * (wf * wb).sum(other_s)
        return r, num / (r.pow(2).sum() * (wb * wb).sum(other_s)).clamp_min(_EPS)
    rwb = _expand(r, 0, wb.dim()) * wb
    s = (wf * rwb).sum(other_s) / (rwb * rwb).sum(other_s).clamp_min(_EPS)  # (I,)  Eq. 20
    return r, s


def scaled_base(w_base: torch.Tensor, r: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """R W_base S with diagonal R = diag(r), S = diag(s) (Eq. 2; broadcast over kernel positions, Eq. 7)."""
    n = w_base.dim()
    return _expand(r.to(w_base.dtype), 0, n) * w_base * _expand(s.to(w_base.dtype), 1, n)


def residual_matrix(w_free: torch.Tensor, w_base: torch.Tensor, r: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """B^free = W^free - R W_base S (Eq. 18) as a (J, I) float64 matrix (convs: mean over the d x d positions)."""
    b = w_free.double() - scaled_base(w_base.double(), r.double(), s.double())
    return b.mean(dim=(2, 3)) if b.dim() == 4 else b


def residual_svd(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD of B^free (Eq. 5) in float64: ``(U, sigma, V^T)``, sigma descending.

    Computed once per layer and task: its sigma ranks the components and its vectors give the factors
    (:func:`factors_from_svd`), so the expensive decomposition of the large layers is not repeated.
    """
    return torch.linalg.svd(b.double(), full_matrices=False)


def factors_from_svd(u: torch.Tensor, sig: torch.Tensor, vh: torch.Tensor,
                     k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-k factors U' = U_k diag(sqrt s), V' = diag(sqrt s) V_k^T (Eq. 6) of a thin SVD (as in the official code)."""
    root = sig[:k].sqrt()
    return u[:, :k] * root, root[:, None] * vh[:k]


def svd_factors(b: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank-k factors with sqrt(Sigma) absorbed (official code): U' = U_k diag(sqrt s), V' = diag(sqrt s) V_k^T (Eq. 6).

    Returns:
        ``(U', V', sigma)``: (J, k), (k, I) and all singular values (descending), float64.
    """
    u, sig, vh = residual_svd(b)
    return (*factors_from_svd(u, sig, vh, k), sig)


def truncation_error(sigma: torch.Tensor, k: int) -> torch.Tensor:
    """||B - B^(k)||_F = sqrt(sum_{i > k} sigma_i^2) (Eckart-Young-Mirsky, Eq. 1)."""
    return sigma.double()[k:].pow(2).sum().sqrt()


def component_scores(sigmas: Sequence[torch.Tensor], importances: Sequence[float],
                     scales: Sequence[float]) -> list[torch.Tensor]:
    """score_{l,i} = c_l * g_l * sigma_{l,i}^2 (Sec. 4.3, Eq. 10; c_l = d_h d_w for convs, official code)."""
    return [float(c) * float(g) * s.double().pow(2) for s, g, c in zip(sigmas, importances, scales)]


def global_rank_selection(scores: Sequence[torch.Tensor], alpha: float, *, upper_rank: int | None = None,
                          min_rank: int = 1) -> list[int]:
    """Kept rank per layer by the global greedy cut of Eq. 11 (Eq. 11 as printed is degenerate).

    Pool all (layer, component) scores, sort descending, and keep the shortest prefix whose cumulative share of
    the total exceeds ``alpha`` (m* = first index with F_m > alpha; keep m* + 1). Within a layer scores are
    non-increasing in i, so each layer keeps a prefix of its components. Each k_l is then clamped to
    ``[min_rank, upper_rank]`` (and to the layer's full rank).
    """
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    flat = torch.cat([s.double().flatten() for s in scores])
    owner = torch.cat([torch.full((len(s),), k, dtype=torch.long) for k, s in enumerate(scores)])
    total = flat.sum()
    counts = [0] * len(scores)
    if total > 0:
        order = torch.argsort(flat, descending=True, stable=True)
        frac = torch.cumsum(flat[order], 0) / total
        above = torch.nonzero(frac > alpha)
        m = int(above[0]) if len(above) else len(flat) - 1
        for k in owner[order[: m + 1]].tolist():
            counts[k] += 1
    out = []
    for k, s in enumerate(scores):
        top = min(len(s), upper_rank) if upper_rank is not None else len(s)
        out.append(max(min(min_rank, len(s)), min(counts[k], top)))
    return out
