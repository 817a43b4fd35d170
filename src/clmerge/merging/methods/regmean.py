"""RegMean (Jin et al. 2023, "Dataless Knowledge Fusion by Merging Weights of Language Models").

For a linear layer ``y = W x`` (torch layout ``W: (out, in)``) with input Gram matrices ``G_t = X_t^T X_t``
(``(in, in)``), the merged weight minimises ``sum_t ||X_t W^T - X_t W_t^T||^2`` (Eq. 2):
``W^T = (sum_t G~_t)^{-1} sum_t G~_t W_t^T`` with ``G~_t = alpha G_t + (1 - alpha) diag(G_t)`` (Sec. 3.2).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .driver import map_keys, stack64
from .registry import register_merge
from ..io import MergeInputError
from .sources import open_models

__all__ = ["regmean", "regmean_tensor", "gram_matrices"]


def regmean_tensor(weights: Sequence[Tensor], grams: Sequence[Tensor], alpha: float = 0.9) -> Tensor:
    """RegMean on one ``(out, in)`` weight: ``(sum_t G~_t)^{-1} sum_t G~_t W_t^T``, transposed back (float64)."""
    g = stack64(grams)  # (T, in, in)
    diag = torch.diag_embed(torch.diagonal(g, dim1=-2, dim2=-1))
    g = alpha * g + (1.0 - alpha) * diag
    w = stack64(weights)  # (T, out, in)
    rhs = (g @ w.transpose(1, 2)).sum(0)  # (in, out)
    return torch.linalg.solve(g.sum(0), rhs).T


@register_merge("regmean", "closed-form least-squares merge of linear layers from their input Gram matrices",
                needs_base=False)
def regmean(*, base: Any = None, experts: Sequence[Any], grams: Sequence[Mapping[str, Tensor]] | None = None,
            alpha: float = 0.9) -> dict[str, Tensor]:
    """RegMean, Eq. (2) with the off-diagonal reduction ``alpha`` (paper default 0.9 for transformers).

    Args:
        grams: one dict per expert mapping a 2-D weight key (e.g. ``"fc.weight"``) to the Gram matrix of that
            layer's inputs on the expert's data (``(in, in)``); see :func:`gram_matrices`. Other keys are
            averaged.
        alpha: scaling of the off-diagonal Gram entries (``1``: exact least squares).
    """
    models = open_models(base, experts)
    if grams is None or len(grams) != models.num_experts:
        raise ValueError(f"grams: need one Gram dict per expert ({models.num_experts})")
    gkeys = set(grams[0])
    for i, g in enumerate(grams):
        if set(g) != gkeys:
            raise MergeInputError(f"grams[{i}] has different keys from grams[0]")

    def kernel(key: str, b: Tensor | None, xs: list[Tensor]) -> Tensor:
        if key not in gkeys:
            return stack64(xs).mean(0)
        if xs[0].dim() != 2 or tuple(grams[0][key].shape) != (xs[0].shape[1],) * 2:
            raise MergeInputError(f"gram of key {key!r}: expected ({xs[0].shape[-1]}, {xs[0].shape[-1]}) for a "
                                  f"2-D weight, got {list(grams[0][key].shape)}")
        return regmean_tensor(xs, [g[key] for g in grams], alpha)

    return map_keys(models, kernel)


def gram_matrices(model: nn.Module, batches: Iterable[Any], *, forward: Callable[[nn.Module, Any], Any] | None = None,
                  modules: Sequence[str] | None = None) -> dict[str, Tensor]:
    """Input Gram matrices ``X^T X`` (float64 sums) of the ``nn.Linear`` layers of ``model``.

    Args:
        batches: inputs (anything ``forward`` accepts; default ``model(batch)``, or ``model(batch[0])`` for tuples).
        modules: names of the linear modules (default: all ``nn.Linear``).

    Returns:
        ``{"<module>.weight": G}`` with ``G`` the sum over all tokens/samples of ``x x^T``.
    """
    names = modules or [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    lookup = dict(model.named_modules())
    sums: dict[str, Tensor] = {}

    def hook_for(name: str):
        def hook(mod: nn.Module, inp: tuple[Tensor, ...], out: Tensor) -> None:
            x = inp[0].detach().reshape(-1, inp[0].shape[-1]).double()
            g = x.T @ x
            sums[name] = g if name not in sums else sums[name] + g
        return hook

    handles = [lookup[n].register_forward_hook(hook_for(n)) for n in names]
    try:
        with torch.no_grad():
            for batch in batches:
                if forward is not None:
                    forward(model, batch)
                else:
                    model(batch[0] if isinstance(batch, (tuple, list)) else batch)
    finally:
        for h in handles:
            h.remove()
    return {f"{n}.weight": g for n, g in sums.items()}
