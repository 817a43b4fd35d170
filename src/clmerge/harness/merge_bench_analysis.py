"""The merging benchmark's analysis: CART's rank-ratio curve, task-vector spectra, row-space interference.

:func:`analyse` computes, from the benchmark's experts:

- ``rank_ratio``: test accuracy (mean over tasks) of CART (centered) and of low-rank task arithmetic
  (uncentered, non-matrix tensors left at the pretrained values, so rank 0 is the pretrained model) for a grid
  of rank ratios, each at the scaling its grid search chose on validation. Reported only: nothing is
  selected on these numbers.
- ``spectra``: the mean, over weight matrices and tasks, of the cumulative energy ``sum_{i<=k} s_i^2 /
  sum_i s_i^2`` of the task vectors against ``k / rank``, centered and original.
- ``interference``: CART Eq. (5) ``I(k)`` and Eq. (7) ``R(k)`` summed over weight matrices, centered and
  original, for the same rank ratios.

:func:`write_plots` renders them as PNG files next to ``results.md``; :func:`claims` states whether each of
CART's claims holds on these numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from ..report.plots import new_figure, to_png
from ..merging.methods.analysis import interference_curves, task_vector_spectra
from ..merging.methods.lowrank import is_lowrank_param
from ..merging.methods.registry import merge

__all__ = ["RATIOS", "analyse", "write_plots", "claims", "analysis_markdown"]

RATIOS = (0.0, 0.02, 0.04, 0.08, 0.16, 0.32, 1.0)  # 0.5 and 0.75 dropped: each point is a test pass (CPU)


def analyse(base: dict[str, Tensor], experts: Sequence[dict[str, Tensor]],
            evaluate: Callable[[dict[str, Tensor]], float], rows: dict[str, Any],
            ratios: Sequence[float] = RATIOS) -> dict[str, Any]:
    """The curves of the module docstring; ``evaluate(params)`` is the mean test accuracy of a backbone."""
    cart_s = float(rows.get("cart", {}).get("hp", {}).get("scaling", 1.0))
    lr_s = float(rows.get("low_rank_task_arithmetic", {}).get("hp", {}).get("scaling", 0.3))
    curve = {"ratios": list(ratios), "cart_scaling": cart_s, "low_rank_ta_scaling": lr_s,
             "cart": [evaluate(merge("cart", experts=experts, rank_ratio=g, scaling=cart_s)) for g in ratios],
             "low_rank_ta": [evaluate(merge("low_rank_task_arithmetic", base=base, experts=experts, rank_ratio=g,
                                            scaling=lr_s, non_matrix="base")) for g in ratios]}
    if "cart" in rows:  # the randomized SVD path at the selected hyperparameters (accuracy vs exact)
        hp = dict(rows["cart"]["hp"])
        curve["cart_exact_selected"] = rows["cart"]["avg"]
        curve["cart_randomized_selected"] = evaluate(merge("cart", experts=experts, svd="randomized", **hp))
    spectra = {}
    for name, centered in (("centered", True), ("original", False)):
        sv = task_vector_spectra(base=base, experts=experts, centered=centered)
        spectra[name] = _mean_energy(list(sv.values()))
    rank = min(min(v.shape) for k, v in base.items()
               if v.is_floating_point() and is_lowrank_param(k, tuple(v.shape)))
    ks = sorted({max(1, math.ceil(g * rank)) for g in ratios if g > 0})
    curves = interference_curves(base=base, experts=experts, ks=ks)
    inter = {"ks": ks, "rank": rank}
    for q in ("I_centered", "I_original", "R_centered", "R_original"):
        inter[q] = [float(sum(c[q][i] for c in curves.values())) for i in range(len(ks))]
    return {"rank_ratio": curve, "spectra": spectra, "interference": inter}


def _mean_energy(spectra: list[Tensor], points: int = 50) -> dict[str, list[float]]:
    """Mean cumulative energy over matrices and tasks, resampled at ``points`` rank fractions."""
    grid = np.linspace(0.0, 1.0, points + 1)
    curves = []
    for s in spectra:  # (T, r)
        e = (s.double() ** 2).cumsum(-1)
        e = (e / e[:, -1:].clamp(min=1e-300)).numpy()
        r = e.shape[-1]
        x = np.arange(1, r + 1) / r
        curves += [np.interp(grid, np.concatenate([[0.0], x]), np.concatenate([[0.0], row])) for row in e]
    return {"fraction": grid.tolist(), "energy": np.mean(curves, axis=0).tolist()}


def write_plots(analysis: dict[str, Any], rows: dict[str, Any], out: Path) -> list[str]:
    """``rank_ratio.png``, ``spectra.png``, ``interference.png`` in ``out``; returns the file names."""
    out.mkdir(parents=True, exist_ok=True)
    c = analysis["rank_ratio"]
    fig = new_figure(6.0, 4.0)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(c["ratios"], c["cart"], "o-", label=f"CART (centered), scaling {c['cart_scaling']}")
    ax.plot(c["ratios"], c["low_rank_ta"], "s--", label=f"low-rank TA (uncentered), scaling {c['low_rank_ta_scaling']}")
    for name, style in (("weight_average", ":"), ("task_arithmetic", "-."), ("pretrained", "--")):
        if name in rows:
            ax.axhline(rows[name]["avg"], ls=style, color="gray", lw=1)
            ax.annotate(name, (1.0, rows[name]["avg"]), fontsize=7, ha="right", va="bottom", color="gray")
    for g in (0.0, 1.0):  # rank 0 and full rank: CART is weight averaging
        ax.plot([g], [c["cart"][c["ratios"].index(g)]], "k*", ms=10)
    ax.set_xscale("symlog", linthresh=0.02)
    ax.set_xlabel("rank ratio (stars: rank 0 and full rank = weight averaging)")
    ax.set_ylabel("mean test accuracy (%)")
    ax.legend(fontsize=7)
    files = {"rank_ratio.png": fig}
    fig = new_figure(5.0, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    for name in ("centered", "original"):
        s = analysis["spectra"][name]
        ax.plot(s["fraction"], s["energy"], label=name)
    ax.set_xlabel("rank / full rank")
    ax.set_ylabel("cumulative energy of the task vectors")
    ax.legend()
    files["spectra.png"] = fig
    i = analysis["interference"]
    fig = new_figure(9.0, 3.6)
    for j, (q, title) in enumerate((("I", "row-space interference I(k), Eq. 5"),
                                    ("R", "reconstruction error R(k), Eq. 7"))):
        ax = fig.add_subplot(1, 2, j + 1)
        for name in ("centered", "original"):
            ax.plot(i["ks"], i[f"{q}_{name}"], "o-", label=name)
        ax.set_xlabel("k (kept singular directions)")
        ax.set_title(title, fontsize=9)
        ax.legend()
    files["interference.png"] = fig
    for name, f in files.items():
        (out / name).write_bytes(to_png(f))
    return list(files)


def claims(rows: dict[str, Any], analysis: dict[str, Any], tol: float = 0.05) -> list[str]:
    """One line per CART claim: whether it holds on these numbers, and the numbers."""
    c, i = analysis["rank_ratio"], analysis["interference"]
    avg, cart = rows["weight_average"]["avg"], c["cart"]
    out = []
    if "cart" in rows:
        beat = rows["cart"]["avg"] > avg and rows["cart"]["avg"] > rows.get("task_arithmetic", {}).get("avg", -1)
        out.append(f"CART beats weight averaging and task arithmetic: {'holds' if beat else 'does not hold'} "
                   f"(CART {rows['cart']['avg']:.1f}, averaging {avg:.1f}, task arithmetic "
                   f"{rows.get('task_arithmetic', {}).get('avg', float('nan')):.1f})")
    ends = abs(cart[0] - avg) <= tol and abs(cart[-1] - avg) <= tol
    bell = max(cart[1:-1]) > max(cart[0], cart[-1]) if len(cart) > 2 else False
    out.append(f"Bell curve, rank 0 and full rank = averaging: ends {'equal' if ends else 'differ'} "
               f"({cart[0]:.1f} / {cart[-1]:.1f} vs {avg:.1f}); interior peak {max(cart[1:-1]):.1f} at ratio "
               f"{c['ratios'][1 + int(np.argmax(cart[1:-1]))]}: {'holds' if ends and bell else 'does not hold'}")
    less = all(a < b for a, b in zip(i["I_centered"], i["I_original"]))
    out.append(f"Centered task vectors interfere less (I(k) at every k): {'holds' if less else 'does not hold'} "
               f"(centered {_fmt(i['I_centered'])} vs original {_fmt(i['I_original'])} at k={i['ks']})")
    if "cart_randomized_selected" in c:
        gap = abs(c["cart_randomized_selected"] - c["cart_exact_selected"])
        out.append(f"CART with the randomized SVD is within 0.5 points of the exact SVD: "
                   f"{'holds' if gap <= 0.5 else 'does not hold'} ({c['cart_randomized_selected']:.2f} vs "
                   f"{c['cart_exact_selected']:.2f})")
    pre, lr = rows["pretrained"]["avg"], c["low_rank_ta"]
    decays = abs(lr[0] - pre) <= tol and all(a <= b + 0.5 for a, b in zip(lr[:-1], lr[1:]))
    out.append(f"Low-rank uncentered merging decays toward the pretrained model: "
               f"{'holds' if decays else 'does not hold'} (rank 0 {lr[0]:.1f} vs pretrained {pre:.1f}; "
               f"curve {_fmt(lr)})")
    return out


def _fmt(xs: Sequence[float]) -> str:
    return "[" + ", ".join(f"{x:.3g}" for x in xs) + "]"


def analysis_markdown(rows: dict[str, Any], analysis: dict[str, Any], files: Sequence[str]) -> str:
    """The analysis section of ``results.md``: the claims, then the plots (embedded as images)."""
    lines = ["", "## CART's claims on this benchmark", ""] + [f"- {x}" for x in claims(rows, analysis)]
    c = analysis["rank_ratio"]
    lines += ["", "| rank ratio | " + " | ".join(str(g) for g in c["ratios"]) + " |",
              "|---|" + "---|" * len(c["ratios"]),
              "| CART | " + " | ".join(f"{a:.1f}" for a in c["cart"]) + " |",
              "| low-rank TA (uncentered) | " + " | ".join(f"{a:.1f}" for a in c["low_rank_ta"]) + " |", ""]
    lines += [f"![{f[:-4]}]({f})" for f in files]
    return "\n".join(lines) + "\n"
