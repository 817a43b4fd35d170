"""DELLA-Merging (Deep et al. 2024, "DELLA-Merging: Reducing Interference in Model Merging through
Magnitude-Based Sampling"): MAGPRUNE drop-and-rescale, then TIES's sign election and disjoint mean."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ...utils.device import cpu_draw
from .dare import dare_generator
from .driver import map_keys, row_blocks
from .registry import register_merge
from .sources import open_models
from .ties import ties_from_task_vectors
from .trim import work_dtype

__all__ = ["della", "della_linear", "magprune_tensor", "magprune_drop_probabilities"]


def magprune_drop_probabilities(tv: Tensor, density: float, epsilon: float) -> Tensor:
    """MAGPRUNE's drop probabilities (DELLA Sec. 3.1), row by row, shape of ``tv``.

    A row is ``tv[i]`` flattened for a tensor of 2+ dims (one output unit), the whole tensor for a 1-D one.
    In a row of ``n`` entries, ``r_i`` is the rank of ``|tau_i|`` in descending order (0 = largest; ties to the
    lower index) and ``p_i = p_min + epsilon * r_i / n`` with ``p_min = (1 - density) - epsilon (n - 1) / (2n)``,
    so the mean drop probability is ``1 - density`` and larger magnitudes are dropped less often.
    """
    if tv.numel() == 0:
        return torch.zeros(tv.shape, dtype=torch.float64)
    rows = tv.reshape(1, -1) if tv.dim() < 2 else tv.reshape(tv.shape[0], -1)
    n = rows.shape[1]
    order = torch.sort(rows.abs(), dim=1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(n).expand_as(order))
    p_min = (1.0 - density) - epsilon * (n - 1) / (2 * n)
    return (p_min + epsilon * ranks.double() / n).reshape(tv.shape)


def magprune_tensor(tv: Tensor, density: float, epsilon: float, *, generator: torch.Generator) -> Tensor:
    """MAGPRUNE on one tensor: keep ``tau_i`` with probability ``1 - p_i``, rescale kept entries by
    ``1 / (1 - p_i)`` (DELLA Eq. for the rescale; ``E[result] = tau``). Uniform draws as in ``dare_tensor``, so
    ``epsilon = 0`` reproduces DARE with ``drop_rate = 1 - density`` exactly.

    Computed in blocks of rows (:func:`.driver.row_blocks`; the ranks are per row and the generator's draws
    run on from block to block): the numbers of one whole-tensor pass, with temporaries of one block."""
    out = torch.empty_like(tv)
    for rows in row_blocks(tv):
        out[rows] = _magprune_block(tv[rows], density, epsilon, generator)
    return out


def _magprune_block(tv: Tensor, density: float, epsilon: float, generator: torch.Generator) -> Tensor:
    # compared in float32, as DARE compares its draws with a float32 drop rate
    p = magprune_drop_probabilities(tv, density, epsilon).to(torch.float32)
    keep = cpu_draw(torch.rand, tv.shape, generator=generator, like=tv) >= p
    return (tv * keep / (1.0 - p)).to(tv.dtype)


def check_magprune(density: float, epsilon: float) -> None:
    """Raise a one-line error unless ``density`` and ``epsilon`` give drop probabilities in [0, 1]."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    if epsilon < 0.0 or epsilon / 2 > min(density, 1.0 - density):
        raise ValueError(f"epsilon must be in [0, 2 * min(density, 1 - density)] = "
                         f"[0, {2 * min(density, 1.0 - density)}], got {epsilon}")


@register_merge("della", "MAGPRUNE (drop small task-vector entries more often, rescale), then TIES's sign "
                "election and disjoint mean")
def della(*, base: Any, experts: Sequence[Any], density: float = 0.5, epsilon: float = 0.2, scaling: float = 1.0,
          seed: int = 0) -> dict[str, Tensor]:
    """DELLA-Merging, Deep et al. 2024: Drop (MAGPRUNE, :func:`magprune_drop_probabilities`), Elect
    (``gamma = sgn(sum_t tau~_t)``), Fuse (mean of the entries that agree with ``gamma``), then
    ``theta_0 + lambda * tau_m``.

    mergekit's ``della`` gives keep probabilities in ``[density - epsilon, density + epsilon]`` (a window of
    ``2 epsilon``, ranks scaled by ``n - 1``); the paper's ``epsilon``, used here, is the whole window width, so
    mergekit's ``epsilon = e`` is about ``epsilon = 2e`` here.

    Args:
        density: mean fraction kept, ``1 - p`` (p: the mean drop probability).
        epsilon: width of the window of drop probabilities around ``1 - density`` (0: DARE's uniform drop);
            needs ``epsilon / 2 <= density`` and ``epsilon / 2 <= 1 - density``.
        scaling: ``lambda`` applied to the merged task vector.
        seed: the random masks depend only on (seed, key, expert index), as DARE's.
    """
    check_magprune(density, epsilon)
    models = open_models(base, experts)

    def pruned(key: str, b: Tensor, xs: list[Tensor], idx: list[int]) -> Tensor:
        dt = work_dtype(b.dtype, *(x.dtype for x in xs))  # float32; float64 for float64 inputs
        return torch.stack([magprune_tensor(x.to(dt) - b.to(dt), density, epsilon,
                                            generator=dare_generator(seed, key, t)) for x, t in zip(xs, idx)])

    return ties_from_task_vectors(models, pruned, density=1.0, scaling=scaling, trim_scope="per_tensor",
                                  merge_fn="mean")


@register_merge("della_linear", "MAGPRUNE (drop small task-vector entries more often, rescale), then the scaled "
                "sum of the task vectors (mergekit's della_linear)")
def della_linear(*, base: Any, experts: Sequence[Any], density: float = 0.5, epsilon: float = 0.2,
                 scaling: float = 1.0, seed: int = 0) -> dict[str, Tensor]:
    """DELLA's Drop step (Deep et al. 2024, MAGPRUNE; see :func:`della`) with task arithmetic in place of the
    sign election: ``theta_0 + lambda * sum_t tau~_t`` (mergekit's ``della_linear``: no consensus, no
    normalisation). ``density = 1`` (with ``epsilon = 0``) is task arithmetic.

    Args:
        density: mean fraction kept, ``1 - p``.
        epsilon: width of the window of drop probabilities around ``1 - density`` (about twice mergekit's
            ``epsilon``, see :func:`della`).
        scaling: ``lambda`` (mergekit's per-model ``weight`` times its ``lambda``, both 1 by default).
        seed: the random masks depend only on (seed, key, expert index): the same masks as ``della``.
    """
    check_magprune(density, epsilon)
    models = open_models(base, experts)

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        return della_linear_key(key, b, xs, density, epsilon, scaling, seed)

    return map_keys(models, kernel, needs_base=True)


def della_linear_key(key: str, b: Tensor, xs: list[Tensor], density: float, epsilon: float, scaling: float,
                     seed: int) -> Tensor:
    """``theta_0 + lambda * sum_t MAGPRUNE(tau_t)`` of one key, in blocks of rows (:func:`.driver.row_blocks`):
    MAGPRUNE ranks within a row, and each expert's generator is drawn block after block, which gives the very
    numbers of one draw over the whole tensor. So the result is bit-identical to the whole-tensor sum, with
    temporaries (the sort's indices and ranks, the float64 probabilities) of one block instead of one tensor
    each. Returned in the experts' dtype."""
    dt = work_dtype(b.dtype, *(x.dtype for x in xs))
    out = torch.empty(b.shape, dtype=xs[0].dtype)
    gens = [dare_generator(seed, key, t) for t in range(len(xs))]
    for rows in row_blocks(b):
        fb = b[rows].to(dt)
        acc = torch.zeros(fb.shape, dtype=dt)
        for x, gen in zip(xs, gens):
            acc.add_(magprune_tensor(x[rows].to(dt) - fb, density, epsilon, generator=gen))
        out[rows] = acc.mul_(scaling).add_(fb)
    return out
