"""From a study's results to ``fits.json``, and predictions from the fits.

* ``partial``, ``points_expected`` / ``points_done`` / ``points_missing``: whether every point of the spec has a
  result (an interrupted study is fitted on what it has, and says so); ``name``: the spec's name.
* ``laws``: every form of :data:`~.laws.FORMS` fitted per merge method to the merged test loss of the
  one-at-a-time slice that varies its variable (all other hyperparameters at the defaults; seeds and task
  groups are replicates). ``not_fitted``: per law and method, why it was not fitted (fewer distinct values of
  its variable than coefficients), so no law disappears without a word.
* ``stability``: log-log slopes of the measured ``||x_1 - x~_1||^2`` (mean over the replaced indices and
  seeds) in ``eta``, ``K`` and ``n`` (Theorem 1 predicts 2, 1 and -1), with the count of exact zeros.
* ``sparsification``: mean ``H(M) / H(id)`` of TIES and DARE (Corollary 1 predicts < 1).
* ``weighting``: measured vs predicted ``lambda_i = K_i / sum K_j`` (Eq. 14).
* ``terms``: mean ``sigma_i^2`` and ``zeta_i^2`` at the default setting.
* ``interaction``: the batch-size law refitted at each learning rate of a 2-D lr x batch slice (b* ∝ 1/eta).

:func:`predict` combines the one-variable laws additively around the defaults (an approximation: the
paper's bound is not separable, e.g. the ``eta^2 b`` interaction of the batch-size law).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .laws import FORMS, evaluate_form, fit_form, power_slope
from .spec import HYPERPARAMETERS, StudySpec, canonical_method, expand_points

__all__ = ["fit_study", "predict", "law_slice"]


def _at_defaults(r: dict, defaults: dict, free: str | None) -> bool:
    return all(r[h] == defaults[h] for h in HYPERPARAMETERS if h != free)


def law_slice(rows: list[dict], defaults: dict, variable: str, method: str) -> tuple[np.ndarray, np.ndarray]:
    """``(x, merged_loss)`` of the grid rows of ``method`` where only ``variable`` may leave its default."""
    sel = [r for r in rows if r["kind"] == "grid" and r["method"] == method and _at_defaults(r, defaults, variable)]
    return np.array([r[variable] for r in sel], dtype=float), np.array([r["merged_loss"] for r in sel], dtype=float)


def _fit_laws(rows: list[dict], defaults: dict, methods: list[str], n_boot: int) -> tuple[dict, dict]:
    """``(laws, not_fitted)``: the fits per law and method, and for each law left unfitted, why (never silent)."""
    laws: dict[str, dict] = {}
    skipped: dict[str, dict] = {}
    for name, form in FORMS.items():
        for m in methods:
            x, y = law_slice(rows, defaults, form.column, m)
            levels = len(np.unique(x))
            if levels < len(form.terms):  # fewer distinct values of the variable than coefficients: not identifiable
                skipped.setdefault(name, {})[m] = (f"{levels} distinct value(s) of {form.column} in {len(x)} finished "
                                                   f"point(s); its form has {len(form.terms)} coefficients")
                continue
            fit = fit_form(form, x, y, n_boot=n_boot)
            fit["default_x"] = defaults[form.column]
            laws.setdefault(name, {})[m] = fit
    return laws, skipped


def _completeness(rows: list[dict], spec: StudySpec) -> dict[str, Any]:
    """How many of the spec's points have a result: ``partial`` is true while any is missing."""
    expected = {p.id for p in expand_points(spec)}
    done = expected & {r.get("point_id") for r in rows}
    return {"partial": len(done) < len(expected), "points_expected": len(expected), "points_done": len(done),
            "points_missing": len(expected) - len(done)}


def _interaction(rows: list[dict], defaults: dict, methods: list[str], n_boot: int) -> dict[str, Any]:
    """The batch-size law at each learning rate (needs a 2-D lr x batch slice, e.g. ``design: full``).

    The batch-size form of Theorem 3's bound has ``b* = sqrt(c_-1 / (c1 eta^2)) ∝ 1/eta``, so ``log b*`` against ``log eta`` has slope -1.
    """
    out: dict[str, Any] = {}
    for m in methods:
        sel = [r for r in rows if r["kind"] == "grid" and r["method"] == m
               and all(r[h] == defaults[h] for h in HYPERPARAMETERS if h not in ("lr", "batch_size"))]
        per_lr = {}
        for lr in sorted({r["lr"] for r in sel}):
            x = np.array([r["batch_size"] for r in sel if r["lr"] == lr], dtype=float)
            if len(np.unique(x)) >= 3:
                y = np.array([r["merged_loss"] for r in sel if r["lr"] == lr])
                f = fit_form(FORMS["batch_size"], x, y, n_boot=n_boot)
                per_lr[lr] = {k: f[k] for k in ("coef", "r2", "optimum", "optimum_ci", "observed_trend")}
        if len(per_lr) >= 2:
            opt = {lr: f["optimum"] for lr, f in per_lr.items() if f["optimum"] is not None}
            slope = power_slope(np.array(list(opt)), np.array(list(opt.values())), n_boot=n_boot) \
                if len(opt) >= 2 else None
            out[m] = {"by_lr": {str(k): v for k, v in per_lr.items()}, "b_star_slope": slope, "expected_slope": -1.0}
    return out


def _pairs(r: dict) -> list[float]:
    """A row's stability distances (rows written before several indices were measured hold one value)."""
    return list(r.get("stability_pairs", [r["stability_sq"]]))


def _stability(rows: list[dict], defaults: dict, n_boot: int) -> dict[str, Any]:
    """Log-log slopes of the on-average stability (the mean over a row's pairs, zeros included).

    Exact zeros (the replaced sample was never drawn) are counted, never silently dropped: ``zero_pairs`` /
    ``pairs`` per variable, and ``zero_rows`` for rows whose every pair is 0, which a log fit cannot use
    (listed in ``zero_row_x``).
    """
    first = next((r["method"] for r in rows if r["kind"] == "grid"), None)
    base = [r for r in rows if r["kind"] == "grid" and r["method"] == first and "stability_sq" in r]
    out: dict[str, Any] = {"expected_slopes": {"lr": 2.0, "steps": 1.0, "n_train": -1.0}}
    all_pairs = [d for r in base for d in _pairs(r)]
    out["pairs"], out["zero_pairs"] = len(all_pairs), sum(d == 0.0 for d in all_pairs)
    for var, expect in (("lr", 2.0), ("steps", 1.0), ("data_ratio", -1.0)):
        sel = [r for r in base if _at_defaults(r, defaults, var)]
        xs = [r["n_train"][0] if var == "data_ratio" else r[var] for r in sel]
        fit = power_slope(np.array(xs), np.array([r["stability_sq"] for r in sel]), n_boot=n_boot)
        if fit is not None:
            key = "n_train" if var == "data_ratio" else var
            pairs = [d for r in sel for d in _pairs(r)]
            zero_x = [x for x, r in zip(xs, sel) if r["stability_sq"] == 0.0]
            fit |= {"expected": expect, "consistent": bool(fit["ci"] and fit["ci"][0] <= expect <= fit["ci"][1]),
                    "pairs": len(pairs), "zero_pairs": sum(d == 0.0 for d in pairs),
                    "zero_rows": len(zero_x), "zero_row_x": zero_x}
            out[key] = fit
    return out


def _sparsification(rows: list[dict]) -> dict[str, Any]:
    out = {}
    for m in ("ties", "dare"):
        sel = [r for r in rows if r["method"] == m and r.get("het_before", 0) > 0]
        if sel:
            ratio = np.array([r["het_after"] / r["het_before"] for r in sel])
            out[m] = {"mean_ratio": float(ratio.mean()), "median_ratio": float(np.median(ratio)),
                      "fraction_lowered": float((ratio < 1).mean()), "n": len(sel)}
    return out


def _weighting(rows: list[dict]) -> dict[str, Any] | None:
    sel = [r for r in rows if r["kind"] == "weighting" and "implicit_weights" in r]
    if not sel:
        return None
    meas = np.array([r["implicit_weights"] for r in sel])
    pred = np.array([r["predicted_weights"] for r in sel])
    share = np.array([r["displacement_share"] for r in sel])
    return {"steps": sel[0]["steps"], "measured": meas.mean(0).tolist(), "predicted": pred.mean(0).tolist(),
            "displacement_share": share.mean(0).tolist(),
            "mean_abs_error": float(np.abs(meas - pred).mean()),
            "longer_weighs_more": bool(np.all(np.diff(meas.mean(0)[np.argsort(sel[0]["steps"])]) > 0)),
            "per_task_acc": np.array([r["per_task_acc"] for r in sel]).mean(0).tolist(), "n": len(sel)}


def _terms(rows: list[dict], defaults: dict) -> dict[str, Any]:
    sel = [r for r in rows if r["kind"] == "grid" and _at_defaults(r, defaults, None)]
    if not sel:
        return {}
    s2 = float(np.mean([v for r in sel for v in r["sigma2"]]))
    z2 = float(np.mean([v for r in sel for v in r["zeta2"]]))
    b = defaults["batch_size"]
    return {"sigma2": s2, "zeta2": z2, "batch_size": b, "noise_part": s2, "heterogeneity_part": 3 * b * z2,
            "merged_loss": float(np.mean([r["merged_loss"] for r in sel])),
            "expert_loss": float(np.mean([e["test_loss"] for r in sel for e in r["experts"]]))}


def fit_study(rows: list[dict], spec: StudySpec, *, n_boot: int = 200) -> dict[str, Any]:
    """Everything ``fits.json`` holds (see the module docstring)."""
    defaults = spec.defaults.model_dump()
    methods = list(dict.fromkeys(m["name"] for m in spec.methods))
    laws, not_fitted = _fit_laws(rows, defaults, methods, n_boot)
    return {"name": spec.name, **_completeness(rows, spec), "defaults": defaults, "methods": methods,
            "laws": laws, "not_fitted": not_fitted,
            "stability": _stability(rows, defaults, n_boot), "sparsification": _sparsification(rows),
            "weighting": _weighting(rows), "terms": _terms(rows, defaults),
            "interaction": _interaction(rows, defaults, methods, n_boot), "n_rows": len(rows)}


def predict(fits: dict[str, Any], method: str, level: float = 0.95, **hp: float) -> dict[str, Any]:
    """Merged loss at hyperparameters ``hp`` from the fitted laws, with a bootstrap interval.

    ``pred = mean_v f_v(default_v) + sum_{v changed} [f_v(x_v) - f_v(default_v)]`` over the laws ``v`` of
    ``method``; the interval pairs the laws' bootstrap samples by index.

    Raises:
        KeyError: a hyperparameter without a fitted law for ``method`` (or an unknown method).
    """
    method = canonical_method(method)  # fits.json written before the rename holds ``averaging``
    laws = {name: f for name, per in fits["laws"].items() for m, f in per.items() if canonical_method(m) == method}
    if not laws:
        fitted = sorted({canonical_method(m) for p in fits["laws"].values() for m in p})
        raise KeyError(f"no fitted laws for method {method!r}; fitted: {', '.join(fitted) or 'none'}")
    for key in hp:
        if key not in laws:
            raise KeyError(f"no fitted law for {key!r} (method {method}); fitted: {', '.join(laws)}")
    n_boot = min(len(f["boot"]) for f in laws.values())
    point = np.mean([evaluate_form(FORMS[n], f["coef"], f["default_x"])[0] for n, f in laws.items()])
    boot = np.mean([evaluate_form(FORMS[n], np.array(f["boot"][:n_boot]), f["default_x"])[:, 0]
                    for n, f in laws.items()], axis=0)
    for key, value in hp.items():
        f, form = laws[key], FORMS[key]
        point += float(evaluate_form(form, f["coef"], value)[0] - evaluate_form(form, f["coef"], f["default_x"])[0])
        b = np.array(f["boot"][:n_boot])
        boot += evaluate_form(form, b, value)[:, 0] - evaluate_form(form, b, f["default_x"])[:, 0]
    a = (1 - level) / 2
    outside = [k for k, v in hp.items() if not min(laws[k]["x"]) <= v <= max(laws[k]["x"])]
    return {"method": method, "hp": hp, "loss": float(point), "low": float(np.quantile(boot, a)),
            "high": float(np.quantile(boot, 1 - a)), "level": level, "extrapolated": outside}
