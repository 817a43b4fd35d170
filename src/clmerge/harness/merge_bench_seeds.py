"""Several fine-tuning seeds of the merging benchmark: one run per seed, then mean ± standard error.

Each seed's run lives in ``out/seed<s>/`` (its own ``results.json``/``results.md`` and plots); the experts of
all seeds share ``out/experts/``. :func:`summarise` writes ``out/results.json`` and ``out/results.md``: every
row's mean test accuracy and normalized accuracy as mean ± standard error over seeds, and CART's claims
restated with standard errors of the paired (same-seed) differences.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..metrics import mean_se
from ..utils.io import atomic_write_text, read_json, write_json
from .merge_bench import ROW_LABELS, protocol_line

__all__ = ["mean_se", "summarise", "summary_markdown", "paired_verdict", "PAIRED_CLAIMS"]


def _pm(xs: Sequence[float]) -> str:
    m, se = mean_se(xs)
    return f"{m:.1f}" if math.isnan(se) else f"{m:.1f} ± {se:.1f}"


def summarise(out: Path, seeds: Sequence[int]) -> dict[str, Any]:
    """Read ``out/seed<s>/results.json`` for ``seeds``; write and return the summary (module docstring).

    A row (or a claim) missing from some seeds' runs is summarised over the seeds that have it; its ``seeds``
    entry says which.
    """
    runs = {s: read_json(out / f"seed{s}" / "results.json", within=out) for s in seeds}
    names = list(dict.fromkeys(n for r in runs.values() for n in r["rows"]))
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        have = [s for s in seeds if name in runs[s]["rows"]]
        avgs = [runs[s]["rows"][name]["avg"] for s in have]
        norms = [runs[s]["rows"][name]["normalized"] for s in have]
        rows[name] = {"seeds": have, "avg": mean_se(avgs), "normalized": mean_se(norms), "avg_per_seed": avgs,
                      "normalized_per_seed": norms, "hp_per_seed": [runs[s]["rows"][name]["hp"] for s in have]}
    first = runs[seeds[0]]
    summary = {"seeds": list(seeds), "config": first["config"], "tasks": first["tasks"], "rows": rows,
               "grids_per_seed": {s: r.get("grids", {}) for s, r in runs.items()}}
    claims = _claims(runs)
    if claims:
        summary["claims"] = claims
    write_json(out / "results.json", summary)
    atomic_write_text(out / "results.md", summary_markdown(summary))
    return summary


def _claims(runs: dict[int, dict]) -> dict[str, Any]:
    """CART's claims with paired differences over seeds (each seed's CART against the same seed's baseline)."""
    out: dict[str, Any] = {}
    for base in ("weight_average", "task_arithmetic"):
        have = [s for s, r in runs.items() if "cart" in r["rows"] and base in r["rows"]]
        if have:
            d = [runs[s]["rows"]["cart"]["avg"] - runs[s]["rows"][base]["avg"] for s in have]
            out[f"cart_minus_{base}"] = {"seeds": have, "per_seed": d, "mean_se": mean_se(d)}
    for a, b, _ in PAIRED_CLAIMS:
        have = [s for s, r in runs.items() if a in r["rows"] and b in r["rows"]]
        if have:
            d = [runs[s]["rows"][a]["avg"] - runs[s]["rows"][b]["avg"] for s in have]
            out[f"{a}_minus_{b}"] = {"seeds": have, "per_seed": d, "mean_se": mean_se(d)}
    # a run's rank-ratio curve: from its analysis, or a separately measured "rank_ratio_curve" (same keys)
    curve_of = {s: r["analysis"]["rank_ratio"] if "analysis" in r else r.get("rank_ratio_curve")
                for s, r in runs.items()}
    have = [s for s, c in curve_of.items() if c]
    if have:
        curves = np.array([curve_of[s]["cart"] for s in have])
        ratios = curve_of[have[0]]["ratios"]
        interior = curves[:, 1:-1]
        peak = int(interior.mean(0).argmax())
        # Bell curve: the best interior rank ratio (picked on the mean curve) above the better end (= averaging)
        bell = (interior[:, peak] - np.maximum(curves[:, 0], curves[:, -1])).tolist()
        out["rank_ratio_curve"] = {"seeds": have, "ratios": ratios, "cart_mean": curves.mean(0).tolist(),
                                   "cart_se": [mean_se(c)[1] for c in curves.T]}
        out["bell"] = {"seeds": have, "peak_ratio": ratios[1 + peak], "per_seed": bell, "mean_se": mean_se(bell)}
    return out


# The SVD family's claims (TSV-M and Iso papers; CART's repository): (method, against, kind). ">": the method
# is better, judged like CART's claims; "≈": equivalence within EQUIVALENCE_MARGIN points (_equivalence).
PAIRED_CLAIMS = [("tsv_m", "task_arithmetic", ">"), ("iso_cts", "task_arithmetic", ">"),
                 ("iso_c", "task_arithmetic", ">"), ("cart", "tsv_m", "≈")]
EQUIVALENCE_MARGIN = 1.0
CLAIM_NAMES = {"tsv_m": "TSV-M", "iso_cts": "Iso-CTS", "iso_c": "Iso-C", "cart": "CART",
               "task_arithmetic": "task arithmetic"}


def _equivalence(m_se: tuple[float, float], margin: float = EQUIVALENCE_MARGIN) -> str:
    """"A ≈ B": holds when the 2-standard-error interval of the paired difference lies inside ±``margin``
    points; does not hold when it excludes 0; otherwise not resolved."""
    m, se = m_se
    if math.isnan(se):
        return "one seed: no standard error"
    if -margin < m - 2 * se and m + 2 * se < margin:
        return f"holds (the 2-standard-error interval lies within ±{margin:g} point)"
    if m - 2 * se > 0 or m + 2 * se < 0:
        return "does not hold (the difference is more than 2 standard errors from 0)"
    return f"not resolved (the 2-standard-error interval reaches past ±{margin:g} point but includes 0)"


def paired_verdict(m_se: tuple[float, float]) -> str:
    """A paired difference's verdict: more than 2 standard errors above or below 0, else not resolved."""
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
    lines = [protocol_line(summary["config"]) + f" Fine-tuning seeds {summary['seeds']}; each cell is the mean ± "
             "standard error over seeds (n = the number of seeds of that row) of the mean over tasks. Per-seed "
             "tables: " + ", ".join(f"[seed {s}](seed{s}/results.md)" for s in summary["seeds"]) + ".", "",
             "| method | n | mean test accuracy | normalized (merged / expert, %) | hyperparameters per seed |",
             "|---|---|---|---|---|"]
    for name, r in summary["rows"].items():
        hps = "; ".join(str(h) for h in r["hp_per_seed"]) if any(r["hp_per_seed"]) else ""
        lines.append(f"| {ROW_LABELS.get(name, name)} | {len(r['seeds'])} | {_pm(r['avg_per_seed'])} | "
                     f"{_pm(r['normalized_per_seed'])} | {hps} |")
    c = summary.get("claims", {})
    if c:
        lines += ["", "## CART's claims over seeds (paired same-seed differences, mean ± standard error)", ""]
    for base, label in (("weight_average", "weight averaging"), ("task_arithmetic", "task arithmetic")):
        if f"cart_minus_{base}" in c:
            d = c[f"cart_minus_{base}"]
            lines.append(f"- CART − {label}: {_pmd(d['mean_se'])} points over seeds {d['seeds']} (per seed "
                         f"{', '.join(f'{x:+.1f}' for x in d['per_seed'])}): {paired_verdict(d['mean_se'])}")
    if "bell" in c:
        b, curve = c["bell"], c["rank_ratio_curve"]
        lines += [f"- Bell curve: CART at the best interior rank ratio of the mean curve ({b['peak_ratio']}) minus "
                  f"the better end (rank 0 or full rank, both = averaging): {_pmd(b['mean_se'])} points over seeds "
                  f"{b['seeds']}: {paired_verdict(b['mean_se'])}; the ratio is picked on the same test curve, so this is "
                  "optimistic", "",
                  "| rank ratio | " + " | ".join(str(g) for g in curve["ratios"]) + " |",
                  "|---|" + "---|" * len(curve["ratios"]),
                  "| CART (test, at each seed's chosen scaling) | "
                  + " | ".join(f"{m:.1f}" + ("" if math.isnan(s) else f" ± {s:.1f}")
                               for m, s in zip(curve["cart_mean"], curve["cart_se"])) + " |"]
    pairs = [(a, b, kind) for a, b, kind in PAIRED_CLAIMS if f"{a}_minus_{b}" in c]
    if pairs:
        lines += ["", "## The SVD family's claims over seeds (paired same-seed differences, mean ± standard error)",
                  ""]
    for a, b, kind in pairs:
        d = c[f"{a}_minus_{b}"]
        verdict = paired_verdict(d["mean_se"]) if kind == ">" else _equivalence(d["mean_se"])
        lines.append(f"- {CLAIM_NAMES[a]} {'>' if kind == '>' else '≈'} {CLAIM_NAMES[b]}: {CLAIM_NAMES[a]} − "
                     f"{CLAIM_NAMES[b]} = {_pmd(d['mean_se'])} points over seeds {d['seeds']} (per seed "
                     f"{', '.join(f'{x:+.1f}' for x in d['per_seed'])}): {verdict}")
    return "\n".join(lines) + "\n"


def _pmd(m_se: tuple[float, float]) -> str:
    m, se = m_se
    return f"{m:+.1f}" if math.isnan(se) else f"{m:+.1f} ± {se:.1f}"
