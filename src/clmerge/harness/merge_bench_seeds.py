"""Several fine-tuning seeds of the merging benchmark: one run per seed, then mean ± standard error.

Each seed's run lives in ``out/seed<s>/`` (its own ``results.json``/``results.md`` and plots); the experts of
all seeds share ``out/experts/``. :func:`summarise` writes ``out/results.json`` and ``out/results.md``: every
row's mean test accuracy and normalized accuracy as mean ± standard error over seeds, and CART's claims
restated with standard errors of the paired (same-seed) differences.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..utils.io import atomic_write_text, write_json
from .merge_bench import ROW_LABELS, _protocol_line

__all__ = ["mean_se", "summarise", "summary_markdown"]


def mean_se(xs: Sequence[float]) -> tuple[float, float]:
    """``(mean, standard error)`` with the sample standard deviation: ``s / sqrt(n)``, ``s^2 = sum (x -
    mean)^2 / (n - 1)``; the standard error of a single value is NaN (unknown)."""
    a = np.asarray(xs, dtype=float)
    if len(a) < 2:
        return float(a.mean()), math.nan
    return float(a.mean()), float(a.std(ddof=1) / math.sqrt(len(a)))


def _pm(xs: Sequence[float]) -> str:
    m, se = mean_se(xs)
    return f"{m:.1f}" if math.isnan(se) else f"{m:.1f} ± {se:.1f}"


def summarise(out: Path, seeds: Sequence[int]) -> dict[str, Any]:
    """Read ``out/seed<s>/results.json`` for ``seeds``; write and return the summary (module docstring)."""
    runs = [json.loads((out / f"seed{s}" / "results.json").read_text()) for s in seeds]
    rows: dict[str, dict[str, Any]] = {}
    for name in runs[0]["rows"]:
        avgs = [r["rows"][name]["avg"] for r in runs]
        norms = [r["rows"][name]["normalized"] for r in runs]
        rows[name] = {"avg": mean_se(avgs), "normalized": mean_se(norms), "avg_per_seed": avgs,
                      "normalized_per_seed": norms, "hp_per_seed": [r["rows"][name]["hp"] for r in runs]}
    summary = {"seeds": list(seeds), "config": runs[0]["config"], "tasks": runs[0]["tasks"], "rows": rows,
               "grids_per_seed": [r.get("grids", {}) for r in runs]}
    if all("analysis" in r for r in runs):
        summary["claims"] = _claims(runs)
    write_json(out / "results.json", summary)
    atomic_write_text(out / "results.md", summary_markdown(summary))
    return summary


def _claims(runs: list[dict]) -> dict[str, Any]:
    """CART's claims with paired differences over seeds (each seed's CART against the same seed's baseline)."""
    diff = lambda a, b: [r["rows"][a]["avg"] - r["rows"][b]["avg"] for r in runs]  # noqa: E731
    curves = np.array([r["analysis"]["rank_ratio"]["cart"] for r in runs])
    ratios = runs[0]["analysis"]["rank_ratio"]["ratios"]
    interior = curves[:, 1:-1]
    peak = interior.mean(0).argmax()
    # Bell curve: the best interior rank ratio (chosen on the mean curve) above the ends (= averaging)
    bell = interior[:, peak] - np.maximum(curves[:, 0], curves[:, -1])
    out = {"cart_minus_weight_average": mean_se(diff("cart", "weight_average")),
           "cart_minus_task_arithmetic": mean_se(diff("cart", "task_arithmetic")),
           "rank_ratio_curve": {"ratios": ratios, "cart_mean": curves.mean(0).tolist(),
                                "cart_se": [mean_se(c)[1] for c in curves.T]},
           "bell_peak_ratio": ratios[1 + int(peak)], "bell_peak_minus_ends": mean_se(bell.tolist())}
    return out


def _verdict(m_se: tuple[float, float]) -> str:
    m, se = m_se
    if math.isnan(se):
        return "one seed: no standard error"
    if m - 2 * se > 0:
        return "holds (more than 2 standard errors above 0)"
    if m + 2 * se < 0:
        return "does not hold (more than 2 standard errors below 0)"
    return "not resolved (within 2 standard errors of 0)"


def summary_markdown(summary: dict[str, Any]) -> str:
    """Mean ± standard error over seeds of every row, then CART's claims with their standard errors."""
    n = len(summary["seeds"])
    lines = [_protocol_line(summary["config"]) + f" Fine-tuning seeds {summary['seeds']} (n = {n}); "
             "each cell is the mean ± standard error over seeds of the mean over tasks. Per-seed tables: "
             + ", ".join(f"[seed {s}](seed{s}/results.md)" for s in summary["seeds"]) + ".", "",
             "| method | mean test accuracy | normalized (merged / expert, %) | hyperparameters per seed |",
             "|---|---|---|---|"]
    for name, r in summary["rows"].items():
        hps = "; ".join(str(h) for h in r["hp_per_seed"]) if any(r["hp_per_seed"]) else ""
        lines.append(f"| {ROW_LABELS.get(name, name)} | {_pm(r['avg_per_seed'])} | "
                     f"{_pm(r['normalized_per_seed'])} | {hps} |")
    c = summary.get("claims")
    if c:
        fmt = lambda ms: f"{ms[0]:+.1f} ± {ms[1]:.1f}"  # noqa: E731
        curve = c["rank_ratio_curve"]
        lines += ["", "## CART's claims over seeds (paired differences, mean ± standard error)", "",
                  f"- CART − weight averaging: {fmt(c['cart_minus_weight_average'])} points: "
                  f"{_verdict(c['cart_minus_weight_average'])}",
                  f"- CART − task arithmetic: {fmt(c['cart_minus_task_arithmetic'])} points: "
                  f"{_verdict(c['cart_minus_task_arithmetic'])}",
                  f"- Bell curve: the best interior rank ratio of the mean curve ({c['bell_peak_ratio']}) minus the "
                  f"better end (= averaging): {fmt(c['bell_peak_minus_ends'])} points: "
                  f"{_verdict(c['bell_peak_minus_ends'])} (the peak is picked on the same test curve, so this is "
                  "optimistic)", "",
                  "| rank ratio | " + " | ".join(str(g) for g in curve["ratios"]) + " |",
                  "|---|" + "---|" * len(curve["ratios"]),
                  "| CART (test, at each seed's chosen scaling) | "
                  + " | ".join(f"{m:.1f}" + ("" if math.isnan(s) else f" ± {s:.1f}")
                               for m, s in zip(curve["cart_mean"], curve["cart_se"])) + " |"]
    return "\n".join(lines) + "\n"
