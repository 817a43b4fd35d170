"""Plots of the sweep page: one line (or bar) per group of runs with its seed band, every accuracy axis at
0-100 %. Each ``*_figure`` function returns a :class:`matplotlib.figure.Figure` (tests read its axes);
:func:`clmerge.report.plots.to_png` turns it into the page's PNG.

Groups keep their colour across the page's figures (``C0`` for the first group, ``C1`` for the next, ...).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from clmerge.report.plots import fix_accuracy_axis, new_figure
from clmerge.report.sweep_data import Band

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["band_panels_figure", "forgetting_figure"]


def _arrays(band: Band) -> tuple[np.ndarray, np.ndarray]:
    mean = np.array([np.nan if v is None else v for v in band.mean], dtype=float)
    se = np.array([0.0 if v is None else v for v in band.se], dtype=float)
    return mean, se


def _draw_band(ax, band: Band, label: str, color: str) -> None:
    mean, se = _arrays(band)
    xs = np.arange(len(mean))
    ax.plot(xs, mean, color=color, marker="o", markersize=4, linewidth=1.8, label=label)
    ax.fill_between(xs, mean - se, mean + se, color=color, alpha=0.2, linewidth=0)


def band_panels_figure(panels: Mapping[str, Mapping[str, Band]], *, xlabel: str = "after training task t",
                       ylabel: str = "accuracy (%)") -> Figure:
    """Side-by-side panels (title -> {group label -> band}), each a mean line per group with a ± SE band;
    every y axis spans 0-100 %, the x axis counts tasks from 0; the legend sits under the panels."""
    n = max(len(panels), 1)
    fig = new_figure(5.2 * n, 4.0)
    groups = list(dict.fromkeys(g for bands in panels.values() for g in bands))
    for k, (title, bands) in enumerate(panels.items()):
        ax = fig.add_subplot(1, n, k + 1)
        for label, band in bands.items():
            _draw_band(ax, band, label, f"C{groups.index(label) % 10}")
        width = max((len(b.mean) for b in bands.values()), default=0)
        ax.set_xticks(range(width))
        fix_accuracy_axis(ax)
        ax.set_title(title, fontsize=11)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    _legend_below(fig, len(groups))
    return fig


def _legend_below(fig, n: int) -> None:
    handles, labels = fig.axes[0].get_legend_handles_labels() if fig.axes else ([], [])
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(n, 6), fontsize=9, frameon=False)
        fig.subplots_adjust(bottom=0.22 + 0.05 * ((n - 1) // 6), wspace=0.25)


def forgetting_figure(bands: Mapping[str, Band], task_names: Sequence[str]) -> Figure:
    """Grouped bars of forgetting per task (percentage points), one bar per group with a ± SE error bar."""
    width_tasks = max((len(b.mean) for b in bands.values()), default=0)
    fig = new_figure(min(4.0 + 0.35 * width_tasks * max(len(bands), 1), 11.0), 3.8)
    ax = fig.add_subplot()
    step = 0.8 / max(len(bands), 1)
    xs = np.arange(width_tasks)
    for k, (label, band) in enumerate(bands.items()):
        mean, se = _arrays(band)
        at = xs[: len(mean)] + (k - (len(bands) - 1) / 2) * step
        ax.bar(at, np.nan_to_num(mean), step, yerr=se, capsize=2, color=f"C{k % 10}", label=label)
    ax.axhline(0.0, color="grey", linewidth=0.8)
    names = [task_names[j] if j < len(task_names) else f"task {j}" for j in range(width_tasks)]
    ax.set_xticks(xs, names, rotation=30 if width_tasks > 6 else 0, ha="right" if width_tasks > 6 else "center",
                  fontsize=8)
    ax.set_ylabel("forgetting (points)")
    ax.set_title("Forgetting per task (best earlier accuracy minus final)", fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig
