"""DOP: continual model merging by dual orthogonal projection (Yang, Tang, Shen et al., NeurIPS 2025, "Continual
Model Merging without Data: Dual Projections for Balancing Stability and Plasticity"; FusionBench's
``ContinualDOPForCLIP``, by the same group).

The paper projects the parameter differences between the merge and the old and the new models onto each
model's approximate data space, which it takes to be the span of that model's task vector, and solves the
resulting stability / plasticity trade-off as a two-objective problem by multi-gradient descent (a
Pareto-stationary point). Per layer, as FusionBench computes it:

Experts arrive in order. The first merge is the first expert. At arrival ``t``, per weight matrix, the new merge
``W`` is fitted to two targets, the previous merge ``W_m = W^_(t-1)`` (stability) and the new expert ``W_n``
(plasticity), each measured only inside the subspace of its own task vector.

- subspaces: ``tau_m = W_m - W_0 = U diag(s) V^T`` (the merged task vector) and ``tau_n = W_n - W_0``; each keeps
  its leading ``k`` singular triplets, ``k`` = how many have a cumulative share ``sum_(j<=i) s_j / sum_j s_j``
  below ``svd_epsilon`` (0.99999: nearly the whole spectrum);
- losses, ``D_i = W - W_i``: ``L_i(W) = ||diag(s_i) U_i^T D_i||_F^2 + ||D_i V_i diag(s_i)||_F^2`` (``space="uv"``;
  ``"u"`` / ``"v"`` keep one term): the change of ``W`` seen from the left and right singular directions of
  task ``i``, weighted by their singular values; gradient ``2 U_i diag(s_i)^2 U_i^T D_i + 2 D_i V_i
  diag(s_i)^2 V_i^T``;
- the trade-off is a two-objective problem: from ``W = (W_m + W_n) / 2``, ``num_steps`` Adam steps (``lr``) on
  ``w_m L_m + w_n L_n``, the weights found at every step by MGDA (Sener & Koltun 2018, the min-norm point of
  the two gradients, each divided by its loss) and smoothed by an exponential moving average from
  ``(alpha, 1 - alpha)`` with decay ``ema_beta``; without MGDA the weights are fixed at ``(alpha, 1 - alpha)``;
- the other tensors (biases, norms, embeddings) become the mean of the previous merge and the new expert, as
  FusionBench does (``others="pair_mean"``; the first expert's weight halves at every arrival), or the running
  mean ``theta_0 + (1/t) sum tau_i`` (``others="running_mean"``).

Every step is per tensor, so the merge streams key by key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .driver import map_keys
from .lowrank import DEFAULT_EXCLUDE, is_lowrank_param, thin_svd
from .order import expert_order
from .registry import register_merge
from .sources import open_models

__all__ = ["dop", "dop_matrix", "dop_fold", "energy_rank", "projected_loss", "min_norm_weight", "DOP_DEFAULTS"]

# FusionBench's config/method/dop/dop.yaml (the paper's setting); its class defaults differ (ema_beta 0.99)
DOP_DEFAULTS: dict[str, Any] = {"lr": 1e-4, "num_steps": 200, "mgda": True, "ema": True, "ema_beta": 0.999,
                                "alpha": 0.8, "svd_epsilon": 0.99999, "space": "uv"}


def energy_rank(s: Tensor, epsilon: float) -> int:
    """How many leading singular values have a cumulative share of ``sum(s)`` below ``epsilon`` (FusionBench's
    ``searchsorted(cumsum / sum, epsilon)``); 0 for an all-zero spectrum."""
    total = float(s.sum())
    if total <= 0.0:
        return 0
    return int((s.cumsum(0) / total < epsilon).sum())


def _subspace(tau: Tensor, epsilon: float) -> tuple[Tensor, Tensor, Tensor]:
    u, s, vh = thin_svd(tau)
    k = energy_rank(s, epsilon)
    return u[:, :k], s[:k], vh[:k]


def projected_loss(w: Tensor, target: Tensor, sub: tuple[Tensor, Tensor, Tensor],
                   space: str = "uv") -> tuple[float, Tensor]:
    """``(L_i(W), dL_i/dW)`` of the module docstring for the target ``W_i`` and its subspace ``(U, s, V^T)``."""
    u, s, vh = sub
    d = w - target
    left = s[:, None] * (u.T @ d)  # diag(s) U^T D, (k, n)
    right = (d @ vh.T) * s  # D V diag(s), (m, k)
    loss, grad = 0.0, torch.zeros_like(w)
    if space in ("uv", "u"):
        loss += float(left.pow(2).sum())
        grad += 2.0 * u @ (s[:, None] * left)
    if space in ("uv", "v"):
        loss += float(right.pow(2).sum())
        grad += 2.0 * (right * s) @ vh
    return loss, grad


def min_norm_weight(g1: Tensor, g2: Tensor) -> float:
    """MGDA for two objectives: ``gamma`` minimising ``||gamma g1 + (1 - gamma) g2||``, i.e.
    ``(g2.g2 - g1.g2) / ||g1 - g2||^2``, with the bounds of Sener & Koltun's solver (0.999 where the optimum
    is at or past ``g1``, 0.001 where it is at or past ``g2``)."""
    a, b, c = float((g1 * g1).sum()), float((g1 * g2).sum()), float((g2 * g2).sum())
    if b >= a:
        return 0.999
    if b >= c:
        return 0.001
    return (c - b) / (a + c - 2.0 * b)


def _weights(losses: list[float], grads: list[Tensor], state: list[float], o: dict[str, Any]) -> list[float]:
    """This step's loss weights ``(w_m, w_n)``; ``state`` holds the moving average (updated in place)."""
    if not o["mgda"]:
        return [o["alpha"], 1.0 - o["alpha"]]
    g1, g2 = (g / (loss if loss > 0.0 else 1.0) for g, loss in zip(grads, losses))
    gamma = min_norm_weight(g1, g2)
    sol = [gamma, 1.0 - gamma]
    if not o["ema"]:
        return sol
    state[:] = [o["ema_beta"] * e + (1.0 - o["ema_beta"]) * x for e, x in zip(state, sol)]
    return list(state)


def dop_matrix(w0: Tensor, w_merged: Tensor, w_new: Tensor, **options: Any) -> Tensor:
    """The new merge of one weight matrix (module docstring); ``options`` override :data:`DOP_DEFAULTS`."""
    o = {**DOP_DEFAULTS, **options}
    subs = [_subspace(w_merged - w0, o["svd_epsilon"]), _subspace(w_new - w0, o["svd_epsilon"])]
    targets = [w_merged, w_new]
    w = ((w_merged + w_new) / 2.0).detach().requires_grad_()  # a plain leaf stays where its inputs are
    opt = torch.optim.Adam([w], lr=o["lr"])
    state = [o["alpha"], 1.0 - o["alpha"]]
    for _ in range(o["num_steps"]):
        with torch.no_grad():
            pairs = [projected_loss(w.data, t, sub, o["space"]) for t, sub in zip(targets, subs)]
            losses, grads = [p[0] for p in pairs], [p[1] for p in pairs]
            wm, wn = _weights(losses, grads, state, o)
            w.grad = wm * grads[0] + wn * grads[1]
        opt.step()
    return w.detach()


def dop_fold(key: str, merged: Tensor | None, w0: Tensor, w_new: Tensor, t: int, *, others: str = "pair_mean",
             include: str | None = None, exclude: str | None = DEFAULT_EXCLUDE, **options: Any) -> Tensor:
    """One arrival for one key: the merge after expert ``t`` (1-based) from the merge before it (``None`` at
    ``t = 1``)."""
    if merged is None:
        return w_new.clone()
    if is_lowrank_param(key, tuple(w_new.shape), exclude, include):
        return dop_matrix(w0, merged, w_new, **options)
    if others == "pair_mean":
        return (merged + w_new) / 2.0
    return merged + (w_new - merged) / t  # running mean of the experts: theta_0 + (1/t) sum_i tau_i


def _check(space: str, others: str, alpha: float, svd_epsilon: float, ema_beta: float, num_steps: int) -> None:
    if space not in ("uv", "u", "v"):
        raise ValueError(f"space must be 'uv', 'u' or 'v', got {space!r}")
    if others not in ("pair_mean", "running_mean"):
        raise ValueError(f"others must be 'pair_mean' or 'running_mean', got {others!r}")
    for name, v in (("alpha", alpha), ("svd_epsilon", svd_epsilon), ("ema_beta", ema_beta)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {v}")
    if num_steps < 0:
        raise ValueError(f"num_steps must be at least 0, got {num_steps}")


@register_merge("dop", "continual merge: each arrival optimised against the old merge's and the new expert's "
                "singular subspaces, weighted by MGDA (DOP, Yang et al. 2025)")
def dop(*, base: Any, experts: Sequence[Any], lr: float = 1e-4, num_steps: int = 200, mgda: bool = True,
        ema: bool = True, ema_beta: float = 0.999, alpha: float = 0.8, svd_epsilon: float = 0.99999,
        space: str = "uv", others: str = "pair_mean", shuffle: bool = False, seed: int = 0,
        include: str | None = None, exclude: str | None = DEFAULT_EXCLUDE) -> dict[str, Tensor]:
    """DOP over an ORDERED expert list: the merge after the last arrival (module docstring).

    Defaults are FusionBench's ``config/method/dop/dop.yaml``. Differences from ``ContinualDOPForCLIP``:
    (1) ``shuffle`` off (FusionBench's config shuffles, unseeded); (2) which tensors are matrices, as in
    :func:`~clmerge.merging.methods.opcm.opcm`; (3) the gradients are formed in closed form instead of by autograd
    (the same values), float32 (float64 for float64 inputs).

    Args:
        lr: Adam's step size.
        num_steps: Adam steps per matrix and arrival (0: the mean of the old merge and the new expert).
        mgda: weight the two losses by MGDA at every step (else fixed ``(alpha, 1 - alpha)``).
        ema: smooth the MGDA weights by a moving average started at ``(alpha, 1 - alpha)``.
        ema_beta: the moving average's decay.
        alpha: the previous merge's weight (the start of the moving average, or the fixed weight).
        svd_epsilon: the share of the singular-value sum each subspace keeps.
        space: ``"uv"`` (both sides), ``"u"`` or ``"v"``.
        others: non-matrix tensors: ``"pair_mean"`` (FusionBench) or ``"running_mean"``.
        shuffle, seed, include, exclude: as in :func:`~clmerge.merging.methods.opcm.opcm`.
    """
    _check(space, others, alpha, svd_epsilon, ema_beta, num_steps)
    models = open_models(base, experts)
    order = expert_order(models.num_experts, shuffle, seed)
    options = {"lr": lr, "num_steps": num_steps, "mgda": mgda, "ema": ema, "ema_beta": ema_beta, "alpha": alpha,
               "svd_epsilon": svd_epsilon, "space": space}

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        dtype = torch.promote_types(b.dtype, torch.float32)
        w0, merged = b.to(dtype), None
        for t, i in enumerate(order, start=1):
            merged = dop_fold(key, merged, w0, xs[i].to(dtype), t, others=others, include=include,
                              exclude=exclude, **options)
        return merged

    return map_keys(models, kernel, needs_base=True)
