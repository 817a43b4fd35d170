"""results.md and figures of the LoRA continual-learning evidence grid (used by run_evidence.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

__all__ = ["HEADS", "baselines_section", "claim_verdict", "collect", "head_metrics", "load_archive", "mean_se_text",
           "mean_std", "paired_difference", "primary_head", "validation_ranking", "write_archive", "write_figures",
           "write_results"]

HEADS = ("linear", "linear+align", "ncm", "ranpac")


def _metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


def _finished(method_dir: Path) -> list[Path]:
    """The seed run directories of one method that have finished (``metrics.json`` written)."""
    return [r for r in sorted(method_dir.glob("seed*")) if r.is_dir() and (r / "metrics.json").exists()]


def load_archive(path: Path | None) -> dict:
    """The committed per-run archive ``{benchmark: {method: {"seed<s>": metrics}}}`` (empty when absent).

    Run directories are git-ignored and large; the archive keeps every finished run's ``metrics.json`` in the
    repository, so a later session that re-runs some cells still reports the ones it did not re-run."""
    if path is None or not Path(path).exists():
        return {}
    return json.loads(Path(path).read_text())


def _runs(out_root: Path, archive: dict | None = None) -> dict[str, dict[str, dict[str, tuple[dict, Path | None]]]]:
    """``{benchmark: {method: {"seed<s>": (metrics, run dir or None)}}}``: the archive, overlaid by the finished
    run directories under ``out_root/main`` (a run directory wins over its archived copy)."""
    found: dict = {}
    for bench, methods in (archive or {}).items():
        for label, seeds in methods.items():
            for seed, m in seeds.items():
                found.setdefault(bench, {}).setdefault(label, {})[seed] = (m, None)
    for bench_dir in sorted((out_root / "main").glob("*")):
        for method_dir in sorted(bench_dir.glob("*")):
            for r in _finished(method_dir):
                found.setdefault(bench_dir.name, {}).setdefault(method_dir.name, {})[r.name] = (_metrics(r), r)
    return found


def _seed_key(name: str) -> tuple[int, str]:
    digits = name.removeprefix("seed")
    return (int(digits), name) if digits.isdigit() else (1 << 30, name)


def _metrics_by_seed(out_root: Path, archive: dict | None = None) -> dict[str, dict[str, dict[str, dict]]]:
    """``{benchmark: {method: {"seed<s>": metrics}}}`` (``_runs`` without the run directories), in seed order."""
    return {b: {m: {k: seeds[k][0] for k in sorted(seeds, key=_seed_key)} for m, seeds in sorted(ms.items())}
            for b, ms in sorted(_runs(out_root, archive).items())}


def _as_lists(by_seed: dict) -> dict[str, dict[str, list[dict]]]:
    return {b: {m: list(seeds.values()) for m, seeds in ms.items()} for b, ms in by_seed.items()}


def collect(out_root: Path, archive: dict | None = None) -> dict[str, dict[str, list[dict]]]:
    """``{benchmark: {method label: [metrics of each finished seed, in seed order]}}`` from the archive and
    ``out_root/main``."""
    return _as_lists(_metrics_by_seed(out_root, archive))


def write_archive(out_root: Path, path: Path, archive: dict | None = None) -> None:
    """Write the merged archive (``load_archive``'s format) atomically to ``path``."""
    merged = _metrics_by_seed(out_root, archive)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(merged, separators=(",", ":"), sort_keys=True))
    tmp.replace(path)


def mean_std(values: list[float]) -> str:
    """``mean ± std`` (population std over seeds), or ``—``."""
    v = [x for x in values if x is not None]
    if not v:
        return "—"
    return f"{np.mean(v):.2f} ± {np.std(v):.2f}"


def head_metrics(run: dict, head: str) -> dict | None:
    """One head variant's metrics of a run: ``heads[head]`` of a ``head.compare`` run, else the run's own
    metrics when its head is ``head`` (runs made before heads were compared had only the linear head)."""
    if run.get("heads"):
        return run["heads"].get(head)
    own = (run.get("head") or {}).get("variant", "linear")
    return run if own == head else None


def _row(label: str, head: str, runs: list[dict], lr: str) -> str | None:
    hm = [m for r in runs if (m := head_metrics(r, head)) is not None]
    if not hm:
        return None
    acc = mean_std([r["acc"] for r in hm])
    aaa = mean_std([r["aaa"] for r in hm])
    til = [r.get("til") or {} for r in hm]
    t_acc = mean_std([t.get("acc") for t in til])
    t_aaa = mean_std([t.get("aaa") for t in til])
    return f"| {label} | {head} | {acc} | {aaa} | {t_acc} | {t_aaa} | {len(hm)} | {lr} |"


def validation_ranking(out_root: Path, bench: str, val_fn, archive: dict | None = None,
                       exclude: frozenset[str] | set[str] = frozenset()) -> list[tuple[str, float, float, int]]:
    """``(label, mean, std, seeds)`` of the final validation CIL accuracy of every finished (method, head) of
    ``bench``, best first: the ranking that picks ``clmerge run``'s default method and head (test data never
    enters it). ``val_fn(run_dir, head)`` gives one run's validation accuracy of one head; an archived run
    without its directory uses the ``val_acc`` its metrics recorded for that head. Labels in ``exclude`` are
    left out."""
    rows = []
    for label, seeds in sorted(_runs(out_root, archive).get(bench, {}).items()):
        if label in exclude:
            continue
        for head in HEADS:
            v = []
            for metrics, run_dir in seeds.values():
                hm = head_metrics(metrics, head)
                if hm is None:
                    continue
                v.append(val_fn(run_dir, head) if run_dir is not None else hm.get("val_acc"))
            v = [x for x in v if x is not None]
            if v:
                rows.append((f"{label} + {head}", float(np.mean(v)), float(np.std(v)), len(v)))
    return sorted(rows, key=lambda r: -r[1])


def write_results(out_root: Path, path: Path, bench_order: list[str], method_order: list[str], *,
                  smoke: bool = False, val_fn=None, rank_on: str | None = None,
                  archive: dict | None = None, baselines: list[str] | None = None) -> None:
    """Write the Acc / AAA tables (mean ± std over seeds; CIL and TIL) with the selected learning rates, and,
    given ``val_fn`` (run dir, head -> validation accuracy), the validation ranking on benchmark ``rank_on``.
    Runs come from ``out_root/main`` and from ``archive`` (``load_archive``). The labels of ``baselines`` (the
    continual-learning baselines, each with its own head) get their own section (``baselines_section``) instead
    of rows in the per-head tables and the validation ranking."""
    baselines = list(baselines or [])
    method_order = [m for m in method_order if m not in baselines]
    by_seed = _metrics_by_seed(out_root, archive)  # every metrics.json read once, for both parts
    data = _as_lists(by_seed)
    sel_file = out_root / "selected.json"
    selected = json.loads(sel_file.read_text()) if sel_file.exists() else {}
    lines = ["# LoRA continual learning: evidence grid (four heads, LoRA on key and value)", "",
             "Generated by `python benchmarks/lora_cl/run_evidence.py` (see its docstring for the commands).",
             "Acc = final accuracy over all tasks, AAA = average anytime accuracy, in %, mean ± std over seeds;",
             "CIL = class-incremental (no task id, all seen classes), TIL = task id known (argmax inside the",
             "task's range of that head's logits). Every LoRA method adapts the key and value projections.",
             "Head: every run is evaluated with four heads on the same backbone (`head.compare: true`; the",
             "shadow heads never feed back into training): `linear` (the trained head), `linear+align` (SLCA",
             "classifier alignment), `ncm` (cosine nearest class mean), `ranpac` (random projection M=2000 +",
             "ridge). Learning rates were selected on held-out validation data (10% of each task's training",
             "set), never on test (see the README for which selection each row uses). Variants and ablations",
             "use their parent method's rate; a benchmark without its own selection uses the first one's.", ""]
    if smoke:
        lines += ["**SMOKE RUN: tiny setting (1 epoch of 2 steps, 8 images per class); numbers are meaningless.**", ""]
    for bench in [b for b in bench_order if b in data]:
        lines += [f"## {bench}", "",
                  "| method | head | CIL Acc | CIL AAA | TIL Acc | TIL AAA | seeds | lr (val-selected) |",
                  "|---|---|---|---|---|---|---|---|"]
        for label in [m for m in method_order if m in data[bench]]:
            sel = selected.get(bench, {}).get(label, {})
            lr = sel.get("lr", "?")
            lr_txt = f"{lr:g}" if isinstance(lr, float) else str(lr)
            if sel.get("selected_on"):
                lr_txt += f" ({sel['selected_on']})"
            lines += [r for h in HEADS if (r := _row(label, h, data[bench][label], lr_txt)) is not None]
        lines.append("")
    if val_fn is not None and rank_on in data:
        lines += [f"## Validation ranking ({rank_on})", "",
                  "Final class-incremental accuracy on the held-out validation parts (10% of each task's training",
                  "set), mean ± std over the finished seeds, per method and head. The top pair is `clmerge run`'s",
                  "default.", "",
                  "| rank | method + head | validation CIL | seeds |", "|---|---|---|---|"]
        ranking = validation_ranking(out_root, rank_on, val_fn, archive, exclude=set(baselines))
        for i, (label, mean, std, n) in enumerate(ranking, 1):
            lines.append(f"| {i} | {label} | {mean:.2f} ± {std:.2f} | {n} |")
        lines.append("")
    if baselines:
        lines += baselines_section(by_seed, selected, baselines, bench_order)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def _plot_series(ax, series: list[list[float]], label: str) -> None:
    for i, s in enumerate(series):
        ax.plot(range(1, len(s) + 1), s, marker="o", alpha=0.8, label=f"{label} seed {i}")


def write_figures(out_root: Path, fig_dir: Path, archive: dict | None = None) -> list[Path]:
    """SD-LoRA magnitudes per task, SD-LoRA-KD residuals, P&M alpha per task (one PNG each per benchmark)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data, written = collect(out_root, archive), []
    fig_dir.mkdir(parents=True, exist_ok=True)
    for bench, methods in data.items():
        for label, key in (("sd_lora", "magnitudes"), ("sd_lora_kd", "kd"), ("pm", "alpha")):
            runs = methods.get(label)
            if not runs:
                continue
            fig, ax = plt.subplots(figsize=(5, 3.2))
            if key == "magnitudes":  # final magnitude of each task's component, one line per seed
                finals = [list((r["method_metrics"].get("magnitudes") or [{}])[-1].values()) for r in runs]
                _plot_series(ax, finals, "alpha_k after the last task")
                ax.set_xlabel("task k"), ax.set_ylabel("magnitude alpha_k")
            elif key == "kd":
                res = [[(e.get("residual") or np.nan) for e in r["method_metrics"].get("kd", [])] for r in runs]
                _plot_series(ax, res, "LS residual")
                ax.set_xlabel("task"), ax.set_ylabel("least-squares residual"), ax.set_yscale("log")
            else:
                _plot_series(ax, [r["method_metrics"].get("alpha", []) for r in runs], "alpha_t")
                ax.set_xlabel("task t"), ax.set_ylabel("P&M alpha_t (Eq. 8)")
            ax.set_title(f"{label} on {bench}", fontsize=9)
            ax.legend(fontsize=6)
            fig.tight_layout()
            path = fig_dir / f"{bench}_{label}_{key}.png"
            fig.savefig(path, dpi=120)
            plt.close(fig)
            written.append(path)
    return written


# -- the continual-learning baselines' section -------------------------------------------------------------------
# The rows the baselines are set beside: (label, head), each the method's own head except the frozen backbone's
# RanPAC head (the statistics-head reference).
BASELINE_REFERENCES = (("seq_lora", "linear"), ("sd_lora", "linear"), ("pm", "linear"), ("l2p", "linear"),
                       ("frozen", "ranpac"))
# What each baseline's primary head is (metrics.json names EASE's and MOS's own classifiers "linear": the output
# of their inference model).
OWN_HEAD = {"simplecil": "cosine prototypes", "aper": "cosine prototypes, [pretrained; adapted]",
            "ease": "own: reweighted subspace prototypes", "mos": "own: retrieval + prototype ensemble",
            "slca": "linear+align", "er": "linear", "der": "linear", "derpp": "linear", "ranpac": "ranpac",
            "ranpac_rp": "ranpac", "aper_finetune": "cosine prototypes, [pretrained; fine-tuned]",
            "lwf": "linear", "xder": "linear", "er_ace": "own: cosine classifier (Mammoth's)",
            "icarl": "own: nearest mean of exemplars", "lae": "own: online + offline energy ensemble",
            "fecam": "own: Mahalanobis, shrunk class covariances", "cl_lora": "own: diagonal cosine prototypes",
            "olora": "linear"}
# The claims, as paired same-seed differences of final CIL accuracy (A - B > 0), each (label, head) with head
# None for the method's own (primary) head. A claim holds when every pair does.
_OWN = None
CLAIMS = (
    ("EASE / MOS > SimpleCIL / APER > L2P-style prompts (PILOT's ordering)",
     [(("ease", _OWN), ("simplecil", _OWN)), (("ease", _OWN), ("aper", _OWN)), (("mos", _OWN), ("simplecil", _OWN)),
      (("mos", _OWN), ("aper", _OWN)), (("simplecil", _OWN), ("l2p", _OWN)), (("aper", _OWN), ("l2p", _OWN))]),
    ("rehearsal with a small buffer (er, derpp) beats rehearsal-free LoRA (seq_lora, sd_lora, pm) on CIL",
     [((a, _OWN), (b, _OWN)) for a in ("er", "derpp") for b in ("seq_lora", "sd_lora", "pm")]),
    ("SD-LoRA / P&M beat the prototype methods (SimpleCIL, APER, EASE, MOS)",
     [((a, _OWN), (b, _OWN)) for a in ("sd_lora", "pm") for b in ("simplecil", "aper", "ease", "mos")]),
    # the classic and LoRA-line baselines (docs/classic_baselines.md, docs/ptm_baselines.md)
    ("iCaRL and LwF are below the PTM methods (the prototype line: SimpleCIL, APER, EASE, MOS, RanPAC, FeCAM)",
     [((a, _OWN), (b, _OWN)) for b in ("icarl", "lwf") for a in ("simplecil", "aper", "ease", "mos", "ranpac",
                                                                  "fecam")]),
    ("O-LoRA / CL-LoRA ≥ InfLoRA (their papers)", [(("olora", _OWN), ("inflora", _OWN)),
                                                   (("cl_lora", _OWN), ("inflora", _OWN))]),
    ("ER-ACE > ER in class-incremental settings (its paper)", [(("er_ace", _OWN), ("er", _OWN))]),
    ("X-DER > DER++ (its paper)", [(("xder", _OWN), ("derpp", _OWN))]),
)


def primary_head(run: dict) -> str:
    """The head a run predicts with (its ``head.variant``; linear for runs that recorded none)."""
    return (run.get("head") or {}).get("variant", "linear")


def _head_of(run: dict, head: str | None) -> dict | None:
    return head_metrics(run, primary_head(run) if head is None else head)


def mean_se_text(values: list[float]) -> str:
    """``mean ± standard error`` over seeds (sample standard deviation / sqrt(n)); the mean alone for one seed."""
    from clmerge.metrics import mean_se

    v = [x for x in values if x is not None]
    if not v:
        return "—"
    m, se = mean_se(v)
    return f"{m:.2f}" if np.isnan(se) else f"{m:.2f} ± {se:.2f}"


def _rate_text(sel: dict) -> tuple[str, str]:
    """The selected rate and the validation scores of every tried rate (the selecting head's), as table text."""
    if not sel:
        return "?", ""
    lr = sel.get("lr")
    text = "—" if lr is None else f"{lr:g}"
    if sel.get("selected_on"):
        text += f" ({sel['selected_on']})"
    if sel.get("at_edge"):
        text += ", at the grid's edge"
    vals = "; ".join(f"{k}: {v:.2f}" for k, v in (sel.get("val_acc") or {}).items() if v is not None)
    return text, vals


def _baseline_row(label: str, head: str | None, runs: dict[str, dict], sel: dict) -> str | None:
    hm = [m for r in runs.values() if (m := _head_of(r, head)) is not None]
    if not hm:
        return None
    name = OWN_HEAD.get(label, head or primary_head(next(iter(runs.values()))))
    til = [r.get("til") or {} for r in hm]
    train_s = [t for r in runs.values() if (t := (r.get("timings") or {}).get("total_s")) is not None]
    # the fastest seed: the runs share a loaded 2-core machine, and a mean would report the load (one ER seed
    # took 5,650 s beside others' 171 s for the same work)
    fastest = f"{min(train_s):.0f}" if train_s else "—"
    rate, vals = _rate_text(sel)
    cells = [mean_se_text([r["acc"] for r in hm]), mean_se_text([r["aaa"] for r in hm]),
             mean_se_text([t.get("acc") for t in til]), mean_se_text([t.get("aaa") for t in til])]
    return f"| {label} | {name} | {' | '.join(cells)} | {len(hm)} | {rate} | {vals} | {fastest} |"


def paired_difference(runs: dict, a: tuple[str, str | None], b: tuple[str, str | None]) -> dict | None:
    """The paired same-seed difference of final CIL accuracy, A − B, over the seeds both have: ``{"seeds",
    "per_seed", "mean_se", "verdict"}``; None when a row is missing or they share no seed."""
    from clmerge.harness.merge_bench_seeds import paired_verdict
    from clmerge.metrics import mean_se

    ra, rb = runs.get(a[0], {}), runs.get(b[0], {})
    diffs, seeds = [], []
    for seed in sorted(set(ra) & set(rb), key=_seed_key):
        ma, mb = _head_of(ra[seed], a[1]), _head_of(rb[seed], b[1])
        if ma is not None and mb is not None:
            diffs.append(ma["acc"] - mb["acc"])
            seeds.append(seed)
    if not diffs:
        return None
    m_se = mean_se(diffs)
    return {"seeds": seeds, "per_seed": diffs, "mean_se": m_se, "verdict": paired_verdict(m_se)}


def _side(x: tuple[str, str | None]) -> str:
    return x[0] if x[1] is None else f"{x[0]} ({x[1]})"


def claim_verdict(runs: dict, pairs: list) -> tuple[str, list[tuple[str, dict | None]]]:
    """A claim's verdict over its pairs: holds when every pair holds, does not hold when one pair's difference is
    more than 2 standard errors below 0, else not resolved; "not measured" names the rows that are missing."""
    results = [(f"{_side(a)} − {_side(b)}", paired_difference(runs, a, b)) for a, b in pairs]
    missing = sorted({_side(x) for a, b in pairs for x in (a, b) if not runs.get(x[0])})
    measured = [r for _, r in results if r is not None]
    if not measured:
        return f"not measured (missing: {', '.join(missing) or 'a shared seed'})", results
    if any(r["verdict"].startswith("does not hold") for r in measured):
        verdict = "does not hold (a pair is more than 2 standard errors below 0)"
    elif len(measured) == len(results) and all(r["verdict"].startswith("holds") for r in measured):
        verdict = "holds (every pair more than 2 standard errors above 0)"
    else:
        verdict = "not resolved"
    if len(measured) < len(results):
        verdict += f"; partly measured (missing: {', '.join(missing) or 'a shared seed'})"
    return verdict, results


def baselines_section(found: dict, selected: dict, labels: list[str], bench_order: list[str]) -> list[str]:
    """results.md's section of the continual-learning baselines: per benchmark, each baseline's primary-head row
    and the reference rows (mean ± standard error over seeds, the selected rate and its validation scores, the
    mean run time), the four shared heads of the runs that recorded them, and the claims as paired differences.
    ``found`` is ``_runs``' mapping with the metrics alone: ``{bench: {label: {"seed<s>": metrics}}}``; no
    lines when no baseline has a run."""
    benches = [b for b in bench_order if any(m in found.get(b, {}) for m in labels)]
    if not benches:
        return []
    lines = ["## Continual-learning baselines of pre-trained-model papers", "",
             "Each baseline with the head its paper uses (its primary head, the one phase 1 selects the rate on:",
             "validation CIL accuracy, `head.val_acc`), beside the rows it is compared with (their own heads; the",
             "frozen backbone's RanPAC head). Mean ± standard error over seeds (sample standard deviation / √n).",
             "`validation (rate: CIL)`: the selecting head's validation accuracy of every rate phase 1 tried.",
             "`run s`: the fastest seed's training time (`timings.total_s`: training and head statistics, summed over "
             "tasks, without the evaluations; the others shared the machine with more runs).",
             "simplecil and ranpac train nothing. The rehearsal buffer holds 200 examples (`method.buffer_size`,",
             "the default).", ""]
    for bench in benches:
        runs, sel = found[bench], selected.get(bench, {})
        lines += [f"### {bench}", "", "| method | head | CIL Acc | CIL AAA | TIL Acc | TIL AAA | seeds | lr | "
                  "validation (rate: CIL) | run s |", "|---|---|---|---|---|---|---|---|---|---|"]
        rows = [(m, None) for m in labels] + list(BASELINE_REFERENCES)
        lines += [r for m, h in rows if m in runs and (r := _baseline_row(m, h, runs[m], sel.get(m, {})))]
        lines += _shared_heads(runs, labels) + ["", "Claims (paired same-seed differences of final CIL accuracy, "
                                                    "mean ± standard error, per seed):", ""]
        for text, pairs in CLAIMS:
            verdict, results = claim_verdict(runs, pairs)
            lines.append(f"- **{text}**: {verdict}.")
            for name, r in results:
                lines.append(f"  - {name}: " + ("not measured" if r is None else _pair_text(r)))
        lines.append("")
    return lines


def _pair_text(r: dict) -> str:
    m, se = r["mean_se"]
    per = ", ".join(f"{d:+.1f}" for d in r["per_seed"])
    return f"{m:+.2f}" + ("" if np.isnan(se) else f" ± {se:.2f}") + f" ({per}; {r['verdict']})"


def _shared_heads(runs: dict, labels: list[str]) -> list[str]:
    """The four shared heads (``head.compare``) of the baselines that recorded them: CIL / TIL Acc."""
    have = [m for m in labels if m in runs and all(r.get("heads") for r in runs[m].values())]
    if not have:
        return []
    out = ["", "The four shared heads of the runs that record them (`head.compare`), CIL Acc / TIL Acc:", "",
           "| method | " + " | ".join(HEADS) + " |", "|---|" + "---|" * len(HEADS)]
    for m in have:
        cells = []
        for h in HEADS:
            hm = [x for r in runs[m].values() if (x := head_metrics(r, h)) is not None]
            cells.append(f"{mean_se_text([x['acc'] for x in hm])} / "
                         f"{mean_se_text([(x.get('til') or {}).get('acc') for x in hm])}")
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    return out
