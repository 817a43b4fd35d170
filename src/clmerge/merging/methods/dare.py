"""DARE's random drop (Yu et al. 2024, "Language models are Super Mario", Eq. 1-2): drop task-vector entries at
random and rescale the rest.

Shared math, registers nothing: the drop of the ``dare`` row of the sparsification family
(:mod:`.sparse_family`), the seeded generators that DELLA's MAGPRUNE draws from, and KnOTS-DARE's drop of the
task representations."""

from __future__ import annotations

import zlib

import torch
from torch import Tensor

from ...utils.device import cpu_draw
from .driver import CHUNK

__all__ = ["dare_tensor", "dare_generator", "dare_sum_blocks"]


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
