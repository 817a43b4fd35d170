"""The order of the experts of a continual merge (OPCM, DOP: an ordered expert list folded one at a time).

Shared by those methods; registers nothing.
"""

from __future__ import annotations

import torch

__all__ = ["expert_order", "shuffled_order"]


def shuffled_order(n: int, seed: int) -> list[int]:
    """A seeded permutation of ``range(n)`` (FusionBench shuffles the model order by default)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def expert_order(n: int, shuffle: bool, seed: int) -> list[int]:
    """The order in which ``n`` experts arrive: as given, or :func:`shuffled_order` with ``shuffle``."""
    return shuffled_order(n, seed) if shuffle else list(range(n))
