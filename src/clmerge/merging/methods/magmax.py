"""MagMax (Marczak et al., ECCV 2024): maximum-magnitude selection of task vectors.

Per parameter entry ``p`` the merged task vector takes the value of the task vector with the largest
magnitude, sign included (paper Sec. 4, Eq. for ``tau_MagMax``):

    tau_MagMax^p = tau_k^p,   k = argmax_t |tau_t^p|;      theta = theta_0 + lambda * tau_MagMax

The argmax is ambiguous when magnitudes tie. The official code (``danielm1405/magmax``,
``merge_max_abs``) folds the task vectors in order with ``where(|tau_t| >= |running|, tau_t, running)``, so
the *last* of the tied tasks wins (``tie_break="last"``, the default; the paper does not say). ``"first"``
keeps the earliest.

The rule is associative: folding task vectors one at a time into a running tensor gives the same result as
selecting over all of them at once (same tie rule). :func:`max_magnitude_fold` is that running step; the
continual method ``magmax`` uses it to keep one tensor per parameter instead of every task vector.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .driver import CHUNK, map_keys
from .registry import register_merge
from .sources import open_models

__all__ = ["magmax", "max_magnitude_fold", "TIE_BREAKS"]

TIE_BREAKS = ("last", "first")


def _check_tie_break(tie_break: str) -> None:
    if tie_break not in TIE_BREAKS:
        raise ValueError(f"tie_break must be 'last' or 'first', got {tie_break!r}")


def max_magnitude_fold(running: Tensor, tau: Tensor, *, tie_break: str = "last") -> tuple[Tensor, Tensor]:
    """One step of the running maximum-magnitude selection.

    Args:
        running: ``tau_max`` over the earlier task vectors (zeros before the first).
        tau: the new task vector ``tau_t`` (same shape).
        tie_break: ``"last"``: ``tau_t`` wins where ``|tau_t| == |running|`` (official ``>=``); ``"first"``:
            it wins only where ``|tau_t| > |running|``.

    Returns:
        ``(new running tensor, boolean mask of the entries taken from tau)``. The new tensor is
        ``where(mask, tau, running)``, in the promoted dtype of the inputs.
    """
    _check_tie_break(tie_break)
    mag_new, mag_old = tau.abs(), running.abs()
    taken = mag_new >= mag_old if tie_break == "last" else mag_new > mag_old
    return torch.where(taken, tau, running), taken


@register_merge("magmax", "per entry the task-vector value of largest magnitude, sign kept, scaled (MagMax)")
def magmax(*, base: Any, experts: Sequence[Any], scaling: float = 0.5,
           tie_break: str = "last") -> dict[str, Tensor]:
    """MagMax, Marczak et al. 2024, Sec. 4: ``theta_0 + lambda * tau_MagMax``,
    ``tau_MagMax^p = tau_k^p`` with ``k = argmax_t |tau_t^p|``.

    Experts are folded in the order given (for continual learning: the task order), which matters only for
    ties in magnitude (``tie_break``). Integer entries (buffers) are copied from the base.

    Args:
        base: the pretrained parameters ``theta_0``.
        experts: the fine-tuned parameters ``theta_t`` (sequential fine-tuning: each task's final weights).
        scaling: ``lambda``. 0.5 is the value of the official merge scripts (``merge_max_abs`` with 0.5),
            which the paper reports to be robust across benchmarks; select on validation data.
        tie_break: ``"last"`` (official code: a later task wins a tie in magnitude) or ``"first"``.
    """
    _check_tie_break(tie_break)
    models = open_models(base, experts)

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        # each difference in at least float32, as the other task-vector merges
        dtype = torch.promote_types(b.dtype, torch.float32)
        b = b.to(dtype)
        running = torch.sub(xs[0].to(dtype), b)
        for x in xs[1:]:
            running = max_magnitude_fold(running, torch.sub(x.to(dtype), b), tie_break=tie_break)[0]
        return running.mul_(scaling).add_(b)

    return map_keys(models, kernel, needs_base=True, chunk=CHUNK)
