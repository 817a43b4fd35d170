"""``DIR/report.html`` of a study: each fitted law's data against its fit (with the bootstrap band), the
L2-stability slopes, and the tables of fits and measured terms. Self-contained like every clmerge report."""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

import numpy as np

from ..report.elements import img, page, section, table
from ..report.plots import new_figure, to_png
from ..utils.io import atomic_write_text
from ..utils.outpaths import child
from .laws import FORMS, evaluate_form

__all__ = ["law_plot", "stability_plot", "build_study_report"]


def _null_formatter():
    from matplotlib.ticker import NullFormatter  # after plots.new_figure checked that matplotlib is there

    return NullFormatter()


def law_plot(name: str, per_method: dict[str, dict]) -> bytes:
    """Merged loss against one hyperparameter: the points of each method and its fitted curve, 95% band."""
    fig = new_figure(5.0, 3.4)
    ax = fig.add_subplot(1, 1, 1)
    form = FORMS[name]
    for i, (method, fit) in enumerate(per_method.items()):
        color = f"C{i}"
        x, y = np.array(fit["x"]), np.array(fit["y"])
        ax.scatter(x, y, s=14, color=color, alpha=0.7)
        grid = np.geomspace(x.min(), x.max(), 60) if x.min() > 0 else np.linspace(x.min(), x.max(), 60)
        band = evaluate_form(form, np.array(fit["boot"]), grid)
        ax.fill_between(grid, np.quantile(band, 0.025, 0), np.quantile(band, 0.975, 0), color=color, alpha=0.15)
        r2 = "n/a" if fit["r2"] is None else f"{fit['r2']:.2f}"
        ax.plot(grid, evaluate_form(form, fit["coef"], grid), color=color, label=f"{method} (R²={r2})")
    if name in ("lr", "batch_size", "steps"):
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(_null_formatter())
    ticks = sorted({v for f in per_method.values() for v in f["x"]})
    ax.set_xticks(ticks, [f"{v:g}" for v in ticks])
    ax.set_xlabel(f"{name}   [{form.equation}]")
    ax.set_ylabel("merged test loss")
    ax.legend(fontsize=7)
    return to_png(fig)


def stability_plot(stab: dict[str, Any]) -> bytes:
    """``||x - x~||^2`` against each varied quantity on log-log axes with the fitted slope."""
    fits = {k: v for k, v in stab.items() if isinstance(v, dict) and "slope" in v}
    fig = new_figure(3.4 * max(1, len(fits)), 3.0)
    for i, (var, f) in enumerate(fits.items()):
        ax = fig.add_subplot(1, len(fits), i + 1)
        x, y = np.array(f["x"]), np.array(f["y"])
        ax.loglog(x, y, "o", ms=4)
        g = np.geomspace(x.min(), x.max(), 20)
        c = np.exp(np.mean(np.log(y)) - f["slope"] * np.mean(np.log(x)))
        ax.loglog(g, c * g ** f["slope"], "-", label=f"slope {f['slope']:.2f} (theory {f['expected']:g})")
        ax.xaxis.set_minor_formatter(_null_formatter())
        ax.yaxis.set_minor_formatter(_null_formatter())
        ticks = sorted(set(f["x"]))
        ax.set_xticks(ticks, [f"{v:g}" for v in ticks])
        ax.set_xlabel(var)
        ax.set_ylabel("||x - x~||²" if i == 0 else "")
        ax.legend(fontsize=7)
    return to_png(fig)


def _fits_table(laws: dict[str, dict[str, dict]]) -> str:
    rows = []
    for name, per in laws.items():
        for method, f in per.items():
            coef = ", ".join(f"{t}={c:.3g} [{lo:.3g}, {hi:.3g}]"
                             for t, c, lo, hi in zip(f["terms"], f["coef"], f["ci_low"], f["ci_high"]))
            rows.append([name, method, f["equation"], coef, "—" if f["r2"] is None else f"{f['r2']:.3f}",
                         "—" if f["optimum"] is None else f"{f['optimum']:.3g}", f["paper_trend"],
                         f["observed_trend"], f.get("verdict") or ("agrees" if f["agrees"] else "does not agree")])
    return table(["law", "method", "form", "coefficients [95% CI]", "R²", "optimum", "paper", "observed", "verdict"],
                  rows, numeric_from=4)


def _not_fitted(fits: dict[str, Any]) -> str:
    """The laws left unfitted, each with its reason (empty when every law was fitted)."""
    rows = [[name, method, why] for name, per in (fits.get("not_fitted") or {}).items() for method, why in per.items()]
    return table(["law", "method", "not fitted because"], rows) if rows else ""


def _header(out: Path, rows: list[dict], fits: dict[str, Any]) -> tuple[str, str]:
    """``(title, header HTML)``: the spec's ``name`` (the directory's name for fits written without one), the
    point counts, and a "partial" label with the missing points counted."""
    name = fits.get("name") or out.name
    n_grid = sum(r["kind"] == "grid" for r in rows)
    partial = (f"<span><strong>partial</strong>: {fits['points_done']} of {fits['points_expected']} points, "
               f"{fits['points_missing']} missing</span>" if fits.get("partial") else "")
    return name, (f"<h1>Study: {escape(name)}</h1><p class=\"meta\">{partial}<span>{n_grid} merged grid points</span>"
                  f"<span>{len(rows) - n_grid} weighting points</span></p>")


def _stability_table(stab: dict[str, Any]) -> str:
    """Slopes with the count of twin distances that are exactly 0 (the replaced sample was never drawn): they
    enter each row's mean; a row whose every pair is 0 cannot enter the log-log fit and is counted apart."""
    rows = [[var, f"{f['slope']:.2f}", f"{f['expected']:g}", str(f.get("pairs", "—")), str(f.get("zero_pairs", "—")),
             str(f.get("zero_rows", "—"))] for var, f in stab.items() if isinstance(f, dict) and "slope" in f]
    return table(["variable", "slope", "theory", "twin pairs", "exact zeros", "all-zero rows (not fitted)"],
                  rows, numeric_from=1)


def build_study_report(out: str | Path, rows: list[dict], fits: dict[str, Any], advice: str) -> Path:
    """Write ``out/report.html`` and return its path."""
    out = Path(out)
    sections = [section("Advice", f"<pre>{escape(advice)}</pre>"),
                section("Fitted laws (Theorem 3, one variable at a time)",
                        _fits_table(fits.get("laws", {})) + _not_fitted(fits))]
    plots = [img(law_plot(n, per), f"law {n}") for n, per in fits.get("laws", {}).items()]
    sections.append(section("Data against fits", "\n".join(plots) or '<p class="note">no law could be fitted</p>'))
    stab = fits.get("stability") or {}
    if any(isinstance(v, dict) and "slope" in v for v in stab.values()):
        sections.append(section("L2 stability (Theorem 1)",
                                 img(stability_plot(stab), "stability") + _stability_table(stab)))
    name, header = _header(out, rows, fits)
    path = child(out, "report.html", flag="report")  # never through a symlink
    atomic_write_text(path, page(f"clmerge study {name}", header, sections))
    return path
