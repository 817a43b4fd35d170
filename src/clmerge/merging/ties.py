"""TIES-merging (Yadav et al. 2023): trim, elect sign, disjoint merge.

``density`` is the fraction of each task vector kept by magnitude over the **whole** task vector, as in the
original TIES code (``trim_scope="global"``). The global threshold of expert ``t`` is found from that expert's
magnitudes alone (one model's worth of numbers at a time), never from an N x d stack of all experts; the merge
itself then runs key by key. ``trim_scope="per_tensor"`` trims each tensor separately (no global pass).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .driver import bshape, map_keys
from .registry import register_merge
from .sources import ModelSet, open_models

__all__ = ["ties", "ties_tensor", "global_magnitude_thresholds", "magnitude_threshold", "TaskVectorFn"]

# (key, base, experts, expert indices) -> task vectors of those experts for that key, shape (len, *shape)
TaskVectorFn = Callable[[str, Tensor, list[Tensor], list[int]], Tensor]


def plain_task_vectors(key: str, base: Tensor, experts: list[Tensor], idx: list[int]) -> Tensor:
    """``theta_t - theta_0`` in float32, shape ``(T, *shape)`` (float32, as the TIES reference code)."""
    return torch.stack([e.float() for e in experts]) - base.float()


def magnitude_threshold(magnitudes: Tensor, density: float) -> Tensor:
    """The TIES trim threshold: the ``(d - floor(density*d))``-th smallest of ``magnitudes`` (flat).

    Entries ``>= threshold`` are kept, which is the rule of the TIES and FusionBench code (it keeps
    ``floor(density*d) + 1`` entries when values are distinct). ``density >= 1`` keeps everything.
    """
    d = magnitudes.numel()
    k = d - int(d * density)
    if density >= 1.0 or k <= 0:
        return torch.tensor(0.0, dtype=magnitudes.dtype)
    return magnitudes.kthvalue(k).values


def global_magnitude_thresholds(models: ModelSet, density: float, tv_fn: TaskVectorFn) -> Tensor:
    """Per-expert global trim thresholds, shape ``(T,)`` (the global-top-k pass of TIES).

    Expert by expert, the magnitudes of its whole task vector (all floating keys) are gathered in one flat
    float32 buffer and the threshold is read off with ``kthvalue``: peak extra memory is one model.
    """
    keys = [k for k in models.keys() if models.is_float(k)]
    total = sum(int(torch.Size(models.meta(k)[0]).numel()) for k in keys)
    out = torch.empty(models.num_experts, dtype=torch.float32)
    buf = torch.empty(total, dtype=torch.float32)
    for t in range(models.num_experts):
        pos = 0
        for key in keys:
            base = models.base.get(key)
            tv = tv_fn(key, base, [models.experts[t].get(key)], [t])[0].abs().reshape(-1)
            buf[pos:pos + tv.numel()] = tv
            pos += tv.numel()
        out[t] = magnitude_threshold(buf, density)
    return out


def ties_tensor(tvs: Tensor, thresholds: Tensor, *, merge_fn: str = "mean") -> Tensor:
    """TIES on one key: trim at ``thresholds``, elect the sign, merge the agreeing entries.

    Args:
        tvs: task vectors ``(T, *shape)``.
        thresholds: ``(T,)``; entries with ``|tau| >= threshold`` survive the trim.
        merge_fn: ``"mean"`` (disjoint mean, the paper), ``"sum"`` or ``"max"`` (FusionBench options).

    Returns:
        The merged task vector ``tau_m`` (float64): ``gamma = sgn(sum_t tau_hat_t)`` (ties at 0 broken by the
        majority sign of this tensor), then the mean over ``{t : sgn(tau_hat_t) = gamma}``.
    """
    trimmed = torch.where(tvs.abs() >= bshape(thresholds.to(tvs.dtype), tvs), tvs, torch.zeros_like(tvs))
    trimmed = trimmed.double()
    sign = torch.sign(trimmed.sum(0))
    majority = torch.sign(sign.sum())
    sign = torch.where(sign == 0, majority, sign)
    agree = torch.where(sign > 0, trimmed > 0, trimmed < 0)
    selected = trimmed * agree
    if merge_fn == "mean":
        return selected.sum(0) / agree.sum(0).clamp(min=1)
    if merge_fn == "sum":
        return selected.sum(0)
    if merge_fn == "max":
        return selected.abs().amax(0) * sign
    raise ValueError(f"merge_fn must be 'mean', 'sum' or 'max', got {merge_fn!r}")


def ties_from_task_vectors(models: ModelSet, tv_fn: TaskVectorFn, *, density: float, scaling: float,
                           trim_scope: str, merge_fn: str) -> dict[str, Tensor]:
    """The TIES pipeline over any task-vector transform (plain for TIES, dropped-and-rescaled for DARE)."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    if trim_scope not in ("global", "per_tensor"):
        raise ValueError(f"trim_scope must be 'global' or 'per_tensor', got {trim_scope!r}")
    if models.base is None:
        raise ValueError("TIES needs base= (the pretrained parameters)")
    glob = global_magnitude_thresholds(models, density, tv_fn) if trim_scope == "global" else None

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        tvs = tv_fn(key, b, xs, list(range(len(xs))))
        thr = glob if glob is not None else torch.stack([magnitude_threshold(v.abs().reshape(-1), density)
                                                         for v in tvs])
        return b.double() + scaling * ties_tensor(tvs, thr, merge_fn=merge_fn)

    return map_keys(models, kernel, needs_base=True)


@register_merge("ties", "trim small task-vector entries, elect a sign per entry, average the agreeing ones")
def ties(*, base: Any, experts: Sequence[Any], density: float = 0.2, scaling: float = 1.0,
         trim_scope: str = "global", merge_fn: str = "mean") -> dict[str, Tensor]:
    """TIES-merging, Yadav et al. 2023, Eq. / Alg. 1: ``theta_0 + lambda * tau_m``.

    1. trim: ``tau_hat_t`` keeps the top-``density`` magnitudes of ``tau_t`` (others set to 0);
    2. elect: ``gamma = sgn(sum_t tau_hat_t)``;
    3. disjoint mean: ``tau_m = mean_{t: sgn(tau_hat_t) = gamma} tau_hat_t``.

    Args:
        density: fraction of each task vector kept (paper's ``k``: 20%).
        scaling: ``lambda`` (paper: 1.0 works well; select on validation).
        trim_scope: ``"global"`` (whole task vector, the paper and its code) or ``"per_tensor"``.
        merge_fn: ``"mean"`` (paper), ``"sum"`` or ``"max"``.
    """
    models = open_models(base, experts)
    return ties_from_task_vectors(models, plain_task_vectors, density=density, scaling=scaling,
                                  trim_scope=trim_scope, merge_fn=merge_fn)
