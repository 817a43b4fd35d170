"""TALL masks and Consensus merging (Wang et al. 2024, "Localizing Task Information for Improved Model
Merging and Compression").

TALL mask of task ``t`` (Eq. 5): ``m_t = 1{ |tau_t| > lambda_t * |tau_MTL - tau_t| }`` with ``tau_MTL`` the
merged multi-task vector (``sum_t tau_t`` for task arithmetic). Consensus mask (Eq. 7):
``m_cons = 1{ sum_t m_t >= k }``; Consensus TA: ``theta_0 + alpha * (m_cons * sum_t tau_t)``. TALL-mask +
TIES (Sec. 4, compression): task ``t``'s model is ``theta_0 + m_t * tau_TIES``, the TIES vector from the TIES
engine (:mod:`.ties`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ...utils.device import like_device
from .driver import CHUNK, map_keys, task_vectors64
from .registry import register_merge
from .sources import open_models
from .ties import global_trim, magnitude_threshold, plain_task_vectors, ties_tensor
from .trim import check_trim_rule, tensor_trim_spec

__all__ = ["tall_masks_tensor", "tall_masks", "consensus", "tall_mask_ties"]


def tall_masks_tensor(tvs: Tensor, multi: Tensor, tall_lambda: float) -> Tensor:
    """TALL masks of one key: ``|tau_t| > lambda |tau_MTL - tau_t|``, bool ``(T, *shape)``."""
    return tvs.abs() > tall_lambda * (multi.unsqueeze(0) - tvs).abs()


def tall_masks(*, base: Any, experts: Sequence[Any], tall_lambda: float = 0.4) -> list[dict[str, Tensor]]:
    """Per-task TALL masks over the floating keys (``tau_MTL = sum_t tau_t``): one bool dict per expert."""
    models = open_models(base, experts)
    out: list[dict[str, Tensor]] = [{} for _ in range(models.num_experts)]
    for key, b, xs in models.items():
        if models.is_float(key):
            tvs = task_vectors64(b, xs)
            for t, m in enumerate(tall_masks_tensor(tvs, tvs.sum(0), tall_lambda)):
                out[t][key] = m
    return out


@register_merge("consensus", "task arithmetic restricted to entries that at least k tasks' TALL masks select")
def consensus(*, base: Any, experts: Sequence[Any], k: int = 2, tall_lambda: float = 0.4,
              scaling: float = 0.3) -> dict[str, Tensor]:
    """Consensus TA, TALL-masks paper Eq. (7): ``theta_0 + alpha * (1{sum_t m_t >= k} * sum_t tau_t)``.

    Args:
        k: agreement threshold (paper default 2; ``k = 0`` is task arithmetic, ``k = 1`` drops "catastrophic"
            weights no task selects).
        tall_lambda: ``lambda`` of the TALL masks (paper searches 0.2..0.6, one value for all tasks here).
        scaling: ``alpha``.
    """
    models = open_models(base, experts)

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        tvs = task_vectors64(b, xs)
        multi = tvs.sum(0)
        votes = tall_masks_tensor(tvs, multi, tall_lambda).sum(0)
        return b.double() + scaling * torch.where(votes >= k, multi, torch.zeros_like(multi))

    # elementwise (masks, votes and the sum are per entry): cache-sized slices, not float64 model-sized stacks
    return map_keys(models, kernel, needs_base=True, chunk=CHUNK)


@register_merge("tall_mask_ties", "compression: the TIES vector masked per task by its TALL mask (task t's model)")
def tall_mask_ties(*, base: Any, experts: Sequence[Any], task: int = 0, density: float = 0.2,
                   scaling: float = 1.0, tall_lambda: float = 0.4, trim_scope: str = "global",
                   trim_rule: str = "exact") -> dict[str, Tensor]:
    """TALL-mask + TIES (TALL paper Sec. 4): ``theta_t = theta_0 + m_t * tau_MTL`` with ``tau_MTL`` the
    scaled TIES vector ``lambda * tau_m`` and ``m_t = 1{|tau_t| > tall_lambda |tau_MTL - tau_t|}``.

    Args:
        task: whose model to rebuild.
        density, scaling, trim_scope, trim_rule: TIES's hyperparameters (see ``ties``).
        tall_lambda: the TALL-mask ``lambda``.
    """
    models = open_models(base, experts)
    if not 0 <= task < models.num_experts:
        raise ValueError(f"task must be in [0, {models.num_experts}), got {task}")
    check_trim_rule(trim_rule)
    glob, gq = global_trim(models, density, plain_task_vectors, trim_rule) if trim_scope == "global" \
        else (None, None)

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        tvs = plain_task_vectors(key, b, xs, list(range(len(xs))))
        if glob is not None:
            thr, quotas = like_device(glob, tvs), None if gq is None else gq[key]
        elif trim_rule == "exact":
            thr, quotas = tensor_trim_spec(tvs.abs(), density)
        else:
            thr, quotas = torch.stack([magnitude_threshold(v.abs().reshape(-1), density) for v in tvs]), None
        multi = scaling * ties_tensor(tvs, thr, quotas=quotas)
        mask = tall_masks_tensor(tvs[task : task + 1].double(), multi, tall_lambda)[0]
        return b.double() + mask * multi

    return map_keys(models, kernel, needs_base=True)
