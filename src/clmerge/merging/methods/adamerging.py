"""AdaMerging (Yang et al. 2024): learn merge coefficients by minimising prediction entropy on unlabeled data.

Task-wise: ``theta = anchor + sum_t lambda_t * v_t``; layer-wise: ``theta^l = anchor^l + sum_t lambda_t^l v_t^l``
(AdaMerging Eqs. 5-6; CART Eq. 8 / Alg. 2). On task arithmetic, ``anchor = theta_0`` and ``v_t = tau_t``; on
CART, ``anchor = theta_avg`` and ``v_t = SVD_k(theta_t - theta_avg)`` for weight matrices and the full centered
vector for other tensors (as the CART code does; with task-specific lambdas those no longer cancel).
The objective is ``sum_tasks mean_x H(p(. | x; theta))`` with each task's unlabeled inputs through its own head.

Not in the registry: it needs a model and data, which it takes explicitly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import cycle
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from .driver import stack64
from .lowrank import DEFAULT_EXCLUDE, is_lowrank_param, low_rank_approx, target_rank
from .sources import open_models

__all__ = ["adamerging", "adamerging_components", "entropy"]

ForwardFn = Callable[[nn.Module, int, Tensor], Tensor]  # (model, task index, x) -> logits


def entropy(logits: Tensor) -> Tensor:
    """Mean Shannon entropy of the softmax of ``logits`` (B, C)."""
    logp = logits.log_softmax(-1)
    return -(logp.exp() * logp).sum(-1).mean()


def adamerging_components(*, base: Any, experts: Sequence[Any], on: str = "task_arithmetic",
                          rank_ratio: float = 0.08, rounding: str = "ceil", exclude: str | None = DEFAULT_EXCLUDE
                          ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``(anchor, vectors)``: float32 anchor per key and ``(T, *shape)`` vectors per floating key."""
    models = open_models(base, experts)
    anchor, vecs = {}, {}
    for key, b, xs in models.items():
        if not xs[0].is_floating_point():
            continue
        x = stack64(xs)
        if on == "task_arithmetic":
            if b is None:
                raise ValueError("AdaMerging on task arithmetic needs base=")
            anchor[key], v = b.double(), x - b.double()
        elif on == "cart":
            anchor[key], v = x.mean(0), x - x.mean(0)
            if is_lowrank_param(key, tuple(xs[0].shape), exclude):
                k = target_rank(tuple(xs[0].shape), rank_ratio, rounding)
                v = torch.stack([low_rank_approx(vt.float(), k).double() for vt in v])
        else:
            raise ValueError(f"on must be 'task_arithmetic' or 'cart', got {on!r}")
        anchor[key], vecs[key] = anchor[key].float(), v.float()
    return anchor, vecs


def _merged(anchor: dict[str, Tensor], vecs: dict[str, Tensor], lam: Tensor, keys: list[str]) -> dict[str, Tensor]:
    out = {}
    for li, key in enumerate(keys):
        coef = lam[:, li] if lam.dim() == 2 else lam  # (T,)
        out[key] = anchor[key] + torch.tensordot(coef, vecs[key], dims=1)
    return out


def adamerging(*, base: Any, experts: Sequence[Any], model: nn.Module, forward: ForwardFn,
               unlabeled: Sequence[Iterable[Tensor]], on: str = "task_arithmetic", granularity: str = "layer",
               init: float = 0.3, steps: int = 500, lr: float = 1e-3, clamp: tuple[float, float] | None = (0.0, 1.0),
               rank_ratio: float = 0.08, rounding: str = "ceil") -> tuple[dict[str, Tensor], Tensor]:
    """Learn AdaMerging coefficients with Adam and return ``(merged parameters, lambda)``.

    Args:
        base, experts: as for every merge (``base`` unused by ``on="cart"``).
        model: a module whose ``state_dict`` keys include the merged keys (only those are replaced).
        forward: ``(model, task, x) -> logits`` for task ``task``'s head.
        unlabeled: per task, an iterable of unlabeled input batches (cycled).
        on: ``"task_arithmetic"`` (AdaMerging+TA) or ``"cart"`` (AdaMerging+CART).
        granularity: ``"layer"`` (one lambda per task and tensor) or ``"task"`` (one per task).
        init: initial lambda (AdaMerging: 0.3). steps, lr: Adam iterations and learning rate (paper: 500, 1e-3).
        clamp: lambda is clamped to this range after each step (CART code: [0, 1]); ``None`` for no clamp.
        rank_ratio, rounding: CART's truncation when ``on="cart"``.

    Returns:
        The merged dict (all keys of the experts; dtypes kept) and ``lambda`` of shape ``(T, L)`` or ``(T,)``.
    """
    if granularity not in ("layer", "task"):
        raise ValueError(f"granularity must be 'layer' or 'task', got {granularity!r}")
    models = open_models(base, experts)
    if len(unlabeled) != models.num_experts:
        raise ValueError(f"unlabeled: need one iterable per task ({models.num_experts}), got {len(unlabeled)}")
    anchor, vecs = adamerging_components(base=base, experts=models, on=on, rank_ratio=rank_ratio, rounding=rounding)
    keys = list(anchor)
    shape = (models.num_experts, len(keys)) if granularity == "layer" else (models.num_experts,)
    lam = torch.full(shape, float(init), requires_grad=True)
    opt = torch.optim.Adam([lam], lr=lr)
    streams = [cycle(u) for u in unlabeled]
    wrapper = _Wrapper(model, forward)
    for _ in range(steps):
        params = _merged(anchor, vecs, lam, keys)
        loss = sum(entropy(_call(wrapper, params, t, next(s))) for t, s in enumerate(streams))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if clamp is not None:
            with torch.no_grad():
                lam.clamp_(*clamp)
    with torch.no_grad():
        merged = _merged(anchor, vecs, lam.detach(), keys)
    out = {}
    for key in models.keys():
        _, xs = models.load(key)
        out[key] = merged[key].to(xs[0].dtype) if key in merged else xs[0].clone()
    return out, lam.detach()


class _Wrapper(nn.Module):
    """Runs ``forward(inner, task, x)``; under ``functional_call`` every ``inner.*`` parameter is replaced."""

    def __init__(self, model: nn.Module, fn: ForwardFn) -> None:
        super().__init__()
        self.inner, self._fn = model, fn

    def forward(self, task: int, x: Tensor) -> Tensor:
        return self._fn(self.inner, task, x)


def _call(wrapper: _Wrapper, params: dict[str, Tensor], task: int, x: Tensor) -> Tensor:
    return functional_call(wrapper, {f"inner.{k}": v for k, v in params.items()}, (task, x), strict=False)
