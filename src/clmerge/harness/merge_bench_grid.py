"""Grid search on validation that extends each grid until the chosen value is interior.

A value chosen at the edge of its grid says only that the optimum lies at or beyond that edge. So after each
search, every numeric hyperparameter whose chosen value sits at an edge of its grid gets one more value beyond
that edge, the new grid points are evaluated, and the search repeats, until every chosen value is interior,
sits at the boundary of the hyperparameter's domain (e.g. a rank ratio of 1), or the cap on extensions is hit.

The step of an extension is the grid's own: an arithmetic grid (equal differences) is extended by its step,
a geometric grid (equal ratios) by its ratio, any other grid by the spacing of its two values at that edge.
A step that would leave the domain is replaced by halving the distance to the domain's boundary.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

__all__ = ["DOMAINS", "expand", "next_value", "search"]

# (low, high, low_inclusive, high_inclusive) of each numeric hyperparameter of the benchmark's methods.
DOMAINS: dict[str, tuple[float, float, bool, bool]] = {
    "scaling": (0.0, math.inf, False, False),
    "rank_ratio": (0.0, 1.0, True, True),
    "density": (0.0, 1.0, False, True),
    "drop_rate": (0.0, 1.0, True, False),
}


def expand(space: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every point of the product grid ``space`` (``[{}]`` for an empty space)."""
    keys = list(space)
    return [dict(zip(keys, vals)) for vals in itertools.product(*(space[k] for k in keys))] or [{}]


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


def next_value(values: list[float], upward: bool, domain: tuple[float, float, bool, bool]) -> float | None:
    """The value one step beyond the top (``upward``) or bottom of the sorted grid ``values``; None if the edge
    is already the domain's (closed) boundary."""
    lo, hi, lo_in, hi_in = domain
    v = sorted(values)
    edge, inner = (v[-1], v[-2]) if upward else (v[0], v[1])
    bound, bound_in = (hi, hi_in) if upward else (lo, lo_in)
    if _close(edge, bound):
        return None
    diffs = [b - a for a, b in zip(v, v[1:])]
    ratios = [b / a for a, b in zip(v, v[1:])] if v[0] > 0 else []
    if all(_close(d, diffs[0]) for d in diffs):
        cand = edge + diffs[0] if upward else edge - diffs[0]
    elif ratios and all(_close(r, ratios[0]) for r in ratios):
        cand = edge * ratios[0] if upward else edge / ratios[0]
    else:
        cand = edge + (edge - inner)
    cand = round(cand, 10)  # (0.95 + 0.05 is 0.9999999999999999: compare the value that will be used)
    if _close(cand, bound):
        inside = bound_in
    else:
        inside = cand < bound if upward else cand > bound
    if not inside:
        cand = bound if bound_in else round(edge + (bound - edge) / 2, 10)
    return cand


def search(space: dict[str, list[Any]], score: Callable[[dict[str, Any]], float], *, max_extensions: int = 4,
           domains: dict[str, tuple[float, float, bool, bool]] = DOMAINS) -> dict[str, Any]:
    """Maximise ``score`` over the grid ``space``, extending it until the best value of every numeric
    hyperparameter with at least two values is interior (module docstring).

    Args:
        space: ``{name: [values]}``; names without a domain, and one-value lists, are searched but not extended.
        score: validation score of one point (higher is better); called once per distinct point.
        max_extensions: at most this many extensions per hyperparameter and direction.
        domains: the allowed range of each hyperparameter.

    Returns:
        ``{"best": point, "best_score": s, "seen": [{"hp", "val"}...] (in evaluation order), "grid": final space,
        "edges": {name: "interior" | "low" | "high" | "domain-low" | "domain-high" | "fixed"}}``; ``edges`` says
        where each chosen value ended up ("low"/"high": still at an edge when the cap was hit).
    """
    grid = {k: list(v) for k, v in space.items()}
    scores: dict[tuple, float] = {}
    seen: list[dict[str, Any]] = []
    used = {(k, d): 0 for k in grid for d in ("low", "high")}
    while True:
        for hp in expand(grid):
            key = tuple(sorted(hp.items()))
            if key not in scores:
                scores[key] = float(score(hp))
                seen.append({"hp": hp, "val": scores[key]})
        best = max(seen, key=lambda r: r["val"])  # first of equal scores: evaluation order breaks ties
        edges, grew = {}, False
        for k, values in grid.items():
            edges[k], grew_k = _edge(k, values, best["hp"][k], domains, used, max_extensions)
            grew |= grew_k
        if not grew:
            return {"best": best["hp"], "best_score": best["val"], "seen": seen, "grid": grid, "edges": edges}


def _edge(name: str, values: list, chosen: Any, domains: dict, used: dict, cap: int) -> tuple[str, bool]:
    """Where ``chosen`` sits in ``values``; appends one value beyond an edge (in place) when it is at one."""
    if name not in domains or len(values) < 2 or not all(isinstance(v, (int, float)) for v in values):
        return "fixed", False
    v = sorted(values)
    if v[0] < chosen < v[-1]:
        return "interior", False
    side = "high" if _close(chosen, v[-1]) else "low"
    new = next_value(values, side == "high", domains[name])
    if new is None:
        return f"domain-{side}", False
    if used[(name, side)] >= cap:
        return side, False
    used[(name, side)] += 1
    values.append(new)
    values.sort()
    return side, True
