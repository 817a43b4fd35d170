"""Isotropic merging (Marczak et al., ICML 2025, "No Task Left Behind: Isotropic Model Merging with Common and
Task-Specific Subspaces"): Iso-C and Iso-CTS.

Per weight matrix, with ``Delta_t = theta_t - theta_0`` and ``r = min(m, n)``:

- Iso-C: ``Delta_TA = sum_t Delta_t = U S V^T``; the merged update is
  ``alpha * sigma_bar U V^T`` with ``sigma_bar = mean(diag S)`` over all ``r`` singular values (a flat
  spectrum; ``sigma_bar U V^T`` is ``sigma_bar`` times the polar factor of ``Delta_TA``).
- Iso-CTS: the common subspace is the top ``k_c`` singular triplets of ``Delta_TA``; each
  task's residual ``Delta_t - U_c U_c^T Delta_t`` (its part outside the common left subspace) gives its top
  ``s`` triplets; the ``k_c + T s = r`` left (right) vectors are concatenated and orthogonalised by their
  polar factor (orthogonal Procrustes, by an SVD), and the update is
  ``alpha * sigma_bar U_perp V_perp^T`` with ``sigma_bar`` the mean of the ``r`` concatenated singular values.
  Sizes as in the released code: ``k_c = int(r * common_space_fraction)``,
  ``s = round((r - k_c) / T)``, then ``k_c = r - T s`` (so the task-specific part divides evenly by ``T``).

Other tensors (biases, norms, and the 2-D tensors the matrix rule excludes) get
``theta_0 + alpha * mean_t Delta_t``, as FusionBench's ``iso_c`` / ``iso_cts``.

Iso-C needs every singular value, so its SVD is exact (float32, or float64 for float64 inputs); so is
Iso-CTS's SVD of ``Delta_TA``. Iso-CTS's residual SVDs keep ``s`` triplets (about ``0.2 r / T``) and may
be randomized (``svd="randomized"``, error bound in :mod:`clmerge.merging.methods.tsv`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .driver import map_keys
from .lowrank import (DEFAULT_EXCLUDE, TaskMatrices, check_svd_method, matrix_update_kernel, polar_factor,
                      svd_factors, thin_svd)
from .registry import register_merge
from .sources import open_models

__all__ = ["iso_c", "iso_cts", "iso_c_matrix", "iso_cts_matrix", "iso_cts_ranks"]


def iso_c_matrix(taus: Tensor) -> Tensor:
    """Iso-C's update ``sigma_bar U V^T`` of one matrix from its task matrices ``(T, m, n)``."""
    u, s, vh = thin_svd(taus.sum(0))
    return (u * s.mean()) @ vh


def iso_cts_ranks(r: int, num_tasks: int, fraction: float) -> tuple[int, int]:
    """``(k_c, s)``: the common rank and each task's specific rank, ``k_c + num_tasks * s = r``.

    As the released code, except that ``s`` is capped at ``r // num_tasks`` (there ``k_c`` turns negative
    when ``r - int(r * fraction)`` rounds up past ``r`` in multiples of ``num_tasks``: ``r = 2``, 3 tasks).
    """
    k_c = int(r * fraction)
    s = min(round((r - k_c) / num_tasks), r // num_tasks)
    return r - num_tasks * s, s


def iso_cts_matrix(taus: Tensor | TaskMatrices, fraction: float, *, svd: str = "exact", seed: int = 0) -> Tensor:
    """Iso-CTS's update ``sigma_bar U_perp V_perp^T`` of one matrix from its task matrices ``(T, m, n)``
    (with ``svd="randomized"``: by :func:`_iso_cts_lean`, which also takes a ``TaskMatrices``)."""
    k_c, s = iso_cts_ranks(min(taus.shape[1:]), len(taus), fraction)
    if svd == "randomized" and s > 0:
        return _iso_cts_lean(taus, k_c, s, seed)
    u, sv, vh = thin_svd(taus.sum(0))
    if s == 0:  # the common subspace is everything: Iso-C (the polar factor of U is U itself)
        return (u * sv.mean()) @ vh
    uc = u[:, :k_c]
    us, ss, vhs = [uc], [sv[:k_c]], [vh[:k_c]]
    for t, tau in enumerate(taus):
        a, b, c = svd_factors(tau - uc @ (uc.T @ tau), s, method=svd, seed=seed + t)
        us.append(a)
        ss.append(b)
        vhs.append(c)
    sigma = torch.cat(ss).mean()
    return (polar_factor(torch.cat(us, dim=1)) * sigma) @ polar_factor(torch.cat(vhs, dim=0))


def _iso_cts_lean(taus: Tensor | TaskMatrices, k_c: int, s: int, seed: int) -> Tensor:
    """Iso-CTS with randomized residual SVDs, one task matrix at a time, and the left polar factor by
    blocks: each residual ``tau_t - U_c U_c^T tau_t`` has its column space outside ``span(U_c)``, so the
    concatenation ``[U_c, U_1, ..., U_T]`` has the Gram matrix ``diag(I, G)`` and its polar factor is
    ``[U_c, polar([U_1, ..., U_T])]``: one polar factor of ``m x Ts`` (``Ts`` about ``0.2 r``) instead of
    ``m x r``. Equal to the exact path up to the randomized SVDs and rounding."""
    total = taus.sum() if isinstance(taus, TaskMatrices) else taus.sum(0)
    u, sv, vh = thin_svd(total)
    del total
    uc = u[:, :k_c].clone()
    ss, vhs = [sv[:k_c]], [vh[:k_c]]
    del u, vh
    us = []
    for t in range(len(taus)):
        tau = taus[t] if isinstance(taus, TaskMatrices) else taus[t].clone()  # a fresh tensor: edited in place
        tau.sub_(uc @ (uc.T @ tau))
        a, b, c = svd_factors(tau, s, method="randomized", seed=seed + t)
        del tau
        us.append(a)
        ss.append(b)
        vhs.append(c)
    sigma = torch.cat(ss).mean()
    cat = torch.cat(us, dim=1)
    us.clear()
    u_perp = torch.cat([uc, polar_factor(cat)], dim=1).mul_(sigma)
    del uc, cat
    cat = torch.cat(vhs, dim=0)
    vhs.clear()
    return u_perp @ polar_factor(cat)


@register_merge("iso_c", "isotropic merge: the summed task matrix with its singular values flattened to "
                "their mean (Iso-C, Marczak et al. 2025)")
def iso_c(*, base: Any, experts: Sequence[Any], scaling: float = 1.0, include: str | None = None,
          exclude: str | None = DEFAULT_EXCLUDE) -> dict[str, Tensor]:
    """Iso-C: ``theta_0 + alpha * sigma_bar U V^T`` per weight matrix (module docstring).

    Matches FusionBench's ``IsotropicMergingInCommonSubspace`` (``iso_c``), except which tensors are
    matrices: FusionBench takes every 2-D tensor not in ``exclude_keys`` (``include="."`` reproduces it).

    Args:
        scaling: ``alpha`` (FusionBench's default 1.0; the paper selects it on validation data).
        include: regex of keys treated as matrices, replacing the default rule (``"."``: every 2-D tensor).
        exclude: regex of 2-D ``*weight`` keys treated as non-matrix tensors (default: embeddings, norms).
    """
    models = open_models(base, experts)
    return map_keys(models, matrix_update_kernel(iso_c_matrix, scaling, include, exclude), needs_base=True)


@register_merge("iso_cts", "isotropic merge in a common subspace plus task-specific subspaces (Iso-CTS, "
                "Marczak et al. 2025)")
def iso_cts(*, base: Any, experts: Sequence[Any], scaling: float = 1.0, common_space_fraction: float = 0.8,
            svd: str = "exact", seed: int = 0, include: str | None = None,
            exclude: str | None = DEFAULT_EXCLUDE) -> dict[str, Tensor]:
    """Iso-CTS: ``theta_0 + alpha * sigma_bar U_perp V_perp^T`` per weight matrix (module docstring).

    ``common_space_fraction = 1`` is Iso-C. Matches FusionBench's ``IsotropicMergingInCommonAndTaskSubspace``
    (``iso_cts``), except the matrix rule (as in :func:`iso_c`) and the cap on the task-specific rank
    (:func:`iso_cts_ranks`), which only acts when ``min(m, n)`` is below about the number of tasks.

    Args:
        scaling: ``alpha`` (FusionBench's default 1.0; the paper selects it on validation data).
        common_space_fraction: the share of the rank given to the common subspace (paper default 0.8).
        svd: ``"exact"`` or ``"randomized"`` SVDs of the task residuals (the common SVD is always exact).
        seed: seed of the randomized SVD (task ``t`` uses ``seed + t``).
        include, exclude: as in :func:`iso_c`.
    """
    if not 0.0 <= common_space_fraction <= 1.0:
        raise ValueError(f"common_space_fraction must be in [0, 1], got {common_space_fraction}")
    check_svd_method(svd)
    models = open_models(base, experts)

    def update(taus: Tensor) -> Tensor:
        return iso_cts_matrix(taus, common_space_fraction, svd=svd, seed=seed)

    kernel = matrix_update_kernel(update, scaling, include, exclude, lazy=svd == "randomized")
    return map_keys(models, kernel, needs_base=True)
