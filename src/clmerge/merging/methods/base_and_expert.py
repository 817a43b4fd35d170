"""mergekit's merges of a base and one expert.

- NearSwap (the QuartetAnemoi-70B recipe, as mergekit's ``nearswap``): move the base toward a second model by at
  most ``t`` per entry, so entries where the two nearly agree take the second model's value.
- Arcee Fusion (mergekit's ``arcee_fusion``): take the expert's value only where its change from the base is
  important, with importance = change size times the KL divergence of the rows' softmax, and "important" an
  upper-outlier test (median + 1.5 IQR, Tukey's fence).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ...errors import UsageError
from .driver import map_keys
from .registry import register_merge
from .sources import ModelSet, open_models

__all__ = ["nearswap", "nearswap_tensor", "one_expert", "arcee_fusion", "fusion_importance", "fusion_threshold",
           "KL_EPS"]


def nearswap_tensor(t: float, v0: Tensor, v1: Tensor) -> Tensor:
    """``w v1 + (1 - w) v0`` with ``w = clip(t / |v0 - v1|, 0, 1)`` entrywise (``w = 1`` where ``v0 = v1``):
    each entry moves from ``v0`` toward ``v1`` by ``min(t, |v1 - v0|)``."""
    a, b = v0.double(), v1.double()
    w = torch.nan_to_num(t / (a - b).abs(), nan=1.0, posinf=1.0, neginf=1.0).clamp(0.0, 1.0)
    return w * b + (1.0 - w) * a


def one_expert(name: str, models: ModelSet) -> None:
    """Raise a one-line usage error unless ``models`` is a base and exactly one expert."""
    if models.base is None or models.num_experts != 1:
        raise UsageError(f"{name} needs base= and exactly one expert, got {models.num_experts} expert(s)"
                         + ("" if models.base is not None else " and no base"))


@register_merge("nearswap", "move the base toward one expert by at most t per entry (mergekit's nearswap)")
def nearswap(*, base: Any, experts: Sequence[Any], t: float = 1e-4) -> dict[str, Tensor]:
    """NearSwap: :func:`nearswap_tensor` with ``v0`` the base and ``v1`` the one expert.

    Args:
        t: the sameness threshold, > 0 (mergekit's ``t``, required there; 1e-4 is the value of the
            QuartetAnemoi-70B-t0.0001 recipe the method comes from).
    """
    if not t > 0.0:
        raise ValueError(f"t must be > 0, got {t}")
    models = open_models(base, experts)
    one_expert("nearswap", models)
    return map_keys(models, lambda key, b, xs: nearswap_tensor(t, b, xs[0]), needs_base=True)


KL_EPS = 1e-8  # added to both softmax distributions before the log (mergekit's value)


def fusion_importance(x: Tensor, b: Tensor) -> Tensor:
    """``|x - b| * KL(p || q)`` with ``p = softmax(x) + 1e-8``, ``q = softmax(b) + 1e-8`` along the last
    dimension (one KL value per row, broadcast over it; a 1-D tensor is one row). Float64."""
    x, b = x.double(), b.double()
    p = torch.softmax(x, dim=-1) + KL_EPS
    q = torch.softmax(b, dim=-1) + KL_EPS
    kl = (p * torch.log(p / q)).sum(-1, keepdim=True)
    return (x - b).abs() * kl


def fusion_threshold(importance: Tensor) -> Tensor:
    """``median + 1.5 (q3 - q1)`` of the flat ``importance``, each quantile the sorted entry at index
    ``floor(q (n - 1))`` (mergekit's rule; it reads them off a random sample of 1e6 entries for larger
    tensors, here always exactly)."""
    flat = importance.reshape(-1)
    n = flat.numel()
    q1, med, q3 = (flat.kthvalue(int(q * (n - 1)) + 1).values for q in (0.25, 0.5, 0.75))
    return med + 1.5 * (q3 - q1)


@register_merge("arcee_fusion", "keep the expert's change only where its importance is an upper outlier "
                "(mergekit's arcee_fusion)")
def arcee_fusion(*, base: Any, experts: Sequence[Any]) -> dict[str, Tensor]:
    """Arcee Fusion: ``theta_0 + (theta_1 - theta_0) * [I >= median(I) + 1.5 IQR(I)]`` per tensor, with
    ``I`` the importance of :func:`fusion_importance` and the threshold of :func:`fusion_threshold`.
    Needs the base and exactly one expert; no hyperparameters.
    """
    models = open_models(base, experts)
    one_expert("arcee_fusion", models)

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        if b.numel() == 0:
            return b.clone()
        x, b1 = xs[0].reshape(-1) if b.dim() == 0 else xs[0], b.reshape(-1) if b.dim() == 0 else b
        imp = fusion_importance(x, b1)
        keep = imp >= fusion_threshold(imp)
        return (b1.double() + (x.double() - b1.double()) * keep).reshape(b.shape)

    return map_keys(models, kernel, needs_base=True)
