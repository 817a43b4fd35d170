"""Shared fixtures for the merging tests: tiny random parameter dicts."""

from __future__ import annotations

import torch

SHAPES = {"blk.fc1.weight": (6, 5), "blk.fc1.bias": (6,), "blk.fc2.weight": (4, 6), "norm.weight": (4,),
          "embeddings.position_embeddings": (3, 4)}


def make_models(n: int = 3, seed: int = 0, dtype: torch.dtype = torch.float32, scale: float = 0.1):
    """``(base, [experts])`` with the keys of ``SHAPES`` plus an integer buffer."""
    g = torch.Generator().manual_seed(seed)
    base = {k: torch.randn(s, generator=g).to(dtype) for k, s in SHAPES.items()}
    base["buf.index"] = torch.arange(3)
    experts = []
    for _ in range(n):
        e = {k: (v + scale * torch.randn(v.shape, generator=g).to(dtype)) if v.is_floating_point() else v.clone()
             for k, v in base.items()}
        experts.append(e)
    return base, experts


def flat(sd: dict[str, torch.Tensor], keys=None) -> torch.Tensor:
    keys = keys or [k for k, v in sd.items() if v.is_floating_point()]
    return torch.cat([sd[k].reshape(-1).double() for k in keys])


def float_keys(sd):
    return [k for k, v in sd.items() if v.is_floating_point()]
