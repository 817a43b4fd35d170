"""One-variable scaling laws, fitted to measured merged loss.

The forms are the bound of Theorem 3 (Li, Tang et al., arXiv:2601.21690) with equal experts (same K, b, n,
sigma, zeta; lambda_i = 1/N), one hyperparameter varied at a time; the paper fits no constants. Each form is
linear in free non-negative coefficients ``c``, so a fit is a non-negative least-squares problem on a basis
matrix (columns scaled to unit norm first).
Confidence intervals come from a case bootstrap (rows resampled with replacement), R^2 from the residuals,
and each fit is compared with the paper's stated trend direction (Sec. V-B, App. A-A1). A fit gets an
"agrees" / "does not agree" verdict only with at least :data:`MIN_LEVELS` distinct values of its variable and
more points than coefficients; otherwise its verdict is "not enough levels" (two levels fix no shape).

| law | form | paper's claim |
|---|---|---|
| steps ``K`` | ``c0 + c1 K^-1/2 + c2 K`` | trade-off: a finite optimum ``K* = (c1/(2 c2))^(2/3)``, loss rises beyond it |
| lr ``eta`` | ``c0 + c2 eta^2`` | monotone, quadratically accelerating degradation |
| batch ``b`` | ``c0 + c_-1/b + c1 b`` (``c1`` holds ``eta^2``) | at small lr, loss falls with ``b``; ``b* = sqrt(c_-1/c1)`` |
| data ratio ``alpha`` | ``c0 + c_n/alpha`` | loss falls monotonically ("free lunch") |
| experts ``N`` | ``c0 + d1 N^-1/2 + d2 N`` | loss rises with ``N`` (heterogeneity accumulates) |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..utils.extras import require_extra

__all__ = ["LawForm", "FORMS", "MIN_LEVELS", "NOT_ENOUGH_LEVELS", "fit_form", "evaluate_form", "observed_trend",
           "power_slope", "verdict"]

MIN_LEVELS = 3  # distinct values of a law's variable before its trend is judged against the paper's
NOT_ENOUGH_LEVELS = "not enough levels"


@dataclass(frozen=True)
class LawForm:
    """A one-variable form ``y = sum_j c_j phi_j(x)`` with ``c >= 0``.

    Attributes:
        name: the law's name (also the results column it is a function of, except ``lr``).
        column: results.jsonl column of the variable.
        equation: the form, as text.
        terms: a name per coefficient; roles: what each term stands for in the bound.
        basis: ``x (n,) -> Phi (n, p)``.
        paper_trend: ``"increasing"``, ``"decreasing"`` or ``"tradeoff"`` (finite optimum, rise beyond it).
    """

    name: str
    column: str
    equation: str
    terms: tuple[str, ...]
    roles: tuple[str, ...]
    basis: Callable[[np.ndarray], np.ndarray]
    paper_trend: str
    claim: str


def _cols(*fns: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    return lambda x: np.stack([f(np.asarray(x, dtype=float)) for f in fns], 1)


_one = np.ones_like
FORMS: dict[str, LawForm] = {f.name: f for f in (
    LawForm("steps", "steps", "c0 + c1*K^-1/2 + c2*K", ("c0", "c1", "c2"),
            ("floor", "optimization (eps_sgd, decays in K)", "stability (grows linearly in K)"),
            _cols(_one, lambda x: x ** -0.5, lambda x: x), "tradeoff",
            "an optimal K* exists; beyond it the stability term makes the merged loss rise (sec. V-B1, A-A1)"),
    LawForm("lr", "lr", "c0 + c2*eta^2", ("c0", "c2"), ("floor", "stability (grows as eta^2)"),
            _cols(_one, lambda x: x ** 2), "increasing",
            "merged loss increases with the learning rate, quadratically (sec. V-B3)"),
    LawForm("batch_size", "batch_size", "c0 + c_-1/b + c1*b", ("c0", "c_-1", "c1"),
            ("floor", "gradient noise (decays as 1/b)", "stability heterogeneity (3 b zeta^2 / n, grows in b)"),
            _cols(_one, lambda x: 1.0 / x, lambda x: x), "decreasing",
            "at a small learning rate, merged loss decreases as the batch size grows (sec. V-B2)"),
    LawForm("data_ratio", "data_ratio", "c0 + c_n/alpha", ("c0", "c_n"), ("floor", "stability (1/n_i)"),
            _cols(_one, lambda x: 1.0 / x), "decreasing",
            "merged loss decreases monotonically with the data ratio (sec. V-B4)"),
    LawForm("n_experts", "n_experts", "c0 + d1*N^-1/2 + d2*N", ("c0", "d1", "d2"),
            ("floor", "optimization (decays as N^-1/2)", "heterogeneity (accumulates with N)"),
            _cols(_one, lambda x: x ** -0.5, lambda x: x), "increasing",
            "merged loss increases as more experts are merged (sec. V-B5)"),
)}


def _scipy(sub: str):
    """``scipy.<sub>`` (the ``study`` extra), imported on first use: merging needs no scipy."""
    return require_extra(f"scipy.{sub}", what="fitting a law (clmerge study)")


def _nnls(phi: np.ndarray, y: np.ndarray) -> np.ndarray:
    scale = np.linalg.norm(phi, axis=0)
    scale[scale == 0] = 1.0
    c, _ = _scipy("optimize").nnls(phi / scale, y)
    return c / scale


def _r2(y: np.ndarray, pred: np.ndarray) -> float | None:
    ss_tot = float(((y - y.mean()) ** 2).sum())
    if ss_tot <= 0:
        return None
    return 1.0 - float(((y - pred) ** 2).sum()) / ss_tot


def optimum(form: LawForm, c: np.ndarray) -> float | None:
    """The minimiser of a trade-off form: ``K* = (c1/(2 c2))^(2/3)``, ``b* = sqrt(c_-1/c1)``, ``N*`` as ``K*``."""
    if form.name in ("steps", "n_experts") and c[1] > 0 and c[2] > 0:
        return float((c[1] / (2 * c[2])) ** (2.0 / 3.0))
    if form.name == "batch_size" and c[1] > 0 and c[2] > 0:
        return float(np.sqrt(c[1] / c[2]))
    return None


def evaluate_form(form: LawForm, coef: np.ndarray | list[float], x: np.ndarray | float) -> np.ndarray:
    """``form`` at ``x`` with coefficients ``coef`` (``coef`` may be ``(B, p)`` bootstrap samples)."""
    phi = form.basis(np.atleast_1d(np.asarray(x, dtype=float)))
    return np.asarray(coef, dtype=float) @ phi.T


def observed_trend(x: np.ndarray, y: np.ndarray) -> tuple[str, float | None]:
    """Direction of the per-value mean of ``y`` along ``x``: ``(trend, Spearman rho)``.

    ``"tradeoff"`` when the lowest mean sits strictly inside the grid (a U), else the sign of rho.
    """
    xs = np.unique(x)
    means = np.array([y[x == v].mean() for v in xs])
    if len(xs) < 2:
        return "undetermined", None
    if len(xs) > 2:
        rho = float(_scipy("stats").spearmanr(xs, means).statistic)
    else:
        rho = float(np.sign(means[1] - means[0]))
    if len(xs) > 2 and 0 < int(np.argmin(means)) < len(xs) - 1:
        return "tradeoff", rho
    return ("increasing" if rho > 0 else "decreasing" if rho < 0 else "flat"), rho


def _agrees(form: LawForm, trend: str, c: np.ndarray, lo: np.ndarray) -> bool:
    if form.paper_trend == "tradeoff":
        # the paper's trade-off: the stability slope is positive (loss rises eventually); a monotone
        # rise over the grid is its "stability dominates from the start" case (sec. 4.B.1)
        return bool(lo[2] > 0) and trend in ("tradeoff", "increasing")
    return trend == form.paper_trend


def verdict(form: LawForm, x: np.ndarray, agrees: bool) -> str:
    """``"agrees"``, ``"does not agree"`` or, with fewer than :data:`MIN_LEVELS` distinct ``x`` or no more points
    than coefficients, :data:`NOT_ENOUGH_LEVELS`."""
    if len(np.unique(x)) < MIN_LEVELS or len(x) <= len(form.terms):
        return NOT_ENOUGH_LEVELS
    return "agrees" if agrees else "does not agree"


def fit_form(form: LawForm, x: np.ndarray, y: np.ndarray, *, n_boot: int = 200, seed: int = 0,
             level: float = 0.95) -> dict:
    """Fit ``form`` to ``(x, y)`` by NNLS with a case-bootstrap confidence interval.

    Returns:
        A JSON-ready dict: ``coef``, ``ci_low``/``ci_high`` (percentile, ``level``), ``r2``, ``optimum`` and its
        interval (trade-off forms), ``observed_trend``, ``spearman``, ``paper_trend``, ``verdict`` (see
        :func:`verdict`), ``agrees`` (``None`` when the verdict is "not enough levels"), ``levels``, the data
        ``x``/``y`` and the bootstrap coefficient samples ``boot`` (used by :func:`clmerge.theory.predict`).
    """
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) < len(form.terms):
        raise ValueError(f"law {form.name}: {len(x)} points cannot fit {len(form.terms)} coefficients")
    c = _nnls(form.basis(x), y)
    rng = np.random.default_rng(seed)
    boot = np.array([_nnls(form.basis(x[i]), y[i]) for i in (rng.integers(0, len(x), len(x)) for _ in range(n_boot))])
    a = (1 - level) / 2
    lo, hi = np.quantile(boot, a, axis=0), np.quantile(boot, 1 - a, axis=0)
    opts = [o for o in (optimum(form, b) for b in boot) if o is not None]
    trend, rho = observed_trend(x, y)
    says = verdict(form, x, _agrees(form, trend, c, lo))
    return {
        "law": form.name, "variable": form.column, "equation": form.equation, "terms": list(form.terms),
        "roles": list(form.roles), "coef": c.tolist(), "ci_low": lo.tolist(), "ci_high": hi.tolist(), "level": level,
        "r2": _r2(y, evaluate_form(form, c, x)), "n": len(x),
        "optimum": optimum(form, c),
        # among the bootstrap fits that have an optimum (both competing terms > 0); their share says how
        # often the data support a finite optimum at all
        "optimum_ci": [float(np.quantile(opts, a)), float(np.quantile(opts, 1 - a))] if len(opts) > 1 else None,
        "optimum_share": len(opts) / n_boot,
        "observed_trend": trend, "spearman": rho, "paper_trend": form.paper_trend, "claim": form.claim,
        "verdict": says, "agrees": None if says == NOT_ENOUGH_LEVELS else says == "agrees",
        "levels": len(np.unique(x)), "x": x.tolist(), "y": y.tolist(), "boot": boot.tolist(),
    }


def power_slope(x: np.ndarray, y: np.ndarray, *, n_boot: int = 200, seed: int = 0) -> dict | None:
    """Log-log slope of ``y`` against ``x`` (ordinary least squares) with a bootstrap 95% interval.

    Used for the L2-stability exponents (Theorem 1: ``∝ eta^2``, ``∝ K``, ``∝ 1/n``). Rows with ``y <= 0``
    are dropped; ``None`` when fewer than two distinct ``x`` remain.
    """
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    keep = (y > 0) & (x > 0)
    lx, ly = np.log(x[keep]), np.log(y[keep])
    if len(np.unique(lx)) < 2:
        return None
    slope = float(np.polyfit(lx, ly, 1)[0])
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        i = rng.integers(0, len(lx), len(lx))
        if len(np.unique(lx[i])) >= 2:
            boots.append(np.polyfit(lx[i], ly[i], 1)[0])
    ci = [float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))] if boots else None
    return {"slope": slope, "ci": ci, "n": int(keep.sum()), "x": x[keep].tolist(), "y": y[keep].tolist()}
