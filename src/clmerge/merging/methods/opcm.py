"""OPCM: continual model merging by orthogonal projection and norm-preserving rescaling (Tang et al., NeurIPS 2025,
"Merging Models on the Fly Without Retraining: A Sequential Approach to Scalable Continual Model Merging").

Experts arrive in order ``t = 1..T`` with task vectors ``tau_t = theta_t - theta_0``. Per weight matrix, the new
task vector is projected away from the principal subspace of the running merged task vector, then added; the
merged task vector is rescaled so that its norm is the mean norm of the task vectors seen so far (the paper's
adaptive scaling ``lambda_t``, which keeps the distance of the merge from ``theta_0`` stable):

- projection (paper Sec. 3, the projection of the new update onto the complement of the merged update's
  subspace): with the SVD ``tau_merged = U diag(s) V^T`` and ``r_alpha`` the number of leading singular values
  whose cumulative share ``sum_(j<=i) s_j / sum_j s_j`` is at most ``alpha``,
  ``P(tau) = tau - U_r (U_r^T tau V_r) V_r^T - sum_(i>r_alpha) (u_i^T tau v_i) u_i v_i^T``: the components of
  ``tau`` in the basis ``u_i v_j^T`` with ``i, j <= r_alpha`` are removed, and so is every diagonal component
  ``u_i v_i^T`` (``zero_diagonal``, as FusionBench's ``OPCMForCLIP.merge_linear_weights``);
- accumulation: ``S_1 = tau_1``, ``S_t = S_(t-1) + P_(t-1)(tau_t)`` for matrices, ``S_(t-1) + tau_t`` for the
  other tensors (biases, norms, embeddings);
- rescaling: ``lambda_t = ||S_t|| / mean_(i<=t) ||tau_i||`` over the whole model, and
  ``theta^_t = theta_0 + S_t / lambda_t``.

The merged task vector of step ``t - 1`` is ``S_(t-1) / lambda_(t-1)``; its singular vectors and the shares
``s_j / sum s`` do not depend on the scale, so projecting against ``S_(t-1)`` is the same, and only the running
sum ``S_t`` (one model's size) and the task-vector norms are kept. FusionBench's recursion
``theta^_t = theta_0 + (lambda_(t-1) tau^_(t-1) + P(tau_t)) / lambda_t`` unrolls to the same ``S_t / lambda_t``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ...utils.device import current_device
from .driver import map_keys, on_device
from ..io.checks import source_get
from .lowrank import DEFAULT_EXCLUDE, is_lowrank_param, thin_svd
from .order import expert_order
from .registry import register_merge
from .sources import open_models

__all__ = ["opcm", "opcm_split_rank", "opcm_project", "opcm_fold", "opcm_scale"]


def opcm_split_rank(s: Tensor, alpha: float) -> int:
    """``r_alpha``: how many leading singular values have a cumulative share of ``sum(s)`` at most ``alpha``.

    FusionBench takes the first index whose share exceeds ``alpha``
    (``(s.cumsum(0) / s.sum() > alpha).float().argmax()``), the same number for ``0 <= alpha < 1``.
    """
    total = float(s.sum())
    if total <= 0.0:
        return 0
    return int((s.cumsum(0) / total <= alpha).sum())


def opcm_project(merged: Tensor, tau: Tensor, *, alpha: float = 0.5, zero_diagonal: bool = True) -> Tensor:
    """``P(tau)``: ``tau`` without its components in the top-``r_alpha`` subspace of ``merged`` (module docstring).

    A thin SVD is enough: the basis ``u_i v_j^T`` of the full SVD that FusionBench uses only adds directions
    that are neither in the removed block nor on the diagonal. ``merged`` all zeros: ``tau`` unchanged.
    """
    if not bool(merged.any()):
        return tau.clone()
    u, s, vh = thin_svd(merged)
    k = opcm_split_rank(s, alpha)
    uk, vhk = u[:, :k], vh[:k]
    out = tau - uk @ (uk.T @ tau @ vhk.T) @ vhk
    if zero_diagonal:
        diag = ((u.T @ tau) * vh).sum(1)  # u_i^T tau v_i
        diag[:k] = 0.0  # already removed with the block
        out = out - (u * diag) @ vh
    return out


def opcm_fold(key: str, running: Tensor | None, tau: Tensor, *, alpha: float = 0.5, zero_diagonal: bool = True,
              include: str | None = None, exclude: str | None = DEFAULT_EXCLUDE) -> Tensor:
    """One arrival: ``S_t`` from ``S_(t-1)`` (``None`` before the first expert) and ``tau_t`` for one key."""
    if running is None:
        return tau.clone()
    if not is_lowrank_param(key, tuple(tau.shape), exclude, include):
        return running + tau
    return running + opcm_project(running, tau, alpha=alpha, zero_diagonal=zero_diagonal)


def opcm_scale(sum_sq: float, tau_sq: Sequence[float]) -> float:
    """``1 / lambda_t = mean_i ||tau_i|| / ||S_t||`` from ``||S_t||^2`` and the ``||tau_i||^2`` (0 if ``S_t = 0``)."""
    if sum_sq <= 0.0:
        return 0.0
    return sum(math.sqrt(x) for x in tau_sq) / len(tau_sq) / math.sqrt(sum_sq)


@register_merge("opcm", "continual merge: each expert in order projected away from the running merge's principal "
                "subspace, rescaled to the mean task-vector norm (OPCM, Tang et al. 2025)")
def opcm(*, base: Any, experts: Sequence[Any], alpha: float = 0.5, zero_diagonal: bool = True, shuffle: bool = False,
         seed: int = 0, include: str | None = None, exclude: str | None = DEFAULT_EXCLUDE) -> dict[str, Tensor]:
    """OPCM over an ORDERED expert list: the merge after the last arrival (module docstring).

    Matches FusionBench's ``OPCMForCLIP`` (``alpha`` 0.5 as its config) except: (1) ``shuffle`` is off, as the
    order given is the arrival order (FusionBench shuffles by default, unseeded; ``shuffle=True`` permutes with
    ``seed``); (2) which tensors are matrices: ``lowrank.is_lowrank_param`` (2-D ``*weight`` tensors, not
    embeddings or norms), where FusionBench projects every ``nn.Linear`` weight (``include="."`` projects every
    2-D tensor); (3) the norms of ``lambda_t`` run over the floating tensors this merge sees (with a recipe's
    key groups: per group); (4) in bfloat16/float16 the result is the float32 merge rounded once to the
    output dtype, where FusionBench rounds the parameters in the model's dtype at every arrival.

    Rounding once, and its memory: ``S_T`` is summed in float32 (float64 for float64 inputs) and rescaled
    there; only ``theta_0 + S_T / lambda_T`` is cast to the output dtype. ``lambda_T`` needs every key's
    ``S_T`` first, so a key's sum must outlive the first pass. For float32/float64 outputs the first pass's
    output is that sum (nothing changes: one pass, then the rescale reads it back). For a narrower output:
    without a sink (the Python API) the float32 sums are held, a float32 copy of the merged keys (twice a
    bf16 model; the caller already holds ``T + 1`` models); with a sink (``clmerge merge``) a key the sink
    stores narrower than its sum is merged again in a second pass (memory stays one key, the projections are
    paid twice). The old rule (``S_T`` rounded to bf16, then rescaled and rounded again) differed from the
    float32 merge on 292 of 4,096 entries of a 64 x 64 bf16 matrix with three experts (tested).

    Args:
        alpha: the energy threshold of ``r_alpha`` in ``[0, 1)`` (paper and FusionBench: 0.5).
        zero_diagonal: also remove the diagonal components ``u_i v_i^T`` (FusionBench; False: only the block).
        shuffle: merge in a seeded random order instead of the order given.
        seed: the seed of ``shuffle``.
        include, exclude: which keys are projected matrices, as in :func:`~clmerge.merging.methods.tsv.tsv_m`.
    """
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"alpha must be in [0, 1), got {alpha}")
    models = open_models(base, experts)
    order = expert_order(models.num_experts, shuffle, seed)
    norms = {"sum": 0.0, "tau": [0.0] * models.num_experts}
    streaming = getattr(models, "sink", None) is not None
    held: dict[str, Tensor] = {}  # float32 S_T of the keys whose output dtype is narrower (no sink)
    sum_dtype: dict[str, torch.dtype] = {}  # the dtype each key's S_T was accumulated in

    def running_sum(key: str, b: Tensor, xs: list[Tensor], count: bool) -> Tensor:
        dtype = torch.promote_types(b.dtype, torch.float32)
        running = None
        for i in order:
            tau = xs[i].to(dtype) - b.to(dtype)
            if count:
                norms["tau"][i] += float(tau.double().pow(2).sum())
            running = opcm_fold(key, running, tau, alpha=alpha, zero_diagonal=zero_diagonal, include=include,
                                exclude=exclude)
        if count:
            norms["sum"] += float(running.double().pow(2).sum())
        return running

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        running = running_sum(key, b, xs, True)
        sum_dtype[key] = running.dtype
        if not streaming and xs[0].dtype != running.dtype:
            held[key] = running.cpu()  # the cast map_keys makes would round S_T before the rescaling
        return running

    out = map_keys(models, kernel, needs_base=True)
    scale = opcm_scale(norms["sum"], norms["tau"])

    def final(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:  # pass 2 of a streamed narrow key
        running = running_sum(key, b, xs, False)
        return b.to(running.dtype) + scale * running

    device = current_device()
    for key in models.keys():
        if not models.is_float(key):
            continue
        if key in held:
            s_t = held.pop(key)
            b = source_get(models.base, key).to(s_t.dtype)
            out[key] = (b + scale * s_t).to(out[key].dtype)
            continue
        cur = out[key]
        if cur.dtype != sum_dtype[key]:  # the sink stores S_T narrower than it was summed: recompute it
            b, xs = models.load(key, check=False)
            if device is not None:
                out[key] = on_device(device, final, key, b, xs, None)
            else:
                out[key] = final(key, b, xs).to(xs[0].dtype).contiguous()
            del b, xs
            continue
        b = source_get(models.base, key)
        dtype = torch.promote_types(b.dtype, torch.float32)
        out[key] = (b.to(dtype) + scale * cur.to(dtype)).to(cur.dtype)
    return out
