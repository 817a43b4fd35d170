"""EMR-merging (Huang et al. 2024, "EMR-Merging: Tuning-Free High-Performance Model Merging").

Elect a unified task vector, then per task a mask and a rescaler (Eqs. 1-5):

- ``gamma = sgn(sum_t tau_t)``; ``tau_uni = gamma * max_t { |tau_t| : sgn(tau_t) = gamma }`` (elect);
- ``M_t = 1{tau_t * tau_uni > 0}`` (mask);
- ``lambda_t = sum |tau_t| / sum |M_t * tau_uni|`` over all parameters (rescale);
- task ``t``'s model: ``theta_0 + lambda_t * M_t * tau_uni``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .driver import CHUNK, map_keys, task_vectors64
from .registry import register_merge
from .sources import open_models

__all__ = ["emr_merging", "emr_unified_tensor"]


def emr_unified_tensor(tvs: Tensor) -> Tensor:
    """``tau_uni`` of one key: elected sign times the largest same-sign magnitude (float64)."""
    sign = torch.sign(tvs.sum(0))
    same = (tvs * sign) > 0
    return sign * torch.where(same, tvs.abs(), torch.zeros_like(tvs)).amax(0)


@register_merge("emr_merging", "compression: unified task vector + per-task mask and rescaler (task t's model)")
def emr_merging(*, base: Any, experts: Sequence[Any], task: int = 0, rescale_mode: str = "sum") -> dict[str, Tensor]:
    """EMR-merging: task ``task``'s model ``theta_0 + lambda_t * M_t * tau_uni`` (module docstring).

    Args:
        task: whose model to rebuild.
        rescale_mode: ``"sum"``: ``lambda_t = sum|tau_t| / sum|M_t tau_uni|`` over all entries (paper
            Eq. 5); ``"mean_per_tensor"``: sums of per-tensor means (the official code and FusionBench,
            which weights small tensors more). Two passes over the keys.
    """
    if rescale_mode not in ("sum", "mean_per_tensor"):
        raise ValueError(f"rescale_mode must be 'sum' or 'mean_per_tensor', got {rescale_mode!r}")
    models = open_models(base, experts)
    if not 0 <= task < models.num_experts:
        raise ValueError(f"task must be in [0, {models.num_experts}), got {task}")
    num = torch.zeros((), dtype=torch.float64)
    den = torch.zeros((), dtype=torch.float64)
    for key, b, xs in models.items():
        if models.is_float(key):
            # sums over cache-sized slices (no float64 stack of the whole tensor); a mean is the sum / numel
            n_sum, d_sum = _rescale_sums(b, xs, task)
            scale = 1.0 if rescale_mode == "sum" else 1.0 / max(1, b.numel())
            num += n_sum * scale
            den += d_sum * scale
    rescale = num / den if den > 0 else torch.ones((), dtype=torch.float64)

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        tvs = task_vectors64(b, xs)
        uni = emr_unified_tensor(tvs)
        return b.double() + rescale * uni * ((tvs[task] * uni) > 0)

    return map_keys(models, kernel, needs_base=True, chunk=CHUNK)  # elementwise once lambda_t is known


def _rescale_sums(b: Tensor, xs: list[Tensor], task: int) -> tuple[Tensor, Tensor]:
    """``(sum |tau_task|, sum |M_task * tau_uni|)`` of one key, over flat slices of :data:`CHUNK` entries."""
    fb, fx = b.reshape(-1), [x.reshape(-1) for x in xs]
    num = torch.zeros((), dtype=torch.float64)
    den = torch.zeros((), dtype=torch.float64)
    for i in range(0, fb.numel(), CHUNK):
        tvs = task_vectors64(fb[i:i + CHUNK], [x[i:i + CHUNK] for x in fx])
        uni = emr_unified_tensor(tvs)
        num += tvs[task].abs().sum()
        den += (uni * ((tvs[task] * uni) > 0)).abs().sum()
    return num, den
