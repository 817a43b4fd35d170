"""The numbers behind the sweep page's plots, read from each run's ``metrics.json`` and averaged over a
group's runs (seeds). No plotting here: :mod:`clmerge.report.sweep_plots` draws what this returns.

Accuracy matrices follow :mod:`clmerge.metrics`: ``R[i][j]`` is the accuracy (percent) on task j after
training task i. Per run:

- CIL curve: ``A_i = mean_{j<=i} R[i][j]`` (``metrics.json``'s ``accuracy_curve``, derived from the matrix
  when absent); TIL curve: the same on ``til_accuracy_matrix`` (the task id given at test time);
- forgetting of task j: ``max_{j<=i<T-1} R[i][j] - R[T-1][j]`` for j < T-1;
- old-vs-new split after task t: ``new_t = R[t][t]`` (the task just learned) and
  ``old_t = mean_{j<t} R[t][j]`` (task-weighted mean over the tasks learned before; none for t = 0).

Across runs (:func:`seed_band`): per position, mean and standard error ``s / sqrt(n)`` of the runs that have
a value there (:func:`clmerge.metrics.mean_se`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from clmerge.metrics import accuracy_curve, forgetting_per_task, mean_se

__all__ = ["Band", "seed_band", "old_new_split", "cil_curve", "til_curve", "forgetting_values"]

Series = Sequence[float | None]


@dataclass
class Band:
    """One group's curve: per position the mean over its runs, the standard error (None below 2 runs) and
    the number of runs with a value."""

    mean: list[float | None]
    se: list[float | None]
    n: list[int]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def seed_band(series: Sequence[Series]) -> Band:
    """Mean ± SE per position over ``series`` (one per run; ``None`` or a missing position is left out)."""
    width = max((len(s) for s in series), default=0)
    band = Band([], [], [])
    for k in range(width):
        xs = [float(s[k]) for s in series if k < len(s) and _number(s[k])]
        m, se = mean_se(xs) if xs else (None, math.nan)
        band.mean.append(m)
        band.se.append(None if math.isnan(se) else se)
        band.n.append(len(xs))
    return band


def old_new_split(R: Sequence[Sequence[float | None]]) -> tuple[list[float | None], list[float | None]]:
    """``(new, old)`` per task t: ``new[t] = R[t][t]``, ``old[t] = mean_{j<t} R[t][j]``; ``None`` where t = 0
    (nothing older) or an entry is missing."""
    new: list[float | None] = []
    old: list[float | None] = []
    for t, row in enumerate(R):
        new.append(float(row[t]) if t < len(row) and _number(row[t]) else None)
        before = list(row[:t])
        ok = t > 0 and len(before) == t and all(_number(v) for v in before)
        old.append(sum(float(v) for v in before) / t if ok else None)
    return new, old


def _curve(stored: Any, R: Any) -> list[float | None] | None:
    if isinstance(stored, list) and stored:
        return [float(v) if _number(v) else None for v in stored]
    try:
        return accuracy_curve(R)
    except (ValueError, TypeError, IndexError):
        return None


def cil_curve(metrics: Mapping[str, Any]) -> list[float | None] | None:
    """The run's class-incremental accuracy after each task (None when neither curve nor matrix is usable)."""
    return _curve(metrics.get("accuracy_curve"), metrics.get("accuracy_matrix"))


def til_curve(metrics: Mapping[str, Any]) -> list[float | None] | None:
    """The run's task-incremental accuracy after each task, or None when the run has no TIL numbers."""
    til = metrics.get("til") if isinstance(metrics.get("til"), dict) else {}
    R = metrics.get("til_accuracy_matrix")
    if not til.get("accuracy_curve") and not isinstance(R, list):
        return None
    return _curve(til.get("accuracy_curve"), R)


def forgetting_values(metrics: Mapping[str, Any]) -> list[float | None] | None:
    """The run's forgetting per task (``forgetting_per_task``, derived from the matrix when absent)."""
    stored = metrics.get("forgetting_per_task")
    if isinstance(stored, list):
        return [float(v) if _number(v) else None for v in stored]
    try:
        return forgetting_per_task(metrics.get("accuracy_matrix"))
    except (ValueError, TypeError, IndexError):
        return None
