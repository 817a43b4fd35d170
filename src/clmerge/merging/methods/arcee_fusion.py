"""Arcee Fusion (mergekit's ``arcee_fusion``): take the expert's value only where its change from the base
is important, with importance = change size times the KL divergence of the rows' softmax, and "important" an
upper-outlier test (median + 1.5 IQR, Tukey's fence)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .driver import map_keys
from .nearswap import one_expert
from .registry import register_merge
from .sources import open_models

__all__ = ["arcee_fusion", "fusion_importance", "fusion_threshold"]

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
