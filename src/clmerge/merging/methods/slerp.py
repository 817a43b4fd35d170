"""SLERP: spherical linear interpolation between two models, tensor by tensor (Shoemake 1985, as merged by
mergekit's ``slerp``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ...errors import UsageError
from .driver import map_keys
from .registry import register_merge
from .sources import ModelSet, open_models

__all__ = ["slerp", "slerp_tensor", "DOT_THRESHOLD"]

# |cos| above this: the two tensors are treated as colinear and interpolated linearly (mergekit's value)
DOT_THRESHOLD = 0.9995
# a tensor whose norm is at most this has no direction: linear interpolation
NORM_EPS = 1e-8


def slerp_tensor(t: float, v0: Tensor, v1: Tensor, *, dot_threshold: float = DOT_THRESHOLD) -> Tensor:
    """Shoemake's slerp of two tensors, flattened, in float64 (mergekit: float32, same rule).

    ``cos(Omega) = <v0, v1> / (|v0| |v1|)`` (the angle of the normalised copies), and
    ``slerp = sin((1 - t) Omega) / sin(Omega) * v0 + sin(t Omega) / sin(Omega) * v1`` on the unnormalised
    vectors, so norms are interpolated too. Falls back to ``lerp = (1 - t) v0 + t v1`` when
    ``|cos(Omega)| > dot_threshold`` (nearly parallel or antiparallel: ``sin(Omega)`` near 0) or when either
    norm is at most ``1e-8``.
    """
    a, b = v0.double().reshape(1, -1), v1.double().reshape(1, -1)
    na, nb = a.norm(dim=1), b.norm(dim=1)
    has_dir = (na > NORM_EPS) & (nb > NORM_EPS)
    cos = torch.where(has_dir, (a * b).sum(1) / (na * nb).clamp(min=NORM_EPS), 2.0)
    linear = cos.abs() > dot_threshold
    omega = torch.acos(torch.where(linear, 0.0, cos.clamp(-1.0, 1.0)))
    sin = torch.sin(omega)
    ca = torch.where(linear, 1.0 - t, torch.sin((1.0 - t) * omega) / torch.where(linear, 1.0, sin))
    cb = torch.where(linear, t, torch.sin(t * omega) / torch.where(linear, 1.0, sin))
    return (ca[:, None] * a + cb[:, None] * b).reshape(v0.shape)


@register_merge("slerp", "spherical interpolation between two models, tensor by tensor (t=0: the first)",
                needs_base=False)
def slerp(*, base: Any = None, experts: Sequence[Any], t: float = 0.5,
          dot_threshold: float = DOT_THRESHOLD) -> dict[str, Tensor]:
    """SLERP (Shoemake 1985) of two models, per tensor: ``sin((1-t)Omega)/sin(Omega) v0 + sin(t Omega)/sin(Omega) v1``
    with ``Omega`` the angle between the flattened tensors (see :func:`slerp_tensor` for the exact rule).

    The endpoints are ``(base, experts[0])`` when a base is given (mergekit's ``base_model`` is ``t = 0``), else
    ``(experts[0], experts[1])``. Integer buffers are copied from the ``t = 0`` endpoint.

    Args:
        t: interpolation fraction in [0, 1]; 0 gives the first model, 1 the second.
        dot_threshold: above this ``|cos(Omega)|`` the tensors count as colinear and are interpolated linearly
            (0.9995, mergekit's ``DOT_THRESHOLD``).
    """
    if not 0.0 <= t <= 1.0:
        raise ValueError(f"t must be in [0, 1], got {t}")
    if not 0.0 <= dot_threshold <= 1.0:
        raise ValueError(f"dot_threshold must be in [0, 1], got {dot_threshold}")
    if isinstance(experts, ModelSet):  # the merge driver's inputs (``clmerge merge``): keep its keys and sink
        models, count = experts, experts.num_experts + (experts.base is not None)
    else:
        count = -1 if isinstance(experts, (str, dict)) else len(experts) + (base is not None)
        models = open_models(base, experts) if count == 2 else None
    if count != 2:
        raise UsageError("slerp needs exactly two models: base= and one expert, or two experts and no base")

    def kernel(key: str, b: Tensor | None, xs: list[Tensor]) -> Tensor:
        first, second = (b, xs[0]) if b is not None else (xs[0], xs[1])
        return slerp_tensor(t, first, second, dot_threshold=dot_threshold)

    return map_keys(models, kernel)
