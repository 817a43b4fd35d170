"""The shared driver: apply a per-tensor kernel key by key, plus the small tensor helpers kernels share.

A kernel sees one key at a time: ``kernel(key, base, experts) -> Tensor`` with ``base`` the pretrained tensor
(or ``None``) and ``experts`` the ``T`` fine-tuned tensors of that key. Only floating tensors reach a kernel;
integer / bool buffers are copied from the base (or the first expert). Results are cast back to the inputs'
dtype. Kernels never modify their inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .sources import ModelSet

__all__ = ["Kernel", "map_keys", "stack64", "task_vectors64", "check_experts_weights"]

Kernel = Callable[[str, Tensor | None, list[Tensor]], Tensor]


def map_keys(models: ModelSet, kernel: Kernel, *, needs_base: bool = False) -> dict[str, Tensor]:
    """Run ``kernel`` over every key of ``models`` and collect a new parameter dict.

    Args:
        models: the base and experts.
        kernel: the per-tensor merge.
        needs_base: raise if ``models`` has no base.

    Returns:
        A new dict with the same keys, shapes and dtypes as the experts.
    """
    if needs_base and models.base is None:
        raise ValueError("this method needs base= (the pretrained parameters)")
    out: dict[str, Tensor] = {}
    for key, base, experts in models.items():
        if not experts[0].is_floating_point():
            out[key] = (base if base is not None else experts[0]).clone()
            continue
        out[key] = kernel(key, base, experts).to(experts[0].dtype).contiguous()
    return out


def stack64(tensors: Sequence[Tensor]) -> Tensor:
    """Stack one key's tensors as float64, shape ``(T, *shape)``."""
    return torch.stack([t.to(torch.float64) for t in tensors])


def task_vectors64(base: Tensor, experts: Sequence[Tensor]) -> Tensor:
    """Task vectors ``tau_t = theta_t - theta_0`` of one key, float64, shape ``(T, *shape)``."""
    return stack64(experts) - base.to(torch.float64)


def check_experts_weights(weights: Sequence[float] | None, n: int) -> Tensor | None:
    """Validate optional per-expert weights; returns them as a float64 tensor (or ``None``)."""
    if weights is None:
        return None
    if len(weights) != n:
        raise ValueError(f"weights: got {len(weights)} values for {n} experts")
    return torch.tensor([float(w) for w in weights], dtype=torch.float64)


def bshape(v: Tensor, like: Tensor) -> Tensor:
    """Reshape a ``(T,)`` vector to broadcast against ``like`` of shape ``(T, *shape)``."""
    return v.reshape(-1, *([1] * (like.dim() - 1)))
