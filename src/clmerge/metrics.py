"""Continual-learning metrics from an accuracy matrix.

``R[i][j]`` is the accuracy (percent) on task j's test set after training task i (0-based). Entries above the
diagonal (j > i) are ``None`` unless the scenario lets future tasks be evaluated (domain-incremental).
All averages are task-weighted (each task counts equally) unless a ``sizes`` vector is given, in which case
the sample-weighted versions use those test-set sizes (PILOT / SD-LoRA report sample-weighted top-1).

Definitions (T tasks, 0-based):
- Acc = mean_j R[T-1][j]  (final average accuracy)
- AAA = mean_i A_i with A_i = mean_{j<=i} R[i][j]  (average anytime accuracy; mean of the accuracy curve)
- forgetting_j = max_{i<T-1, i>=j} R[i][j] - R[T-1][j] for j < T-1; average forgetting = mean_j forgetting_j
- BWT = mean_{j<T-1} (R[T-1][j] - R[j][j])
- FWT = mean_{j>=1} (R[j-1][j] - b_j), b_j the accuracy of the initial model on task j (needs both)
- plasticity = mean_j R[j][j]  (accuracy on the task just learned)
- order robustness (HALRP, Li et al., TKDE 2024, Sec. 5.3, Eq. 14): for K task orders,
  OPD_t = max_k R^k_t - min_k R^k_t, where
  R^k_t is the final accuracy on task t (identified by content) under order k; MOPD = max_t OPD_t,
  AOPD = mean_t OPD_t.
- across runs (seeds): mean ± standard error, SE = s / sqrt(n) with the sample standard deviation
  s^2 = sum_k (x_k - mean)^2 / (n - 1)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "validate_matrix",
    "final_accuracy",
    "accuracy_curve",
    "average_anytime_accuracy",
    "forgetting_per_task",
    "average_forgetting",
    "backward_transfer",
    "forward_transfer",
    "plasticity",
    "summarize",
    "order_robustness",
    "mean_se",
]

Matrix = Sequence[Sequence[float | None]]


def _w(sizes: Sequence[int] | None, idx: Sequence[int]) -> np.ndarray:
    if sizes is None:
        return np.ones(len(idx))
    return np.asarray([sizes[j] for j in idx], dtype=float)


def _avg(values: list[float], weights: np.ndarray) -> float:
    return float(np.dot(values, weights) / weights.sum())


def validate_matrix(R: Matrix) -> int:
    """Check that R is square with every entry on and below the diagonal present; return T."""
    T = len(R)
    if T == 0:
        raise ValueError("accuracy matrix is empty")
    for i, row in enumerate(R):
        if len(row) != T:
            raise ValueError(f"accuracy matrix row {i} has {len(row)} entries, expected {T}")
        for j in range(i + 1):
            if row[j] is None:
                raise ValueError(f"accuracy matrix entry [{i}][{j}] is missing")
    return T


def final_accuracy(R: Matrix, sizes: Sequence[int] | None = None) -> float:
    T = validate_matrix(R)
    return _avg([R[T - 1][j] for j in range(T)], _w(sizes, range(T)))


def accuracy_curve(R: Matrix, sizes: Sequence[int] | None = None) -> list[float]:
    """A_i = average accuracy over tasks 0..i after training task i."""
    T = validate_matrix(R)
    return [_avg([R[i][j] for j in range(i + 1)], _w(sizes, range(i + 1))) for i in range(T)]


def average_anytime_accuracy(R: Matrix, sizes: Sequence[int] | None = None) -> float:
    return float(np.mean(accuracy_curve(R, sizes)))


def forgetting_per_task(R: Matrix) -> list[float]:
    """forgetting_j = best earlier accuracy on task j minus final accuracy, for j < T-1."""
    T = validate_matrix(R)
    return [max(R[i][j] for i in range(j, T - 1)) - R[T - 1][j] for j in range(T - 1)]


def average_forgetting(R: Matrix, sizes: Sequence[int] | None = None) -> float | None:
    f = forgetting_per_task(R)
    return _avg(f, _w(sizes, range(len(f)))) if f else None


def backward_transfer(R: Matrix, sizes: Sequence[int] | None = None) -> float | None:
    T = validate_matrix(R)
    if T < 2:
        return None
    return _avg([R[T - 1][j] - R[j][j] for j in range(T - 1)], _w(sizes, range(T - 1)))


def forward_transfer(R: Matrix, initial: Sequence[float] | None, sizes: Sequence[int] | None = None) -> float | None:
    """Needs R[j-1][j] (future-task evaluation) and the initial model's accuracies; ``None`` if undefined."""
    T = validate_matrix(R)
    if T < 2 or initial is None or any(R[j - 1][j] is None for j in range(1, T)):
        return None
    return _avg([R[j - 1][j] - initial[j] for j in range(1, T)], _w(sizes, range(1, T)))


def plasticity(R: Matrix, sizes: Sequence[int] | None = None) -> float:
    T = validate_matrix(R)
    return _avg([R[j][j] for j in range(T)], _w(sizes, range(T)))


def summarize(R: Matrix, *, sizes: Sequence[int] | None = None, initial: Sequence[float] | None = None) -> dict:
    """Every metric, task-weighted, plus ``*_sample`` sample-weighted versions when ``sizes`` is given."""
    out = {
        "acc": final_accuracy(R),
        "aaa": average_anytime_accuracy(R),
        "forgetting": average_forgetting(R),
        "bwt": backward_transfer(R),
        "fwt": forward_transfer(R, initial),
        "plasticity": plasticity(R),
        "accuracy_curve": accuracy_curve(R),
        "forgetting_per_task": forgetting_per_task(R),
    }
    if sizes is not None:
        out.update(
            acc_sample=final_accuracy(R, sizes),
            aaa_sample=average_anytime_accuracy(R, sizes),
            forgetting_sample=average_forgetting(R, sizes),
            bwt_sample=backward_transfer(R, sizes),
            accuracy_curve_sample=accuracy_curve(R, sizes),
        )
    return out


def order_robustness(final_acc_by_order: Sequence[dict[str, float]]) -> dict:
    """OPD per task, MOPD and AOPD from each order's final accuracies keyed by task identity (content key).

    Args:
        final_acc_by_order: one dict per order, ``{task_key: final accuracy on that task}``; every order must
            cover the same task keys.
    """
    if len(final_acc_by_order) < 2:
        raise ValueError("order robustness needs at least two task orders")
    keys = set(final_acc_by_order[0])
    for k, d in enumerate(final_acc_by_order[1:], start=1):
        if set(d) != keys:
            raise ValueError(f"order {k} covers tasks {sorted(d)}, order 0 covers {sorted(keys)}")
    opd = {t: max(d[t] for d in final_acc_by_order) - min(d[t] for d in final_acc_by_order) for t in sorted(keys)}
    return {"opd": opd, "mopd": max(opd.values()), "aopd": float(np.mean(list(opd.values())))}


def mean_se(xs: Sequence[float]) -> tuple[float, float]:
    """``(mean, standard error)`` with the sample standard deviation: ``s / sqrt(n)``, ``s^2 = sum (x -
    mean)^2 / (n - 1)``; the standard error of a single value is NaN (unknown)."""
    a = np.asarray(xs, dtype=float)
    if len(a) < 2:
        return float(a.mean()), math.nan
    return float(a.mean()), float(a.std(ddof=1) / math.sqrt(len(a)))
