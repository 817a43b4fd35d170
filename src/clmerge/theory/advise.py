"""Plain-words advice from a study (``clmerge advise STUDY_DIR``): which expert settings merge best, and why.

"Why" is read off the fitted laws (which term of each form dominates at the defaults) and the
measured terms of the stability bound (Theorem 1: ``sigma_i^2/n_i`` vs ``3 b_i zeta_i^2/n_i``).

The advice says first when the study is partial (points missing), and it calls no merged model "best" when
even the lowest merged loss is near chance: within :data:`NEAR_CHANCE` of ``ln C``, the cross-entropy of a
uniform guess over ``C`` classes (the mean of ``ln C_i`` over the point's tasks).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from .laws import FORMS, evaluate_form
from .spec import HYPERPARAMETERS

__all__ = ["advise", "best_settings", "chance_loss", "NEAR_CHANCE"]

NEAR_CHANCE = 0.9  # a merged loss at or above this fraction of ln C is "near chance"


def _g(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4g}"


def best_settings(rows: list[dict]) -> list[dict[str, Any]]:
    """Grid settings x method, averaged over seeds and task groups, best (lowest merged loss) first."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["kind"] == "grid":
            groups[(r["method"], *(r[h] for h in HYPERPARAMETERS))].append(r)
    out = [{"method": k[0], **dict(zip(HYPERPARAMETERS, k[1:])), "n": len(v),
            "loss": float(np.mean([r["merged_loss"] for r in v])), "acc": float(np.mean([r["merged_acc"] for r in v])),
            "chance_loss": chance_loss(v)} for k, v in groups.items()]
    return sorted(out, key=lambda s: s["loss"])


def chance_loss(rows: list[dict]) -> float | None:
    """``ln C``, the loss of a uniform guess, averaged over the rows' tasks (``None``: rows from before the
    class counts were recorded)."""
    counts = [c for r in rows for c in r.get("n_classes") or []]
    return float(np.mean(np.log(counts))) if counts else None


def _near_chance(s: dict) -> bool:
    return s["chance_loss"] is not None and s["loss"] >= NEAR_CHANCE * s["chance_loss"]


def _headline(best: list[dict]) -> list[str]:
    """The best setting, or why none is called best (every merged loss near chance)."""
    b = best[0]
    hp = ", ".join(f"{h}={b[h]}" for h in HYPERPARAMETERS)
    said = f"{b['method']} with {hp}: loss {b['loss']:.4f}, accuracy {b['acc']:.1f}% (mean of {b['n']} seed/group runs)"
    near = sum(_near_chance(s) for s in best)
    if _near_chance(b):
        return [f"No merged model is called best: every merged loss is near chance (at least {NEAR_CHANCE:g} x ln C, "
                f"with ln C = {b['chance_loss']:.4f} for C classes). The lowest is {said}."]
    lines = [f"Best merged model: {said}."]
    if b["chance_loss"] is None:
        lines.append("Not checked against chance: these results do not record the class counts C (results written "
                     "before they were); a loss near ln C (2.303 for 10 classes) is a guess, not a model.")
    elif near:
        lines.append(f"{near} of {len(best)} merged settings have losses near chance (at least {NEAR_CHANCE:g} x ln C).")
    return lines


def _partial_line(fits: dict) -> list[str]:
    if not fits.get("partial"):
        return []
    return [f"PARTIAL STUDY: {fits['points_done']} of {fits['points_expected']} points finished, "
            f"{fits['points_missing']} missing; finish it with `clmerge study` --resume before trusting these fits."]


def _verdict(fit: dict) -> str:
    """``fits.json`` written before verdicts existed has only ``agrees``."""
    return fit.get("verdict") or ("agrees" if fit["agrees"] else "does NOT agree")


def _law_line(name: str, fit: dict) -> str:
    form, c, x0 = FORMS[name], fit["coef"], fit["default_x"]
    parts = evaluate_form(form, np.diag(c), x0)[:, 0]  # each term's value at the default
    tail = f"R^2 {_g(fit['r2'])}; paper: {fit['paper_trend']}, here: {fit['observed_trend']} " \
           f"({_verdict(fit)}, {fit.get('levels', len(set(fit['x'])))} levels)"
    xs = sorted(set(fit["x"]))
    if name in ("steps", "n_experts", "batch_size"):
        up, down = parts[2], parts[1]
        dom = form.roles[2] if up > down else form.roles[1]
        opt = fit["optimum"]
        where = (f"fitted optimum {_g(opt)} (95% CI of the {100 * fit['optimum_share']:.0f}% of bootstrap fits "
                 f"that have one: {fit['optimum_ci'] and [round(v, 3) for v in fit['optimum_ci']]})") \
            if opt else "no finite optimum (one of the competing terms is fitted as zero)"
        which = (f"the {dom} term dominates ({_g(max(up, down))} vs {_g(min(up, down))})" if max(up, down) > 0
                 else "neither competing term is active (both fitted as zero: the loss is flat)")
        return f"- {name}: at the default {x0:g}, {which}; {where}; grid {xs[0]:g}..{xs[-1]:g}. {tail}"
    rise = float(evaluate_form(form, c, xs[-1])[0] - evaluate_form(form, c, xs[0])[0])
    return (f"- {name}: the {form.roles[1]} term is {_g(parts[1])} at the default {x0:g} "
            f"(floor {_g(parts[0])}); from {xs[0]:g} to {xs[-1]:g} the fitted loss changes by {rise:+.4g}. {tail}")


def _terms_lines(fits: dict) -> list[str]:
    t = fits.get("terms") or {}
    if not t:
        return []
    noise, het = t["noise_part"], t["heterogeneity_part"]
    dom = "gradient noise sigma^2" if noise > het else "task heterogeneity 3*b*zeta^2"
    hint = ("larger batches do not add to it; prefer more data or a smaller lr" if noise > het else
            "it grows with the batch size b: at this lr a smaller b or fewer / more related tasks help")
    return [f"- bound terms at the defaults: sigma^2 = {_g(t['sigma2'])}, zeta^2 = {_g(t['zeta2'])}, so in "
            f"sigma^2/n + 3*b*zeta^2/n the {dom} part dominates ({_g(max(noise, het))} vs {_g(min(noise, het))}); "
            f"{hint}.",
            f"- merging costs {t['merged_loss'] - t['expert_loss']:+.4g} loss over the experts' own mean "
            f"({_g(t['expert_loss'])} -> {_g(t['merged_loss'])})."]


def _other_lines(fits: dict) -> list[str]:
    out = []
    for m, s in (fits.get("sparsification") or {}).items():
        verb = "lowers" if s["mean_ratio"] < 1 else "does not lower"
        out.append(f"- {m} {verb} the task-vector heterogeneity: after/before = {s['mean_ratio']:.3g} on average, "
                   f"lower on {100 * s['fraction_lowered']:.0f}% of {s['n']} merges (Corollary 1 says always lower).")
    w = fits.get("weighting")
    if w:
        out.append(f"- averaging experts trained for K = {w['steps']} steps weights them as {np.round(w['measured'], 3).tolist()}"
                   f" (Eq. 14 predicts {np.round(w['predicted'], 3).tolist()}; mean abs error {w['mean_abs_error']:.3g});"
                   f" shares of the total displacement ||tau_i||: {np.round(w['displacement_share'], 3).tolist()}.")
    for m, it in (fits.get("interaction") or {}).items():
        sl = it.get("b_star_slope")
        opts = {lr: f["optimum"] for lr, f in it["by_lr"].items()}
        out.append(f"- {m}: best batch size by learning rate {opts}" + (
            f"; log b* vs log lr slope {sl['slope']:.2f} (Theorem 3 predicts -1)." if sl else "."))
    for var, s in (fits.get("stability") or {}).items():
        if isinstance(s, dict) and "slope" in s:
            ci = s["ci"] and [round(v, 2) for v in s["ci"]]
            zeros = (f"; {s['zero_pairs']} of {s['pairs']} twin distances are exactly 0 (sample never drawn)"
                     if "pairs" in s else "")
            dropped = f", {s['zero_rows']} all-zero rows left out of the log fit" if s.get("zero_rows") else ""
            out.append(f"- L2 stability grows as {var}^{s['slope']:.2f} (95% CI {ci}; Theorem 1: "
                       f"{s['expected']:g}{zeros}{dropped}).")
    return out


def advise(rows: list[dict], fits: dict) -> str:
    """The advice text: best settings, the dominant term of each law, the bound's terms, the other claims."""
    best = best_settings(rows)
    if not best:
        return "No grid results yet: run `clmerge study` first."
    lines = _partial_line(fits) + _headline(best)
    for method in fits.get("methods", []):
        laws = [_law_line(n, per[method]) for n, per in fits.get("laws", {}).items() if method in per]
        laws += [f"- {n}: not fitted: {per[method]}" for n, per in (fits.get("not_fitted") or {}).items()
                 if method in per]
        if laws:
            lines += [f"\nLaws for {method}:", *laws]
    extra = _terms_lines(fits) + _other_lines(fits)
    if extra:
        lines += ["\nTerms of the bound and the other claims:"] + extra
    return "\n".join(lines)
