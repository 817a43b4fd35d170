"""NearSwap (the QuartetAnemoi-70B recipe, as mergekit's ``nearswap``): move the base toward a second model
by at most ``t`` per entry, so entries where the two nearly agree take the second model's value."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ...errors import UsageError
from .driver import map_keys
from .registry import register_merge
from .sources import ModelSet, open_models

__all__ = ["nearswap", "nearswap_tensor", "one_expert"]


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
