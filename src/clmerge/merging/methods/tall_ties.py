"""TALL-mask + TIES (Wang et al. 2024, compression): task ``t``'s model is ``theta_0 + m_t * tau_TIES``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ...utils.device import like_device
from .consensus import tall_masks_tensor
from .driver import map_keys
from .registry import register_merge
from .sources import open_models
from .ties import global_trim, magnitude_threshold, plain_task_vectors, ties_tensor
from .trim import check_trim_rule, tensor_trim_spec

__all__ = ["tall_mask_ties"]


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
