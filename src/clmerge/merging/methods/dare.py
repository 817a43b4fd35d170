"""DARE (Yu et al. 2024, "Language models are Super Mario"): drop and rescale task vectors, then merge."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ...utils.device import cpu_draw
from .driver import CHUNK, map_keys
from .registry import register_merge
from .sources import open_models
from .ties import ties_from_task_vectors
from .trim import work_dtype

__all__ = ["dare", "dare_tensor", "dare_generator", "dare_sum_blocks"]


def dare_tensor(tv: Tensor, drop_rate: float, *, rescale: bool, generator: torch.Generator,
                out: Tensor | None = None) -> Tensor:
    """DARE Eq. (1)-(2) on one tensor: ``m ~ Bernoulli(drop_rate)``, ``tau~ = (1 - m) * tau / (1 - p)``.

    ``out`` (may be ``tv`` itself) receives the result without a full-size temporary.
    """
    keep = cpu_draw(torch.rand, tv.shape, generator=generator, like=tv) >= drop_rate
    out = torch.mul(tv, keep, out=out) if out is not None else tv * keep
    return out.div_(1.0 - drop_rate) if rescale else out


def dare_sum_blocks(b: Tensor, xs: list[Tensor], gens: list[torch.Generator], drop_rate: float, factor: float,
                    dt: torch.dtype, block: int = CHUNK) -> Tensor:
    """``theta_0 + factor * sum_t (x_t - theta_0) * (u_t >= p)`` with ``u_t = torch.rand(x_t.shape,
    generator=gens[t])``, on the CPU, in the inputs' dtype (``xs[0]``), computed in ``dt``.

    Block by block: each generator draws its next ``block`` uniforms into one reused buffer (the same numbers
    as one whole-tensor draw: a CPU generator hands out its stream in order, tested), and the masked sum, the
    rescale and the base stay in cache-sized buffers; no full-size temporary but the output.
    """
    out = torch.empty(b.shape, dtype=xs[0].dtype)
    fb_all, fo, fxs = b.reshape(-1), out.view(-1), [x.reshape(-1) for x in xs]
    acc, fb, tv = (torch.empty(block, dtype=dt) for _ in range(3))
    draw = torch.empty(block, dtype=torch.float32)
    for i in range(0, fb_all.numel(), block):
        n = min(block, fb_all.numel() - i)
        a, base, keep = acc[:n].zero_(), fb[:n].copy_(fb_all[i:i + n]), draw[:n]
        for x, g in zip(fxs, gens):
            torch.rand(n, generator=g, out=keep).ge_(drop_rate)  # 0/1 in the draw's buffer
            a.addcmul_(tv[:n].copy_(x[i:i + n]).sub_(base), keep if dt == torch.float32 else keep.to(dt))
        fo[i:i + n] = a.mul_(factor).add_(base)  # rounded to the output dtype as a whole-tensor .to() rounds
    return out


def dare_generator(seed: int, key: str, t: int) -> torch.Generator:
    """The random generator of the drop mask of parameter ``key`` of expert ``t`` under ``seed``."""
    # The mask of (key, expert) depends only on the seed, the key and the expert index: the same numbers in
    # any key order and in every pass (DARE+TIES reads each key twice).
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode()) * 131 + t) % (2**63))


@register_merge("dare", "randomly drop task-vector entries and rescale the rest, then task arithmetic or TIES")
def dare(*, base: Any, experts: Sequence[Any], drop_rate: float = 0.5, rescale: bool = True, seed: int = 0,
         combine: str = "task_arithmetic", scaling: float = 0.3, density: float = 1.0,
         trim_scope: str = "global", trim_rule: str = "exact") -> dict[str, Tensor]:
    """DARE: ``tau~_t = m_t * tau_t / (1 - p)``, ``m_t ~ Bernoulli(1 - p)`` elementwise, then ``combine``.

    The drop is a random Bernoulli mask as in the paper (and mergekit): the number of dropped entries is
    ``p * n`` only on average, not exactly. ``density`` / ``trim_rule`` govern only TIES's magnitude trim.

    Args:
        drop_rate: ``p``, the fraction of entries dropped.
        rescale: divide the kept entries by ``1 - p`` (the paper; ``False`` is plain random pruning).
        seed: the random masks depend only on (seed, key, expert index).
        combine: ``"task_arithmetic"`` (``theta_0 + lambda sum_t tau~_t``) or ``"ties"``.
        scaling: ``lambda``.
        density, trim_scope, trim_rule: TIES's trim when ``combine="ties"`` (``density=1``: sign election
            only); see ``ties``.
    """
    if not 0.0 <= drop_rate < 1.0:
        raise ValueError(f"drop_rate must be in [0, 1), got {drop_rate}")
    models = open_models(base, experts)

    def dropped(key: str, b: Tensor, xs: list[Tensor], idx: list[int]) -> Tensor:
        # written into one preallocated stack, each row in place (no per-expert full-size temporaries); float32,
        # or float64 for float64 inputs (TIES's trim then counts on these very numbers)
        dt = work_dtype(b.dtype, *(x.dtype for x in xs))
        out, fb = torch.empty((len(xs), *b.shape), dtype=dt), b.to(dt)
        for row, x, t in zip(out, xs, idx):
            dare_tensor(torch.sub(x.to(dt), fb, out=row), drop_rate, rescale=rescale,
                        generator=dare_generator(seed, key, t), out=row)
        return out

    if combine == "task_arithmetic":
        factor = scaling / (1.0 - drop_rate) if rescale else scaling

        def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
            # sum_t m_t * tau_t accumulated in float32 (float64 for float64 inputs); the 1/(1-p) rescale
            # applied once at the end
            dt = work_dtype(b.dtype, *(x.dtype for x in xs))
            gens = [dare_generator(seed, key, t) for t in range(len(xs))]
            if b.device.type == "cpu":
                return dare_sum_blocks(b, xs, gens, drop_rate, factor, dt)
            acc, fb, tv = torch.zeros(b.shape, dtype=dt), b.to(dt), torch.empty(b.shape, dtype=dt)
            for x, g in zip(xs, gens):
                # the mask as 0/1 in the random draw's own buffer, and one fused multiply-add: the same numbers
                # as ``acc += (x - b) * (rand >= p)`` (a product with 0 or 1 is exact) with two passes fewer
                keep = cpu_draw(torch.rand, x.shape, generator=g, like=x).ge_(drop_rate).to(dt)
                acc.addcmul_(tv.copy_(x).sub_(fb), keep)  # x - b in place: a mixed-dtype sub allocates x's copy
                del keep  # before the next draw: two draws alive at once would raise the peak by one tensor
            return acc.mul_(factor).add_(b)

        return map_keys(models, kernel, needs_base=True)
    if combine == "ties":
        return ties_from_task_vectors(models, dropped, density=density, scaling=scaling,
                                      trim_scope=trim_scope, merge_fn="mean", trim_rule=trim_rule)
    raise ValueError(f"combine must be 'task_arithmetic' or 'ties', got {combine!r}")
