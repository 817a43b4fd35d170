"""Task Singular Vectors (Gargiulo et al., CVPR 2025, "Task Singular Vectors: Reducing Task Interference in
Model Merging"): TSV-M (merge) and TSV-C (compression).

Per weight matrix, ``Delta_t = theta_t - theta_0 = U_t S_t V_t^T`` and ``k = floor(r / T)`` with
``r = min(m, n)`` (the paper's "1/T of the rank"; FusionBench's ``int(r * (1 / T))``, equal for every
``r, T`` checked up to ``r = 20000, T = 40``):

- TSV-C: task ``t``'s model is ``theta_0 + alpha * U_t[:, :k] S_t[:k] V_t[:, :k]^T``; the other
  tensors are ``theta_0 + alpha * Delta_t`` (stored whole, as the official code's ``"dim1"`` entries).
- TSV-M: concatenate ``U = [U_1[:, :k], ..., U_T[:, :k]]`` (``m x Tk``), ``S`` (``Tk``) and
  ``V`` likewise, orthogonalise ``U`` and ``V`` by their polar factors (``U_perp = P_U Q_U^T`` for
  ``U = P_U S_U Q_U^T``: the Procrustes solution, equal to the whitening ``U (U^T U)^{-1/2}`` the paper
  describes when ``U`` has full column rank), and add ``alpha * U_perp diag(S) V_perp^T``. Other tensors get
  ``theta_0 + alpha * mean_t Delta_t`` (the averaged task vectors, as FusionBench and the official code).

Randomized SVD (``svd="randomized"``, :func:`~clmerge.merging.methods.lowrank.svd_factors`: a seeded range finder with
``p = 20`` extra columns and ``q = 2`` power iterations, Halko et al. 2011, Alg. 4.4): the sketch ``Q``
satisfies ``E||Delta - Q Q^T Delta||_2 <= [(1 + sqrt(k/(p-1))) s^(2q+1) + (e sqrt(k+p)/p) sqrt(sum_(j>k)
s_j^(2(2q+1)))]^(1/(2q+1))`` with ``s = s_(k+1)`` (their bound for the power scheme), at most ``(1 + sqrt(k/19) +
0.136 sqrt((k+20)(r-k)))^(1/5) s_(k+1)``; truncating the sketch to rank ``k`` adds at most ``s_(k+1)`` (triangle
inequality, as ``s_(k+1)(Q^T Delta) <= s_(k+1)``). For ``k = 96``, ``r = 768`` (ViT-B, 8 tasks) the expected
spectral error is at most ``3.1 s_(k+1)``, against ``s_(k+1)`` for the exact truncation. With ``k >= r / 2``
(two tasks or fewer) the exact SVD is used anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .driver import map_keys
from .lowrank import (DEFAULT_EXCLUDE, check_svd_method, is_lowrank_param, matrix_update_kernel, polar_factor,
                      svd_factors, task_matrices)
from .registry import register_merge
from .sources import open_models

__all__ = ["tsv_m", "tsv_c", "tsv_rank", "tsv_merge_matrix"]


def tsv_rank(shape: tuple[int, ...], num_tasks: int) -> int:
    """``k = floor(min(m, n) / T)``, the singular triplets each task keeps (0 when ``min(m, n) < T``)."""
    return min(shape) // num_tasks


def tsv_merge_matrix(taus: Tensor, *, svd: str = "exact", seed: int = 0) -> Tensor:
    """TSV-M's update ``U_perp diag(S) V_perp^T`` of one matrix from its task matrices ``(T, m, n)`` (a stack,
    or a :class:`~clmerge.merging.methods.lowrank.TaskMatrices` that forms them one at a time)."""
    k = tsv_rank(tuple(taus.shape[1:]), len(taus))
    if k == 0:
        return torch.zeros_like(taus[0])
    us, ss, vhs = [], [], []
    for i in range(len(taus)):  # one task matrix alive at a time when ``taus`` is a lowrank.TaskMatrices
        tau = taus[i]
        u, s, vh = svd_factors(tau, k, method=svd, seed=seed + i)
        del tau
        us.append(u)
        ss.append(s)
        vhs.append(vh)
    cat = torch.cat(us, dim=1)  # (m, Tk)
    us.clear()
    u_perp = polar_factor(cat)
    cat = torch.cat(vhs, dim=0)  # (Tk, n)
    vhs.clear()
    vh_perp = polar_factor(cat)
    del cat
    return u_perp.mul_(torch.cat(ss)) @ vh_perp


@register_merge("tsv_m", "Task Singular Vectors merge: each task's top 1/T singular vectors, orthogonalised "
                "(Gargiulo et al. 2025)")
def tsv_m(*, base: Any, experts: Sequence[Any], scaling: float = 1.0, svd: str = "exact", seed: int = 0,
          include: str | None = None, exclude: str | None = DEFAULT_EXCLUDE) -> dict[str, Tensor]:
    """TSV-M: ``theta_0 + alpha * U_perp diag(S) V_perp^T`` per weight matrix (module docstring).

    Matches FusionBench's ``TaskSingularVectorMerging`` (``compute_and_sum_svd_mem_reduction``) and the
    official ``TSVM`` method, except: (1) which tensors are matrices: here the rule of
    ``lowrank.is_lowrank_param`` (2-D ``*weight`` tensors, not embeddings or norms); FusionBench takes every
    2-D tensor (``include="."`` reproduces it); (2) the concatenation holds the ``Tk`` kept columns, where
    FusionBench pads it with zeros to ``r`` columns (the same product whenever the kept columns are linearly
    independent); (3) a float32 SVD for float32 / bf16 inputs and float64 for float64 inputs.

    Args:
        scaling: ``alpha`` (paper and FusionBench default 1.0; the official code searches 0..3 on validation).
        svd: ``"exact"`` or ``"randomized"`` per-task SVDs (error bound in the module docstring).
        seed: seed of the randomized SVD (task ``t`` uses ``seed + t``).
        include: regex of keys treated as matrices, replacing the default rule (``"."``: every 2-D tensor).
        exclude: regex of 2-D ``*weight`` keys treated as non-matrix tensors (default: embeddings, norms).
    """
    check_svd_method(svd)
    models = open_models(base, experts)

    def update(taus: Tensor) -> Tensor:
        return tsv_merge_matrix(taus, svd=svd, seed=seed)

    return map_keys(models, matrix_update_kernel(update, scaling, include, exclude, lazy=True), needs_base=True)


@register_merge("tsv_c", "compression: task t's model = base + its own top 1/T singular vectors (TSV-C, "
                "Gargiulo et al. 2025)")
def tsv_c(*, base: Any, experts: Sequence[Any], task: int = 0, scaling: float = 1.0,
          rank_ratio: float | None = None, svd: str = "exact", seed: int = 0, include: str | None = None,
          exclude: str | None = DEFAULT_EXCLUDE) -> dict[str, Tensor]:
    """TSV-C: ``theta_0 + alpha * SVD_k(Delta_task)`` per weight matrix, ``theta_0 + alpha * Delta_task`` for
    the other tensors (module docstring).

    Matches the official code's ``TSVC`` method (``compress_tv`` with ``sv_reduction = 1/T``, evaluated at
    ``scaling_coef = 1``); FusionBench's ``TaskSingularVectorCompression`` raises ``NotImplementedError``.
    Differences: the matrix rule (the official code compresses every 2-D tensor; ``include="."``) and the
    SVD dtype, as in :func:`tsv_m`.

    Args:
        task: whose model to rebuild (the task identity is known at inference).
        scaling: ``alpha`` (1.0: the official evaluation's).
        rank_ratio: ``k = floor(rank_ratio * min(m, n))``; ``None`` (default): ``1/T``, the paper's budget
            (``T`` compressed tasks take about one model's storage).
        svd, seed, include, exclude: as in :func:`tsv_m`.
    """
    check_svd_method(svd)
    models = open_models(base, experts)
    n = models.num_experts
    if not 0 <= task < n:
        raise ValueError(f"task must be in [0, {n}), got {task}")
    if rank_ratio is not None and not 0.0 <= rank_ratio <= 1.0:
        raise ValueError(f"rank_ratio must be in [0, 1] or None, got {rank_ratio}")

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        tau = task_matrices(b, [xs[task]])[0]
        if not is_lowrank_param(key, tuple(b.shape), exclude, include):
            return b.double() + scaling * tau.double()
        r = min(b.shape)
        k = r // n if rank_ratio is None else int(rank_ratio * r)
        if k >= r:
            return b.double() + scaling * tau.double()
        if k == 0:
            return b.double()
        u, s, vh = svd_factors(tau, k, method=svd, seed=seed + task)
        return b.double() + scaling * ((u * s) @ vh).double()

    return map_keys(models, kernel, needs_base=True)
