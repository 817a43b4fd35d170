"""WUDI-Merging (Cheng et al., ICML 2025, "Whoever Started the Interference Should End It: Guiding Data-Free
Model Merging via Task Vectors"): a data-free optimisation of the merged task vector of each linear layer.

Per weight matrix, with task vectors ``tau_i = theta_i - theta_0`` (``m x n``), minimise the interference

    L(tau_m) = sum_i ||(tau_m - tau_i) tau_i^T||_F^2 / ||tau_i||_F^2

(the rows of ``tau_i`` stand in for the task's inputs: the paper's point that a linear layer's task vector
spans an approximate subspace of its inputs), from ``tau_m = sum_i tau_i`` by ``steps`` steps of Adam at
learning rate ``lr`` (FusionBench's ``wudi_merging``: Adam, lr 1e-5, no weight decay, ``iter_num`` 300 in the
function, 400 in its shipped config). The merged layer is ``theta_0 + tau_m``.

The gradient is taken in closed form: with ``H = sum_i tau_i^T tau_i / ||tau_i||^2`` (``n x n``) and
``C = sum_i tau_i tau_i^T tau_i / ||tau_i||^2`` (``m x n``), ``grad L = 2 (tau_m H - C)``, the gradient
autograd computes from the loss above (tested), at one ``(m x n) (n x n)`` product per step instead of ``T``
products and their backward pass. ``L`` is a convex quadratic, minimised where ``tau_m H = C``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..io.base import MergeInputError
from ..io.checks import is_finite
from .driver import map_keys
from .lowrank import DEFAULT_EXCLUDE, is_lowrank_param, task_matrices
from .registry import register_merge
from .sources import open_models

__all__ = ["wudi", "wudi_objective", "wudi_matrix", "OPTIMIZERS"]

OPTIMIZERS = ("adam", "sgd")


def _live(taus: Tensor) -> tuple[Tensor, Tensor]:
    """The task vectors with a nonzero norm and their ``||tau_i||_F^2`` (a zero one has no term: 0/0)."""
    w = taus.square().sum((1, 2))
    keep = w > 0
    return taus[keep], w[keep]


def wudi_objective(tau_m: Tensor, taus: Tensor) -> Tensor:
    """``sum_i ||(tau_m - tau_i) tau_i^T||_F^2 / ||tau_i||_F^2`` over the nonzero task vectors
    ``taus (T, m, n)``."""
    live, w = _live(taus)
    prod = (tau_m[None] - live) @ live.transpose(1, 2)  # (T, m, m)
    return (prod.square().sum((1, 2)) / w).sum()


def _quadratic(taus: Tensor) -> tuple[Tensor, Tensor]:
    """``(H, C)`` of the module docstring, accumulated one task at a time."""
    live, w = _live(taus)
    n = taus.shape[2]
    h, c = taus.new_zeros(n, n), taus.new_zeros(taus.shape[1:])
    for t, wt in zip(live, w):
        g = (t.T @ t) / wt
        h += g
        c += t @ g
    return h, c


def wudi_matrix(taus: Tensor, *, steps: int = 300, lr: float = 1e-5, optimizer: str = "adam") -> Tensor:
    """The optimised ``tau_m`` of one weight matrix from its task vectors ``(T, m, n)``, in their dtype."""
    h, c = _quadratic(taus)
    p = taus.sum(0).requires_grad_(True)
    opt = torch.optim.Adam([p], lr=lr) if optimizer == "adam" else torch.optim.SGD([p], lr=lr)
    for _ in range(steps):
        p.grad = 2.0 * (p.detach() @ h - c)
        opt.step()
    return p.detach()


@register_merge("wudi", "data-free per-layer optimisation of the merged task vector against the task "
                "vectors' interference (WUDI, Cheng et al. 2025)")
def wudi(*, base: Any, experts: Sequence[Any], steps: int = 300, lr: float = 1e-5, optimizer: str = "adam",
         include: str | None = None, exclude: str | None = DEFAULT_EXCLUDE) -> dict[str, Tensor]:
    """WUDI-Merging: ``theta_0 + argmin L`` per weight matrix (module docstring), from ``sum_i tau_i``.

    Other tensors (biases, norms, embeddings by the default rule) get ``theta_0 + mean_i tau_i``: task
    arithmetic at ``lambda = 1/T``, as FusionBench (which divides the summed task vector by ``T`` there). The
    merge has no randomness: the same inputs give the same result.

    Matches FusionBench's ``WUDIMerging`` except: (1) which tensors are matrices: here the rule of
    ``lowrank.is_lowrank_param`` (the paper's linear layers: 2-D ``*weight`` tensors, not embeddings or
    norms); FusionBench optimises every 2-D tensor not in ``exclude_keys`` (``include="."`` reproduces it);
    (2) the gradient in closed form (the same gradient); (3) a zero task vector has no term (FusionBench
    divides by its zero norm); (4) float32 on the CPU (float64 for float64 inputs); (5) a matrix whose
    optimisation comes out NaN or Inf (squares of task vectors beyond float32's range: entries above about
    1e19) is refused with a ``MergeInputError`` naming the key, where FusionBench returns the NaNs.

    Args:
        steps: optimiser steps per matrix (FusionBench's ``iter_num``: 300 in its function, 400 in its
            config).
        lr: learning rate (FusionBench: 1e-5).
        optimizer: ``"adam"`` (FusionBench: ``torch.optim.Adam``, default betas, no weight decay) or
            ``"sgd"``.
        include: regex of keys treated as matrices, replacing the default rule (``"."``: every 2-D tensor).
        exclude: regex of 2-D ``*weight`` keys treated as non-matrix tensors (default: embeddings, norms).
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    models = open_models(base, experts)

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        taus = task_matrices(b, xs)
        if not is_lowrank_param(key, tuple(b.shape), exclude, include):
            return b.double() + taus.double().mean(0)
        tau_m = wudi_matrix(taus, steps=steps, lr=lr, optimizer=optimizer)
        if models.check_finite and not is_finite(tau_m):
            raise MergeInputError(
                f"wudi: key {key!r} came out NaN or Inf from finite inputs: the squared norms and products of its "
                f"task vectors (largest magnitude {float(taus.abs().max()):.3g}) overflow {str(taus.dtype)[6:]} "
                f"(above {torch.finfo(taus.dtype).max:.3g}); expected task vectors whose squares fit: check the "
                "inputs' scale")
        return b.double() + tau_m.double()

    return map_keys(models, kernel, needs_base=True)
