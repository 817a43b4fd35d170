"""The next value past the edge of a searched grid, when the best value tried sits on that edge: the one
rule of a sweep's ``select:`` (geometric grids of learning rates) and ``clmerge merge --tune`` (linear ranges).

For a grid of ``n`` values from ``lo`` to ``hi``, the k-th value past the top is ``hi * r**k`` with
``r = (hi / lo) ** (1 / (n - 1))`` (``scale="geometric"``, positive values), or ``hi + k * d`` with
``d = (hi - lo) / (n - 1)`` (``scale="linear"``); past the bottom ``lo / r**k`` or ``lo - k * d``. ``k`` is one
more than the values already tried past that edge. A geometric value is rounded to one significant digit (to
more when that value was tried; a whole number for a grid of integers), a linear one to 12 decimals.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["SCALES", "past_edge"]

SCALES = ("geometric", "linear")


def _rounded(x: float, tried: list[Any], whole: bool) -> float | int:
    if whole and round(x) not in tried:
        return int(round(x))
    for digits in range(3):
        y = float(f"{x:.{digits}e}")
        if y not in tried:
            return y
    return x


def past_edge(values: list[float], tried: list[float], best: float, *, scale: str = "geometric") -> Any | None:
    """The next value past the edge of ``values`` (the grid as given) that ``best`` sits at, among ``tried``
    (the grid and the values already added past it); None when ``best`` is interior or the grid has no step."""
    if scale not in SCALES:
        raise ValueError(f"scale {scale!r}: expected one of {', '.join(SCALES)}")
    lo, hi, n = min(values), max(values), len(values)
    if n < 2 or lo == hi:
        return None
    up = best == max(tried)
    if not up and best != min(tried):
        return None
    k = 1 + sum((v > hi) if up else (v < lo) for v in tried)
    if scale == "linear":
        d = (hi - lo) / (n - 1)
        return round(hi + k * d if up else lo - k * d, 12)
    r = (hi / lo) ** (1 / (n - 1))
    x = hi * r ** k if up else lo / r ** k
    return _rounded(x, tried, all(isinstance(v, int) for v in values)) if math.isfinite(x) else None
