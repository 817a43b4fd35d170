"""The merging benchmark: experts fine-tuned from one pretrained backbone on offline tasks, every method evaluated.

Tasks (:mod:`.merge_bench_data`) are offline image sets under fixed transformations, or class subsets of a
text source; each task has its own head. Experts (:mod:`.merge_bench_experts`) follow a head protocol: ``frozen`` (the default of ``clmerge
merge-bench``: heads fitted on the pretrained backbone before fine-tuning, experts train only the backbone) or
``cotrained``. Every method's hyperparameters are chosen on a validation split carved from the training data,
and each grid is extended until the chosen value is interior (:mod:`.merge_bench_grid`); test data is used only
for the reported numbers. Several fine-tuning seeds are summarised by :mod:`.merge_bench_seeds`.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor, nn

from ..merging.methods.registry import merge
from ..utils.extras import require_extra
from ..utils.io import atomic_write_text, write_json
from .merge_bench_data import SUITES, BenchTask, load_task, parse_task
from .merge_bench_experts import (BenchConfig, build_base, expert_digest, expert_for_task, expert_path, index_batches,
                                  init_expert, loss_and_accuracy, make_head, make_optimizer, split_expert, train_expert)
from .merge_bench_grid import search

__all__ = ["BenchTask", "BenchConfig", "SUITES", "DEFAULT_GRIDS", "run_benchmark", "expert_for_task", "train_expert",
           "init_expert", "expert_digest", "MAX_EXTENSIONS", "expert_path", "loss_and_accuracy", "parse_task", "split_expert",
           "load_task", "build_base", "results_markdown", "ROW_LABELS", "index_batches", "make_optimizer",
           "head_accuracy", "protocol_line"]

# Start grids; run_benchmark extends each one until its chosen value is interior, so a start grid may be coarse
# (each grid point costs one validation pass over all tasks: on a shared 2-core CPU that is the bottleneck).
# CART's scaling grid is arithmetic (step 1.0) so that its extensions continue it (0.5 below 1.0, by halving).
DEFAULT_GRIDS: dict[str, dict[str, list[Any]]] = {
    "weight_average": {},
    "task_arithmetic": {"scaling": [0.1, 0.2, 0.3, 0.5, 0.7, 1.0]},
    "ties": {"density": [0.1, 0.2], "scaling": [0.5, 1.0, 1.5]},
    "dare": {"drop_rate": [0.5, 0.9], "scaling": [0.2, 0.3, 0.5]},
    "consensus": {"k": [2], "scaling": [0.2, 0.3, 0.5, 0.7]},
    "low_rank_task_arithmetic": {"rank_ratio": [0.04, 0.08, 0.16, 0.32], "scaling": [0.3, 1.0]},
    "cart": {"rank_ratio": [0.04, 0.08, 0.16, 0.32], "scaling": [1.0, 2.0, 3.0]},
    # The SVD family: only alpha is searched (geometric, ratio 2, so extensions halve or double it); the rank
    # budget (1/T for TSV-M, common_space_fraction 0.8 for Iso-CTS) stays at the papers' defaults.
    "tsv_m": {"scaling": [0.125, 0.25, 0.5, 1.0]},
    "iso_c": {"scaling": [0.125, 0.25, 0.5, 1.0]},
    "iso_cts": {"scaling": [0.125, 0.25, 0.5, 1.0]},
    # No free hyperparameter in the papers' use: WUDI's merged vector is optimised directly (no alpha), OPCM's
    # alpha 0.5 and DOP's alpha 0.8 are the papers' values; the experts are merged in the suite's task order.
    "wudi": {},
    "opcm": {},
    "dop": {},
}

# At most this many extensions per hyperparameter and direction (merge_bench_grid.search). Suite 8's CART scaling
# ran from 3.0 to the old cap of 4 extensions (7.0) on seed 1 and was still at the top, hence 12.
MAX_EXTENSIONS = 12

ROW_LABELS = {"pretrained": "pretrained backbone + task heads", "individual": "individual experts"}


def head_accuracy(backbone: nn.Module, head: nn.Module, x: Tensor, y: Tensor, bs: int = 256) -> float:
    """Accuracy in percent of ``head`` on ``backbone``'s features of ``x``."""
    return 100.0 * loss_and_accuracy(backbone, head, x, y, bs)[1] / max(1, len(x))


def _evaluate(backbone: nn.Module, params: dict[str, Tensor], heads: list[nn.Module], data: list[dict],
              split: str) -> list[float]:
    backbone.load_state_dict(params)
    return [head_accuracy(backbone, h, *d[split]) for h, d in zip(heads, data)]


def _experts(cfg: BenchConfig, tasks: list[BenchTask], data: list[dict], cache: Path,
             log) -> tuple[list[dict[str, Tensor]], list[nn.Module]]:
    experts, heads = [], []
    for t, d in zip(tasks, data):
        log(f"expert {t.name}")
        bp, hp = expert_for_task(t, cfg, d, cache)
        experts.append(bp)
        heads.append(make_head(hp))
    return experts, heads


def run_benchmark(cfg: BenchConfig, out: Path, *, grids: dict[str, dict[str, list[Any]]] | None = None,
                  cache: Path | None = None, log=print, analysis: bool = True, max_extensions: int = MAX_EXTENSIONS) -> dict:
    """Fine-tune (or load) the experts, search each method's grid on validation, report test accuracy.

    Rows: ``pretrained`` (the pretrained backbone with the task heads: with frozen heads, the heads' own
    accuracy, e.g. the linear probe), ``individual`` (each expert on its task) and one per method. Every row
    has per-task test accuracy, its mean ``avg`` and ``normalized`` = mean over tasks of merged / expert (%).
    Writes ``out/results.json`` and ``out/results.md``; with ``analysis`` (and CART in the grids) also CART's
    rank-ratio curve, spectra and interference as PNG files. Returns the results dict.
    """
    tasks = SUITES[cfg.suite]
    grids = DEFAULT_GRIDS if grids is None else grids
    if analysis and "cart" in grids:  # its PNG files are drawn last: check for matplotlib before any training
        require_extra("matplotlib", what="merge-bench's analysis plots")
    cache = cache or out / "experts"
    data = [load_task(t, cfg) for t in tasks]
    base_model = build_base(cfg)
    base = {k: v.clone() for k, v in base_model.state_dict().items()}
    experts, heads = _experts(cfg, tasks, data, cache, log)
    individual = [_evaluate(base_model, e, [h], [d], "test")[0] for e, h, d in zip(experts, heads, data)]
    rows: dict[str, dict[str, Any]] = {
        "pretrained": {"hp": {}, "val": float(np.mean(_evaluate(base_model, base, heads, data, "val"))),
                       "test": _evaluate(base_model, base, heads, data, "test")},
        "individual": {"hp": {}, "test": individual}}
    curves: dict[str, list] = {}
    final_grids: dict[str, dict[str, Any]] = {}
    for method, space in grids.items():
        def val_of(hp: dict[str, Any], method: str = method) -> float:
            merged = merge(method, base=base, experts=experts, **hp)
            return float(np.mean(_evaluate(base_model, merged, heads, data, "val")))

        found = search(space, val_of, max_extensions=max_extensions)
        merged = merge(method, base=base, experts=experts, **found["best"])
        rows[method] = {"hp": found["best"], "val": found["best_score"],
                        "test": _evaluate(base_model, merged, heads, data, "test")}
        curves[method] = found["seen"]
        final_grids[method] = {"start": space, "final": found["grid"], "chosen_at": found["edges"],
                               "max_extensions": max_extensions}
        log(f"{method}: {found['best']} val {found['best_score']:.2f} ({found['edges']})")
    for r in rows.values():
        r["avg"] = float(np.mean(r["test"]))
        r["normalized"] = float(np.mean([a / max(i, 1e-9) for a, i in zip(r["test"], individual)])) * 100
    results = {"config": asdict(cfg), "tasks": [t.name for t in tasks], "rows": rows, "search": curves,
               "grids": final_grids}
    if analysis and "cart" in grids:
        from .merge_bench_analysis import analyse, write_plots

        log("analysis: rank-ratio curve, spectra, interference")
        mean_test = lambda p: float(np.mean(_evaluate(base_model, p, heads, data, "test")))  # noqa: E731
        results["analysis"] = analyse(base, experts, mean_test, rows)
        results["plots"] = write_plots(results["analysis"], rows, out)
    write_json(out / "results.json", results)
    atomic_write_text(out / "results.md", results_markdown(results))
    return results


def protocol_line(cfg: dict) -> str:
    """The results' sentence that names the head protocol of the config ``cfg`` (a dict of BenchConfig)."""
    if cfg.get("heads", "cotrained") == "frozen":
        init = {"probe": "a linear probe", "prototypes": "class prototypes"}[cfg.get("head_init", "probe")]
        return (f"Head protocol: **frozen** ({init} fitted on the pretrained backbone's features of each task's "
                "training split, then fixed; the experts trained only the backbone).")
    return "Head protocol: **co-trained** (each expert's head trained from scratch together with its backbone)."


def results_markdown(results: dict) -> str:
    """The results table: absolute test accuracy per task, average, normalized accuracy, chosen hyperparameters,
    then the final grids (where each chosen value ended up)."""
    tasks, cfg = results["tasks"], results["config"]
    seed = cfg["seed"] if cfg.get("train_seed") is None else cfg["train_seed"]
    lines = [protocol_line(cfg) + f" Fine-tuning seed {seed}.", "",
             "| method | " + " | ".join(tasks) + " | avg | normalized | hyperparameters (val-selected) |",
             "|" + "---|" * (len(tasks) + 4)]
    for name, r in results["rows"].items():
        cells = " | ".join(f"{a:.1f}" for a in r["test"])
        lines.append(f"| {ROW_LABELS.get(name, name)} | {cells} | {r['avg']:.1f} | {r['normalized']:.1f} | "
                     f"{r['hp'] or ''} |")
    if results.get("grids"):
        lines += ["", "Final grids (extended until the chosen value is interior; `domain-*`: at the edge of the "
                  "hyperparameter's range):", ""]
        for m, g in results["grids"].items():
            if g["final"]:
                lines.append(f"- {m}: {g['final']}; chosen value at {g['chosen_at']}")
    text = "\n".join(lines) + "\n"
    if "analysis" in results:
        from .merge_bench_analysis import analysis_markdown

        text += analysis_markdown(results["rows"], results["analysis"], results.get("plots", []))
    return text
