"""Low-rank helpers shared by CART, CART-Indexing, low-rank task arithmetic and the analysis tools.

- :func:`target_rank`: ``k = ceil(rank_ratio * r)`` with ``r = min(m, n)`` (CART Alg. 1 line 7), or the
  official code's ``max(1, int(rank_ratio * r))`` with ``rounding="floor"``; ``rank_ratio = 0`` gives 0 and
  ``rank_ratio = 1`` gives ``r`` under both rules. The merging benchmarks use the default ``ceil``
  (benchmarks/merging/README.md, "Rank rounding").
- :func:`low_rank_approx`: ``SVD_k(M)``, exact (thin SVD) or randomized (:func:`randomized_svd`, a seeded
  range finder with power iterations, Halko et al. 2011, Alg. 4.4, the package's one randomized SVD), so
  results repeat exactly for a given seed.
- :func:`is_lowrank_param`: which tensors get low-rank treatment (CART Sec. 5.1: the attention and MLP weight
  matrices; biases, norms and embeddings are averaged).
- :func:`polar_factor`: the orthogonal factor of a polar decomposition (orthogonal Procrustes), which TSV-M and
  Iso-CTS use to orthogonalise concatenated singular vectors; :func:`task_matrices`: one key's task vectors in
  the work dtype those SVD merges use; :func:`matrix_update_kernel`: the key kernel of TSV-M, Iso-C and Iso-CTS
  (a per-matrix update from the stacked task matrices, the mean task vector elsewhere).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ...utils.linalg import randomized_svd, thin_svd

__all__ = ["target_rank", "low_rank_approx", "svd_factors", "randomized_svd", "thin_svd", "is_lowrank_param",
           "polar_factor", "task_matrices", "TaskMatrices", "mean64", "matrix_update_kernel", "check_svd_method",
           "DEFAULT_EXCLUDE"]

# 2-D "weight" tensors whose name matches this are NOT truncated (embeddings, norms, position tables).
DEFAULT_EXCLUDE = r"(embed|norm|(^|\.)ln|position|cls_token|class_embedding|(^|\.)proj$)"


def target_rank(shape: tuple[int, ...], rank_ratio: float, rounding: str = "ceil") -> int:
    """Number of singular triplets kept for a matrix of ``shape``.

    Args:
        shape: the matrix shape ``(m, n)``.
        rank_ratio: ``gamma`` in [0, 1].
        rounding: ``"ceil"`` (the paper, Alg. 1) or ``"floor"`` (official code: ``max(1, int(gamma r))``).
    """
    if not 0.0 <= rank_ratio <= 1.0:
        raise ValueError(f"rank_ratio must be in [0, 1], got {rank_ratio}")
    r = min(shape)
    if rank_ratio == 0.0:
        return 0
    if rounding == "ceil":
        return min(r, math.ceil(rank_ratio * r - 1e-9))
    if rounding == "floor":
        return min(r, max(1, int(rank_ratio * r)))
    raise ValueError(f"rounding must be 'ceil' or 'floor', got {rounding!r}")


def svd_factors(m: Tensor, k: int, *, method: str = "exact", oversample: int = 20, power_iters: int = 2,
                seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Top-``k`` singular triplets ``(U_k (m,k), S_k (k,), Vh_k (k,n))`` of ``m``.

    Args:
        method: ``"exact"`` (``torch.linalg.svd``) or ``"randomized"``.
        oversample: extra columns of the random sketch (randomized only). 20: with 10, CART's centered deltas
            (three decaying spectra mixed, rate 0.7, k = 8 of 72) missed the exact merge by 1.3e-3; with 20,
            by 4e-6 (tests/merging/test_svd_fast_path.py).
        power_iters: subspace iterations (randomized only); 2 is usually enough for task vectors.
        seed: seed of the sketch (randomized only).
    """
    if method not in ("exact", "randomized"):
        raise ValueError(f"svd method must be 'exact' or 'randomized', got {method!r}")
    if method == "exact" or k >= min(m.shape) // 2:
        u, s, vh = thin_svd(m)
        # copies, so the full factors (an m x r U: 0.26 GB for a 32000 x 2048 LM head) are freed at return
        return u[:, :k].clone(), s[:k].clone(), vh[:k].clone()
    return randomized_svd(m, k, oversample=oversample, power_iters=power_iters, seed=seed)


def low_rank_approx(m: Tensor, k: int, **svd_kw) -> Tensor:
    """``SVD_k(m) = sum_{i<=k} sigma_i u_i v_i^T``; exact zeros for ``k = 0`` and ``m`` itself for full rank."""
    if k <= 0:
        return torch.zeros_like(m)
    if k >= min(m.shape):
        return m.clone()
    u, s, vh = svd_factors(m, k, **svd_kw)
    return (u * s) @ vh


def is_lowrank_param(key: str, shape: tuple[int, ...], exclude: str | None = DEFAULT_EXCLUDE,
                     include: str | None = None) -> bool:
    """Whether ``key`` is a weight matrix that low-rank methods truncate.

    Default rule (CART Sec. 5.1, first released code): a 2-D tensor named ``*weight`` that is not an
    embedding, norm or position table. ``include`` (a regex) replaces the rule by an explicit choice of keys.
    """
    if len(shape) != 2:
        return False
    if include is not None:
        return re.search(include, key) is not None
    return key.endswith("weight") and not (exclude and re.search(exclude, key))


def polar_factor(a: Tensor) -> Tensor:
    """``P Q^T`` for the thin SVD ``a = P S Q^T``: the matrix with orthonormal columns (rows, for a wide ``a``)
    nearest to ``a`` in Frobenius norm (orthogonal Procrustes). For ``a`` of full column rank it equals the
    whitening ``a (a^T a)^{-1/2}`` (the orthogonalisation of TSV-M and Iso-CTS)."""
    u, _, vh = thin_svd(a)
    return u @ vh


def mean64(tensors: Sequence[Tensor], minus: Tensor | None = None) -> Tensor:
    """``mean_t (x_t - minus)`` in float64, one tensor converted at a time (no ``(T, *shape)`` stack)."""
    out = tensors[0].to(torch.float64, copy=True)
    for x in tensors[1:]:
        out.add_(x.to(torch.float64))
    out.div_(len(tensors))
    return out if minus is None else out.sub_(minus.to(torch.float64))


def task_matrices(base: Tensor, experts: list[Tensor]) -> Tensor:
    """One key's task vectors ``theta_t - theta_0``, shape ``(T, *shape)``, in the work dtype of the SVD merges:
    float32, or float64 when the inputs are float64 (each difference formed in that dtype)."""
    dtype = torch.promote_types(experts[0].dtype, torch.float32)
    b = base.to(dtype)
    return torch.stack([x.to(dtype) - b for x in experts])


class TaskMatrices:
    """One key's task vectors ``theta_t - theta_0`` formed one at a time (``[t]``) instead of stacked: the same
    numbers as :func:`task_matrices` (each difference in the same dtype), with one ``(m, n)`` task matrix alive
    at a time (the stack of three 32000 x 2048 float32 LM-head task matrices is 0.79 GB). ``shape`` is the
    stack's."""

    def __init__(self, base: Tensor, experts: list[Tensor]) -> None:
        self._dtype = torch.promote_types(experts[0].dtype, torch.float32)
        self._base, self._experts = base, experts
        self.shape = (len(experts), *base.shape)

    def __len__(self) -> int:
        return len(self._experts)

    def __getitem__(self, t: int) -> Tensor:
        return self._experts[t].to(self._dtype) - self._base.to(self._dtype)

    def __iter__(self):
        return (self[t] for t in range(len(self)))

    def sum(self) -> Tensor:
        """``sum_t tau_t``, added in task order (``tau_0 + tau_1 + ...``)."""
        total = self[0]
        for t in range(1, len(self)):
            total.add_(self[t])
        return total


def check_svd_method(svd: str) -> None:
    """Raise a one-line error unless ``svd`` is ``"exact"`` or ``"randomized"`` (the SVD merges' ``svd``)."""
    if svd not in ("exact", "randomized"):
        raise ValueError(f"svd must be 'exact' or 'randomized', got {svd!r}")


def matrix_update_kernel(update: Callable[[Tensor], Tensor], scaling: float, include: str | None,
                         exclude: str | None, *, lazy: bool = False) -> Callable[[str, Tensor, list[Tensor]], Tensor]:
    """The key kernel ``(key, base, experts) -> merged`` of the SVD merges that replace the task vectors of each
    weight matrix by one update (TSV-M, Iso-C, Iso-CTS): ``theta_0 + alpha * update(taus)`` with ``taus`` the
    stacked task matrices (:func:`task_matrices`; with ``lazy``, a :class:`TaskMatrices` that forms them one at
    a time), and ``theta_0 + alpha * mean_t tau_t`` (float64, no stack) for the tensors that are not matrices
    (:func:`is_lowrank_param` with ``include`` / ``exclude``). The float64 sum is formed in place, one
    full-size float64 tensor at a time (the same numbers as ``b.double() + alpha * update.double()``)."""

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        if not is_lowrank_param(key, tuple(b.shape), exclude, include):  # mean task vector, no (T, ...) stack
            return mean64(xs, minus=b).mul_(scaling).add_(b.double())
        taus = TaskMatrices(b, xs) if lazy else task_matrices(b, xs)
        upd = update(taus)
        del taus
        out = upd.to(torch.float64, copy=True)
        del upd
        return out.mul_(scaling).add_(b)

    return kernel
