"""Model Stock (Jang et al. 2024, "Model Stock: All we need is just a few fine-tuned models")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ...errors import UsageError
from .driver import map_keys, task_vectors64
from .registry import register_merge
from .sources import open_models

__all__ = ["model_stock", "model_stock_ratio"]


def model_stock_ratio(tvs: Tensor) -> float:
    """The interpolation ratio of one layer, Model Stock Eq. (3) generalised to ``N`` models:
    ``t = N cos(theta) / (1 + (N - 1) cos(theta))``, with ``cos(theta)`` the mean pairwise cosine of the task
    vectors ``tvs`` ``(N, *shape)`` (each flattened). A zero task vector has cosine 0 with every other one.
    Where ``|1 + (N - 1) cos(theta)| < 1e-6`` (opposing updates, no finite ratio) the ratio is 0: the layer
    stays at the base, as in mergekit.
    """
    flat = tvs.reshape(tvs.shape[0], -1).double()
    n = flat.shape[0]
    gram = flat @ flat.T
    norms = gram.diagonal().sqrt()
    cos = gram / torch.outer(norms, norms).clamp(min=torch.finfo(torch.float64).tiny)
    iu = torch.triu_indices(n, n, offset=1)
    mean_cos = float(cos[iu[0], iu[1]].clamp(-1.0, 1.0).mean())
    denom = 1.0 + (n - 1) * mean_cos
    return 0.0 if abs(denom) < 1e-6 else n * mean_cos / denom


@register_merge("model_stock", "per layer, move from the base toward the experts' average by a ratio set by "
                "the angle between their task vectors")
def model_stock(*, base: Any, experts: Sequence[Any]) -> dict[str, Tensor]:
    """Model Stock, Jang et al. 2024, Eq. (3)-(4), per layer (tensor):
    ``w_H = t * w_avg + (1 - t) * w_0`` with ``w_avg = mean_i w_i`` and
    ``t = N cos(theta) / (1 + (N - 1) cos(theta))``, ``cos(theta)`` the mean pairwise cosine of the task vectors
    ``w_i - w_0`` of that layer (the paper's equal-angle assumption; mergekit takes the same mean).

    Args:
        base: the pretrained ``w_0``.
        experts: ``N >= 2`` fine-tuned models ``w_i`` (no hyperparameters: the ratio comes from the angle).
    """
    models = open_models(base, experts)
    if models.num_experts < 2:
        raise UsageError(f"model_stock needs at least 2 experts, got {models.num_experts}")

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        tvs = task_vectors64(b, xs)
        return b.double() + model_stock_ratio(tvs) * tvs.mean(0)  # t w_avg + (1 - t) w_0

    return map_keys(models, kernel, needs_base=True)
