"""KnOTS (Stoica et al., ICLR 2025, "Model merging with SVD to tie the KnOTS"): merge task updates in the
shared basis of their concatenation.

Per weight matrix, with ``Delta_t = theta_t - theta_0`` (``m x n``; for a LoRA adapter
``Delta_t = s_t B_t A_t``):

1. SVD of the concatenation ``[Delta_1 | ... | Delta_T] = U S [V_1^T | ... | V_T^T]`` (``m x Tn``), keeping
   the singular triplets in the support (the zero-singular-value directions of a low-rank concatenation would
   be arbitrary), so ``Delta_t = U (S V_t^T)`` exactly up to that support. The support is relative by default,
   ``s > SUPPORT_REL_EPS * s_max`` (``1e-5`` times the key's largest singular value); ``support="absolute"``
   is the official code's ``s > 1e-5`` (``task_merger.py`` ``SVDMerger.apply_svd``, lines 305-307 at
   ``gstoica27/KnOTS`` ``baa35e8``), under which an update whose singular values are all below ``1e-5`` (a
   matrix changed by less than that: small learning rates, bf16 adapters of tiny norm) has an empty basis
   and is silently left at the base;
2. the task representations ``R_t = S V_t^T`` (``r x n``, the official ``s_on_V``) are merged by TIES, DARE
   (then TIES) or TA into ``R_m`` (each with its scaling ``lambda`` inside, as the code does);
3. the merged update ``U R_m`` is added to ``theta_0``.

TIES trims each task's ``R_t`` to its top-``density`` magnitudes over all weight matrices together (the
code's flattened ``topK`` per task, keeping ``|x| >=`` the threshold), elects ``sgn(sum_t trimmed R_t)`` per
entry and takes the disjoint mean; DARE drops each entry of ``R_t`` with probability ``p`` and rescales by
``1/(1 - p)`` before that TIES. ``merge="ta"`` is KnOTS-TA, the official ``tv`` merge in the joint basis:
``R_m = lambda sum_t R_t``, so ``U R_m = lambda U U^T sum_t Delta_t``, which is task arithmetic
(``theta_0 + lambda sum_t Delta_t``, Ilharco et al. 2023) up to the support: the basis changes nothing for a
linear merge, except that the part of each ``Delta_t`` outside the kept singular directions is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ...utils.device import like_device
from .dare import dare_generator, dare_tensor
from .driver import map_keys
from .lowrank import DEFAULT_EXCLUDE, is_lowrank_param, task_matrices, thin_svd
from .registry import register_merge
from .sources import ModelSet, open_models
from .ties import magnitude_threshold, ties_tensor

__all__ = ["knots", "knots_basis", "KNOTS_DEFAULTS", "SUPPORT_EPS", "SUPPORT_REL_EPS", "SUPPORTS"]

SUPPORT_EPS = 1e-5  # support="absolute": s > SUPPORT_EPS (the official code's ``s > 1e-5``, float64 SVD)
# support="relative" (default): s > SUPPORT_REL_EPS * s_max. 1e-5 of the largest singular value: a direction
# below it carries under 1e-5 of the update's largest direction, and the Gram route's own rounding (eigenvalue
# errors of about m * 2.2e-16 * s_max^2, so singular values of about 1e-6 s_max for m = 4096) stays below it.
SUPPORT_REL_EPS = 1e-5
SUPPORTS = ("relative", "absolute")
# The official configs per merge (ViT-B/32, rank 16): knots_ties topK 20, scaling 0.6; knots_dare_ties
# topK 100 (no trim), dare_pruning_coeffs 0.1, scaling 0.7; TA at scaling 1.
KNOTS_DEFAULTS = {"ties": {"density": 0.2, "scaling": 0.6}, "dare": {"density": 1.0, "scaling": 0.7},
                  "ta": {"density": 1.0, "scaling": 1.0}}

RepFn = Callable[[str, Tensor, bool], tuple[Tensor | None, Tensor]]


def knots_basis(taus: Tensor, eps: float | None = None, support: str = "relative") -> tuple[Tensor, Tensor]:
    """``(U (m, r), R (T, r, n))`` with ``R_t = S V_t^T`` from the SVD of ``[Delta_1 | ... | Delta_T]`` (in
    float64, as the official code; the factors are returned in ``taus``' dtype), ``r`` = singular values
    ``> eps * s_max`` (``support="relative"``, ``eps`` default :data:`SUPPORT_REL_EPS`) or ``> eps``
    (``support="absolute"``, ``eps`` default :data:`SUPPORT_EPS`, the official rule). An all-zero
    concatenation has ``r = 0`` under both.

    ``U`` (the left singular vectors) is computed, when ``m <= T n``, as the eigenvectors of the Gram matrix
    ``sum_t Delta_t Delta_t^T = U S^2 U^T`` with eigenvalues ``> eps^2``: the same basis up to the sign of
    each column (and a rotation within repeated singular values, as for any SVD routine), which the merge does
    not see: flipping column ``i`` of ``U`` flips row ``i`` of every ``R_t``, and trim, sign election and mean
    all commute with that. It costs one ``m x m`` eigendecomposition instead of the SVD of an ``m x Tn``
    matrix (``knots`` on one 768 x 3072 matrix, 8 full-rank tasks, 1 thread: 27 s instead of 105 s, measured).

    ``R_t`` is computed as ``U^T Delta_t`` (equal to ``S V_t^T`` as ``Delta_t = U S V_t^T``): exactly 0 for a
    task that leaves the matrix unchanged (an adapter that does not target the module), where the SVD's block
    ``V_t`` carries rounding noise (about 1e-17) that TIES's disjoint mean would count as an agreeing task and
    so halve the other task's update (measured on a two-adapter merge).
    """
    if support not in SUPPORTS:
        raise ValueError(f"support must be one of {', '.join(SUPPORTS)}, got {support!r}")
    relative = support == "relative"
    eps = (SUPPORT_REL_EPS if relative else SUPPORT_EPS) if eps is None else eps
    num, m, n = taus.shape
    x = taus.to(torch.float64)
    if m <= num * n:  # U from the m x m Gram matrix [D_1 ... D_T][D_1 ... D_T]^T = sum_t D_t D_t^T
        gram = torch.zeros(m, m, dtype=torch.float64)
        for d in x:
            gram.addmm_(d, d.T)
        lam, vecs = torch.linalg.eigh(gram)  # ascending; lam = s^2
        cut = eps * eps * (max(float(lam[-1]), 0.0) if relative and m else 1.0)
        u = vecs[:, lam > cut].flip(1)
    else:
        u, s, _ = thin_svd(x.permute(1, 0, 2).reshape(m, num * n))
        u = u[:, s > eps * (float(s[0]) if relative and s.numel() else 1.0)]
    return u.to(taus.dtype), (u.T @ x).to(taus.dtype)


def _rep_fn(merge: str, drop_rate: float, seed: int, support: str = "relative") -> RepFn:
    """``fn(key, taus, matrix) -> (U or None, R)``: the basis and task representations of one key (a
    non-matrix tensor is its own representation), DARE-dropped when ``merge == "dare"`` (masks depend on seed,
    key and task)."""

    def reps(key: str, taus: Tensor, matrix: bool) -> tuple[Tensor | None, Tensor]:
        u, r = knots_basis(taus, support=support) if matrix else (None, taus.clone())
        if merge == "dare":
            for t, row in enumerate(r):
                dare_tensor(row, drop_rate, rescale=True, generator=dare_generator(seed, key, t), out=row)
        return u, r

    return reps


def _thresholds(reps: Tensor, density: float) -> Tensor:
    """Per-task trim thresholds ``(T,)`` of one key's (or all keys' flattened) representations."""
    return torch.stack([magnitude_threshold(r.abs().reshape(-1), density) for r in reps])


def _global_thresholds(models: ModelSet, is_matrix: Callable[[str], bool], rep_fn: RepFn,
                       density: float) -> Tensor:
    """Per-task thresholds over the representations of every weight matrix (the official code's flattened
    ``topK``): a first pass over the keys that keeps each task's ``|R_t|`` (``T r n`` floats per matrix)."""
    mags: list[list[Tensor]] = [[] for _ in range(models.num_experts)]
    for key in models.keys():
        if not (models.is_float(key) and is_matrix(key)):
            continue
        b, xs = models.load(key)
        reps = rep_fn(key, task_matrices(b, xs), True)[1]
        for t, r in enumerate(reps):
            mags[t].append(r.abs().reshape(-1))
        del b, xs, reps
    return torch.stack([magnitude_threshold(torch.cat(m) if m else torch.zeros(0), density) for m in mags])


def _merge_reps(reps: Tensor, merge: str, thresholds: Tensor, scaling: float) -> Tensor:
    """``R_m``: ``lambda sum_t R_t`` (TA), or ``lambda`` times the TIES merge of ``R`` trimmed at
    ``thresholds`` (TIES; DARE, whose drop is already in ``R``)."""
    if merge == "ta":
        return scaling * reps.sum(0)
    return scaling * ties_tensor(reps, thresholds, merge_fn="mean")


def _check(merge: str, density: float, drop_rate: float, trim_scope: str, support: str) -> None:
    if support not in SUPPORTS:
        raise ValueError(f"support must be one of {', '.join(SUPPORTS)}, got {support!r}")
    if merge not in KNOTS_DEFAULTS:
        raise ValueError(f"merge must be one of {', '.join(KNOTS_DEFAULTS)}, got {merge!r}")
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    if not 0.0 <= drop_rate < 1.0:
        raise ValueError(f"drop_rate must be in [0, 1), got {drop_rate}")
    if trim_scope not in ("global", "per_tensor"):
        raise ValueError(f"trim_scope must be 'global' or 'per_tensor', got {trim_scope!r}")


@register_merge("knots", "merge task updates (LoRA adapters) in the SVD basis of their concatenation with "
                "TIES, DARE or TA (KnOTS, Stoica et al. 2025)")
def knots(*, base: Any, experts: Sequence[Any], merge: str = "ties", density: float | None = None,
          scaling: float | None = None, drop_rate: float = 0.1, trim_scope: str = "global", seed: int = 0,
          support: str = "relative", include: str | None = None,
          exclude: str | None = DEFAULT_EXCLUDE) -> dict[str, Tensor]:
    """KnOTS: ``theta_0 + U R_m`` per weight matrix (module docstring).

    Experts are PEFT adapters (``Delta_t = s_t B_t A_t`` over the base, the path of every adapter merge) or
    full models (``Delta_t = theta_t - theta_0``). Matches the official ``gstoica27/KnOTS`` ``SVDMerger``
    (``representation: svd-vector``, ``s_on_V``, ``concat_across_output``, ``merging_type: mean``) except:
    (1) tensors outside the weight matrices (biases, norms: only full models have changed ones) get the same
    merge on their own task vectors, trimmed per tensor; the official code merges only the LoRA modules;
    (2) an entry whose trimmed sum is exactly 0 over nonzero values takes the majority sign of its matrix,
    the official code that of the whole model; (3) DARE's masks come from this library's seeded generator;
    (4) the support of the basis is relative by default (``support``; module docstring).

    Args:
        merge: ``"ties"`` (KnOTS-TIES, the paper's main method), ``"dare"`` (KnOTS-DARE-TIES) or ``"ta"``
            (KnOTS-TA: ``lambda sum_t R_t`` in the joint basis, i.e. task arithmetic restricted to the
            support; the official ``tv``).
        density: fraction of each task's representation kept by TIES's trim (official ``topK / 100``);
            ``None``: the official config of ``merge`` (ties 0.2, dare 1.0 = no trim).
        scaling: ``lambda``; ``None``: the official config (ties 0.6, dare 0.7, ta 1.0; selected on
            validation in the paper).
        drop_rate: DARE's ``p`` (official 0.1); used only with ``merge="dare"``.
        trim_scope: ``"global"`` (top-k over all weight matrices' representations of a task, the official
            code: a first pass over the keys) or ``"per_tensor"`` (each matrix on its own, one pass).
        seed: DARE's masks depend only on (seed, key, task).
        support: which singular directions of each matrix's concatenation form the basis: ``"relative"``
            (``s > 1e-5 * s_max``, :data:`SUPPORT_REL_EPS`; an update of any scale keeps its directions) or
            ``"absolute"`` (``s > 1e-5``, the official code: an update whose singular values are all below
            ``1e-5`` is dropped, the matrix left at the base).
        include: regex of keys treated as matrices, replacing the default rule (``"."``: every 2-D tensor).
        exclude: regex of 2-D ``*weight`` keys treated as non-matrix tensors (default: embeddings, norms).
    """
    defaults = KNOTS_DEFAULTS.get(merge, {})
    density = defaults.get("density", 1.0) if density is None else density
    scaling = defaults.get("scaling", 1.0) if scaling is None else scaling
    _check(merge, density, drop_rate, trim_scope, support)
    models = open_models(base, experts)
    rep_fn = _rep_fn(merge, drop_rate, seed, support)

    def is_matrix(key: str) -> bool:
        return is_lowrank_param(key, tuple(models.meta(key)[0]), exclude, include)

    glob = None
    if merge != "ta" and trim_scope == "global" and density < 1.0:
        glob = _global_thresholds(models, is_matrix, rep_fn, density)

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        matrix = is_matrix(key)
        u, reps = rep_fn(key, task_matrices(b, xs), matrix)
        thr = like_device(glob, reps) if matrix and glob is not None else _thresholds(reps, density)
        merged = _merge_reps(reps, merge, thr, scaling)
        return b.double() + (merged if u is None else u @ merged).double()

    return map_keys(models, kernel, needs_base=True)
