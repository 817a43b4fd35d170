"""results.md and figures of the LoRA continual-learning evidence grid (used by run_evidence.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

__all__ = ["HEADS", "collect", "head_metrics", "load_archive", "mean_std", "validation_ranking", "write_archive",
           "write_figures", "write_results"]

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


def collect(out_root: Path, archive: dict | None = None) -> dict[str, dict[str, list[dict]]]:
    """``{benchmark: {method label: [metrics of each finished seed, in seed order]}}`` from the archive and
    ``out_root/main``."""
    return {b: {m: [seeds[k][0] for k in sorted(seeds, key=_seed_key)] for m, seeds in sorted(ms.items())}
            for b, ms in sorted(_runs(out_root, archive).items())}


def write_archive(out_root: Path, path: Path, archive: dict | None = None) -> None:
    """Write the merged archive (``load_archive``'s format) atomically to ``path``."""
    merged = {b: {m: {k: seeds[k][0] for k in sorted(seeds, key=_seed_key)} for m, seeds in sorted(ms.items())}
              for b, ms in sorted(_runs(out_root, archive).items())}
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


def validation_ranking(out_root: Path, bench: str, val_fn, archive: dict | None = None
                       ) -> list[tuple[str, float, float, int]]:
    """``(label, mean, std, seeds)`` of the final validation CIL accuracy of every finished (method, head) of
    ``bench``, best first: the ranking that picks ``clmerge run``'s default method and head (test data never
    enters it). ``val_fn(run_dir, head)`` gives one run's validation accuracy of one head; an archived run
    without its directory uses the ``val_acc`` its metrics recorded for that head."""
    rows = []
    for label, seeds in sorted(_runs(out_root, archive).get(bench, {}).items()):
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
                  archive: dict | None = None) -> None:
    """Write the Acc / AAA tables (mean ± std over seeds; CIL and TIL) with the selected learning rates, and,
    given ``val_fn`` (run dir, head -> validation accuracy), the validation ranking on benchmark ``rank_on``.
    Runs come from ``out_root/main`` and from ``archive`` (``load_archive``)."""
    data = collect(out_root, archive)
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
        for i, (label, mean, std, n) in enumerate(validation_ranking(out_root, rank_on, val_fn, archive), 1):
            lines.append(f"| {i} | {label} | {mean:.2f} ± {std:.2f} | {n} |")
        lines.append("")
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
