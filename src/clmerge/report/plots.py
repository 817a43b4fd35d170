"""Plots for run reports, returned as PNG bytes.

Every function builds its own :class:`matplotlib.figure.Figure` (no pyplot, no global backend switch, no
state kept between calls) and renders it with the Agg canvas, so it is safe in headless processes and in
threads that also use pyplot elsewhere.

Accuracy matrices follow :mod:`clmerge.metrics`: ``R[i][j]`` is the accuracy (percent) on task j after
training task i; ``None`` marks an entry that was not evaluated (above the diagonal, usually).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

from typing import TYPE_CHECKING

import numpy as np

from ..utils.extras import require_extra

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "PNG_SIGNATURE",
    "new_figure",
    "to_png",
    "matrix_to_array",
    "ACCURACY_LIMITS",
    "fix_accuracy_axis",
    "accuracy_heatmap",
    "accuracy_heatmap_figure",
    "accuracy_curves",
    "accuracy_curves_figure",
    "forgetting_bars",
    "epoch_losses",
    "step_losses",
    "loss_curve",
    "value_panels",
    "multi_order_curves",
    "multi_order_curves_figure",
    "metric_bars",
    "metric_bars_figure",
]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_DPI = 100
MAX_LEGEND = 12  # series per panel that still get a readable legend
ACCURACY_LIMITS = (0.0, 100.0)  # every accuracy axis (and colour scale) spans 0-100 %, so plots compare


def new_figure(width: float, height: float) -> Figure:
    """A figure on its own Agg canvas; matplotlib (the ``plots`` extra) is imported here, on first use."""
    require_extra("matplotlib", what="drawing report plots")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=_DPI)
    FigureCanvasAgg(fig)
    return fig


def to_png(fig: Figure) -> bytes:
    """``fig`` as PNG bytes, free of the matplotlib version (the same bytes on every run)."""
    buf = io.BytesIO()
    # No "Software" tEXt chunk: keeps the bytes free of the matplotlib URL and version.
    fig.savefig(buf, format="png", dpi=_DPI, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


def fix_accuracy_axis(ax: Any) -> None:
    """Pin the y axis of ``ax`` to :data:`ACCURACY_LIMITS`: plots of different runs read alike."""
    ax.set_ylim(*ACCURACY_LIMITS)


def _label(names: Sequence[str] | None, j: int) -> str:
    return str(names[j]) if names is not None and j < len(names) else f"task {j}"


def matrix_to_array(R: Sequence[Sequence[float | None]]) -> np.ndarray:
    """Convert an accuracy matrix with ``None`` holes to a square float array with ``nan`` holes.

    Short rows are padded with ``nan`` so a ragged matrix still plots.

    Args:
        R: the accuracy matrix, a list of rows.

    Returns:
        A ``(T, T)`` float64 array, T = max(number of rows, longest row).

    Raises:
        ValueError: if R is empty or holds something that is neither a number nor ``None``.
    """
    if not R:
        raise ValueError("accuracy matrix is empty")
    size = max(len(R), max(len(row) for row in R))
    out = np.full((size, size), np.nan)
    for i, row in enumerate(R):
        for j, value in enumerate(row):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"accuracy matrix entry [{i}][{j}] is {value!r}, expected a number or null")
            out[i, j] = float(value)
    return out


def accuracy_heatmap(
    R: Sequence[Sequence[float | None]],
    task_names: Sequence[str] | None = None,
    title: str = "Accuracy matrix",
) -> bytes:
    """:func:`accuracy_heatmap_figure` as PNG bytes."""
    return to_png(accuracy_heatmap_figure(R, task_names, title))


def accuracy_heatmap_figure(
    R: Sequence[Sequence[float | None]],
    task_names: Sequence[str] | None = None,
    title: str = "Accuracy matrix",
) -> Figure:
    """Heatmap of the accuracy matrix with every evaluated cell annotated.

    Rows are "after training task i", columns "evaluated on task j". Missing entries (``None``, normally
    the ones above the diagonal) are left blank.

    Args:
        R: accuracy matrix in percent.
        task_names: labels for the tasks; ``task j`` where missing.
        title: the figure title.

    Returns:
        The figure; its colour scale spans :data:`ACCURACY_LIMITS`.
    """
    A = matrix_to_array(R)
    T = A.shape[0]
    side = min(2.0 + 0.55 * T, 12.0)
    fig = new_figure(side + 1.2, side)
    ax = fig.add_subplot()
    im = ax.imshow(np.ma.masked_invalid(A), cmap="viridis", vmin=ACCURACY_LIMITS[0],
                   vmax=ACCURACY_LIMITS[1])
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="accuracy (%)")
    fontsize = max(5.0, min(9.0, 120.0 / T))
    for i in range(T):
        for j in range(T):
            if np.isfinite(A[i, j]) and T <= 30:  # beyond ~30 tasks the numbers cannot be read anyway
                color = "black" if A[i, j] > 60.0 else "white"
                ax.text(j, i, f"{A[i, j]:.1f}", ha="center", va="center", color=color, fontsize=fontsize)
    labels = [_label(task_names, j) for j in range(T)]
    ax.set_xticks(range(T), labels, rotation=45, ha="right", fontsize=fontsize)
    ax.set_yticks(range(T), labels, fontsize=fontsize)
    ax.set_xlabel("evaluated on task j")
    ax.set_ylabel("after training task i")
    ax.set_title(title)
    return fig


def _average_curve(A: np.ndarray) -> list[float]:
    """Task-weighted mean of the evaluated entries of row i over columns j <= i (nan if none)."""
    curve = []
    for i in range(A.shape[0]):
        seen = A[i, : i + 1][np.isfinite(A[i, : i + 1])]
        curve.append(float(seen.mean()) if seen.size else float("nan"))
    return curve


def accuracy_curves(R: Sequence[Sequence[float | None]], task_names: Sequence[str] | None = None) -> bytes:
    """:func:`accuracy_curves_figure` as PNG bytes."""
    return to_png(accuracy_curves_figure(R, task_names))


def accuracy_curves_figure(R: Sequence[Sequence[float | None]], task_names: Sequence[str] | None = None) -> Figure:
    """Accuracy on each task j as later tasks are learned (i >= j), plus the bold average curve.

    The average at step i is the task-weighted mean of ``R[i][j]`` over the evaluated j <= i, i.e. the
    accuracy curve whose mean is AAA.

    Args:
        R: accuracy matrix in percent.
        task_names: labels for the tasks (legend); ``task j`` where missing.

    Returns:
        The figure; its y axis spans :data:`ACCURACY_LIMITS`.
    """
    A = matrix_to_array(R)
    T = A.shape[0]
    fig = new_figure(6.4, 4.0)
    ax = fig.add_subplot()
    steps = np.arange(T)
    for j in range(T):
        ys = A[j:, j]
        ok = np.isfinite(ys)
        if ok.any():
            label = _label(task_names, j)
            ax.plot(steps[j:][ok], ys[ok], marker="o", markersize=3, linewidth=1, alpha=0.7, label=label)
    ax.plot(steps, _average_curve(A), color="black", linewidth=2.5, marker="s", label="average")
    ax.set_xticks(steps)
    ax.set_xlabel("after training task i")
    ax.set_ylabel("accuracy (%)")
    fix_accuracy_axis(ax)
    ax.set_title("Accuracy over tasks")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=max(1, (T + 1) // 12), loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def forgetting_bars(
    forgetting_per_task: Sequence[float | None], task_names: Sequence[str] | None = None
) -> bytes:
    """Bar chart of the forgetting of each task (best earlier accuracy minus final accuracy).

    Args:
        forgetting_per_task: one value per task j < T-1, in percentage points; ``None`` draws no bar.
        task_names: labels for the tasks; ``task j`` where missing.

    Returns:
        The PNG image as bytes.
    """
    values = np.array([np.nan if v is None else float(v) for v in forgetting_per_task], dtype=float)
    n = len(values)
    fig = new_figure(min(2.5 + 0.45 * max(n, 1), 12.0), 3.6)
    ax = fig.add_subplot()
    xs = np.arange(n)
    ax.bar(xs, np.nan_to_num(values), color=np.where(values >= 0, "tab:red", "tab:green"))
    ok = np.isfinite(values)
    if ok.any():
        ax.axhline(float(values[ok].mean()), color="black", linestyle="--", linewidth=1, label="mean")
        ax.legend(fontsize=8)
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_xticks(xs, [_label(task_names, j) for j in range(n)], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("forgetting (points)")
    ax.set_title("Forgetting per task")
    ax.grid(axis="y", alpha=0.3)
    return to_png(fig)


def epoch_losses(events: Sequence[Mapping[str, Any]]) -> list[tuple[Any, float]]:
    """The ``(task, loss)`` pairs of the ``epoch`` events that carry a numeric loss, in file order."""
    out = []
    for ev in events:
        loss = ev.get("loss")
        if ev.get("event") == "epoch" and isinstance(loss, (int, float)) and not isinstance(loss, bool):
            out.append((ev.get("task"), float(loss)))
    return out


def step_losses(events: Sequence[Mapping[str, Any]]) -> list[tuple[Any, float, float]]:
    """``(task, step, loss)`` of the ``step`` events, ``step`` counted cumulatively over the whole run.

    Each ``step`` event holds the mean loss of its last ``steps`` optimizer steps; the x position of the
    point is the running sum of ``steps`` (inner training loops of a method, e.g. a warm-up, count too).
    """
    out, at = [], 0.0
    for ev in events:
        loss, steps = ev.get("loss"), ev.get("steps", 1)
        if ev.get("event") != "step" or not _is_number(loss) or not _is_number(steps):
            continue
        at += float(steps)
        out.append((ev.get("task"), at, float(loss)))
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def loss_curve(events: Sequence[Mapping[str, Any]]) -> bytes:
    """Training loss across all tasks, with a dashed line at each task boundary.

    Uses the ``step`` records (mean loss per logging interval, x in optimizer steps) when the run has them,
    else the ``epoch`` records (one point per epoch, runs written before step logging); other events are
    ignored.

    Args:
        events: the parsed lines of ``events.jsonl``.

    Returns:
        The PNG image as bytes (an empty, labelled plot when there is no loss).
    """
    steps = step_losses(events)
    if steps:
        points, xlabel = [(task, x, loss) for task, x, loss in steps], "optimizer step (all tasks)"
    else:
        epochs = epoch_losses(events)
        points, xlabel = [(task, float(k), loss) for k, (task, loss) in enumerate(epochs, 1)], "epoch (all tasks)"
    fig = new_figure(6.4, 3.6)
    ax = fig.add_subplot()
    segments: list[list[tuple[float, float]]] = []  # one per run of consecutive points of the same task
    previous, last_x = object(), 0.0
    for task, x, loss in points:
        if task != previous:
            if segments:
                ax.axvline((last_x + x) / 2, color="grey", linestyle="--", linewidth=0.8)
            ax.annotate(f"T{task}", (x, 1.0), xycoords=("data", "axes fraction"), fontsize=7, va="bottom")
            segments.append([])
            previous = task
        segments[-1].append((x, loss))
        last_x = x
    for seg in segments:  # no line across a task boundary: the jump there is a new task, not a step
        ax.plot([x for x, _ in seg], [y for _, y in seg], color="C0", marker="." if len(points) <= 200 else None,
                linewidth=1.2)
    if not points:
        ax.text(0.5, 0.5, "no training losses recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("training loss")
    ax.set_title("Training loss", pad=14)
    ax.grid(alpha=0.3)
    return to_png(fig)


def value_panels(panels: Mapping[str, Mapping[str, Sequence[float | None]]], xlabel: str = "task") -> bytes:
    """Small multiples of method values: one panel per quantity, one line per series in it.

    Quantities of different scales (P&M's alpha and its Fisher trace) get their own axes. A panel with
    more than :data:`MAX_LEGEND` series draws them thin, without a legend, plus their median in black.

    Args:
        panels: panel title -> {series label -> values by position (task); ``None`` leaves a gap}.
        xlabel: the x-axis label of every panel.

    Returns:
        The PNG image as bytes.
    """
    n = max(len(panels), 1)
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    fig = new_figure(4.2 * cols, 3.0 * rows)
    for k, (title, series) in enumerate(panels.items()):
        ax = fig.add_subplot(rows, cols, k + 1)
        arrays = {str(lbl): np.array([np.nan if not _is_number(v) else float(v) for v in vs], dtype=float)
                  for lbl, vs in series.items()}
        many = len(arrays) > MAX_LEGEND
        for label, ys in arrays.items():
            ax.plot(np.arange(len(ys)), ys, marker="o", markersize=3, linewidth=0.8 if many else 1.4,
                    alpha=0.5 if many else 1.0, label=label)
        if many:
            width = max(len(ys) for ys in arrays.values())
            stack = np.full((len(arrays), width), np.nan)
            for i, ys in enumerate(arrays.values()):
                stack[i, : len(ys)] = ys
            with np.errstate(all="ignore"):
                ax.plot(np.arange(width), np.nanmedian(stack, axis=0), color="black", linewidth=2.2, label="median")
        longest = max((len(ys) for ys in arrays.values()), default=0)
        if longest <= 12:
            ax.set_xticks(range(longest))
        else:
            from matplotlib.ticker import MaxNLocator

            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"{title} ({len(arrays)} series)" if many else title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if 1 < len(arrays) <= MAX_LEGEND or many:
            handles = ax.get_legend_handles_labels()
            ax.legend(handles[0][-1:] if many else handles[0], handles[1][-1:] if many else handles[1], fontsize=7)
    fig.tight_layout()
    return to_png(fig)


def multi_order_curves(curves: Mapping[str, Sequence[float | None]]) -> bytes:
    """:func:`multi_order_curves_figure` as PNG bytes."""
    return to_png(multi_order_curves_figure(curves))


def multi_order_curves_figure(curves: Mapping[str, Sequence[float | None]]) -> Figure:
    """Average-accuracy curve of each run (e.g. one per task order), on shared axes.

    Args:
        curves: label -> accuracy curve (percent after each task; ``None`` leaves a gap).

    Returns:
        The figure; its y axis spans :data:`ACCURACY_LIMITS`.
    """
    fig = new_figure(6.4, 4.0)
    ax = fig.add_subplot()
    for label, curve in curves.items():
        ys = np.array([np.nan if v is None else float(v) for v in curve], dtype=float)
        ax.plot(np.arange(len(ys)), ys, marker="o", markersize=3, linewidth=1.5, label=str(label))
    longest = max((len(c) for c in curves.values()), default=0)
    ax.set_xticks(range(longest))
    ax.set_xlabel("after training task i")
    ax.set_ylabel("average accuracy (%)")
    fix_accuracy_axis(ax)
    ax.set_title("Accuracy curve per run")
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def metric_bars(values: Mapping[str, Mapping[str, float | None]], metrics: Sequence[str]) -> bytes:
    """:func:`metric_bars_figure` as PNG bytes."""
    return to_png(metric_bars_figure(values, metrics))


def metric_bars_figure(values: Mapping[str, Mapping[str, float | None]], metrics: Sequence[str]) -> Figure:
    """Grouped bar chart comparing runs: one group per run, one bar per metric.

    Args:
        values: run label -> {metric name -> value}; a missing or ``None`` value draws no bar.
        metrics: which metric names to draw, in order.

    Returns:
        The figure; its y axis spans :data:`ACCURACY_LIMITS`, reaching below 0 only for a negative value
        (forgetting or transfer can be).
    """
    labels = list(values)
    n, m = len(labels), max(len(metrics), 1)
    fig = new_figure(min(3.0 + 0.9 * max(n, 1) * m / 3, 14.0), 4.0)
    ax = fig.add_subplot()
    width = 0.8 / m
    xs = np.arange(n)
    for k, metric in enumerate(metrics):
        ys = [values[r].get(metric) for r in labels]
        ys = [float(y) if isinstance(y, (int, float)) and not isinstance(y, bool) else np.nan for y in ys]
        ax.bar(xs + (k - (m - 1) / 2) * width, np.nan_to_num(ys), width, label=metric)
    ax.set_xticks(xs, labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("percent / points")
    lowest = min([0.0, *(float(np.nanmin(b.datavalues)) for b in ax.containers if len(b.datavalues))])
    ax.set_ylim(lowest - (5.0 if lowest < 0 else 0.0), ACCURACY_LIMITS[1])
    ax.set_title("Runs compared")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return fig
