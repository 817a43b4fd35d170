"""Linear algebra shared by the merge methods and the checkpoint I/O below them: the thin SVD with a float64
retry and the package's one randomized SVD."""

from __future__ import annotations

import torch
from torch import Tensor

from .device import cpu_draw

__all__ = ["thin_svd", "randomized_svd"]


def thin_svd(m: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.linalg.svd(m, full_matrices=False)``, retried in float64 (and cast back) when LAPACK's
    divide-and-conquer fails to converge on a float32 matrix: it does on some ill-conditioned task residuals
    of ViT-B-sized layers (seen on ``iso_cts``)."""
    try:
        return torch.linalg.svd(m, full_matrices=False)
    except torch.linalg.LinAlgError:
        if m.dtype == torch.float64:
            raise
        u, s, vh = torch.linalg.svd(m.double(), full_matrices=False)
        return u.to(m.dtype), s.to(m.dtype), vh.to(m.dtype)


def randomized_svd(m: Tensor, k: int, *, oversample: int, power_iters: int, seed: int = 0,
                   slice_first: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Top-``k`` singular triplets ``(U_k (m,k), S_k (k,), Vh_k (k,n))`` of ``m`` by a seeded randomized range
    finder with subspace iteration (Halko, Martinsson & Tropp 2011, Alg. 4.4 then Alg. 5.1): ``Q`` an
    orthonormal basis of ``(m m^T)^q m Omega`` with ``l = min(m, n, k + oversample)`` columns, re-orthonormalised
    at each half step, then the exact thin SVD of ``Q^T m``. The one randomized SVD of the package (the SVD
    merges through ``merging.methods.lowrank.svd_factors``, the LoRA extraction in ``merging.io.lora_svd``).

    Args:
        oversample: ``p``, the extra columns of the sketch.
        power_iters: ``q``, the subspace iterations.
        seed: seed of the Gaussian sketch ``Omega`` (drawn on the CPU: the same numbers on any device).
        slice_first: ``U_k = Q (U_b)_{:, :k}`` (fewer flops; the LoRA extraction) instead of ``(Q U_b)_{:, :k}``
            (the SVD merges). The same numbers up to the last bit, which BLAS rounds differently on some
            shapes; each caller keeps the one it always used, so its outputs do not move.
    """
    g = torch.Generator().manual_seed(seed)
    ell = min(min(m.shape), k + oversample)
    omega = cpu_draw(torch.randn, m.shape[1], ell, generator=g, like=m, dtype=m.dtype)  # (n, l), same on any device
    q = torch.linalg.qr(m @ omega).Q  # (m, l)
    for _ in range(power_iters):
        q = torch.linalg.qr(m.T @ q).Q
        q = torch.linalg.qr(m @ q).Q
    ub, s, vh = thin_svd(q.T @ m)  # (l, n) sketch
    return (q @ ub[:, :k] if slice_first else (q @ ub)[:, :k]), s[:k], vh[:k]
