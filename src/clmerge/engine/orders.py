"""Order robustness for any method: the same config over N task orders (HALRP, Li et al., TKDE 2024, Sec. 5.3).

``run_orders`` runs the config once per order into ``OUT/order_<r>/`` (each an ordinary run directory, resumable),
identifies tasks by content (``Task.key``), and writes ``OUT/orders_summary.json`` (OPD per task, MOPD, AOPD,
Acc and BWT per order and their mean), ``OUT/orders_summary.md`` and ``OUT/orders_report.html`` (per-order
accuracy curves). Orders: the config's ``scenario.task_orders`` first (a benchmark's listed orders), then order
0 = the natural order if none is listed, and seeded permutations ``RandomState(seed).permutation(T)`` beyond
(seed = 0, 1, ..., skipping orders already chosen).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..config import ExperimentConfig, dump_config, parse_config
from ..metrics import order_robustness
from ..utils.io import atomic_write_text, read_json, write_json
from ..utils.yaml_io import load_yaml

__all__ = ["task_orders", "run_orders", "summarize_orders"]


def task_orders(cfg: ExperimentConfig, n: int) -> list[list[int]]:
    """The first ``n`` task orders for ``cfg`` (listed orders, else identity then seeded permutations)."""
    if n < 1:
        raise ValueError(f"--orders must be at least 1, got {n}")
    T = cfg.scenario.n_tasks
    if n > math.factorial(T):
        raise ValueError(f"--orders {n}: {T} tasks have only {math.factorial(T)} distinct orders")
    listed = [list(o) for o in (cfg.scenario.task_orders or [])]
    out: list[list[int]] = []
    seed = 0
    for r in range(n):
        if r < len(listed):
            out.append(listed[r])
            continue
        order = list(range(T)) if r == 0 else np.random.RandomState(seed).permutation(T).tolist()
        while order in out:  # skip seeds that repeat an order already chosen
            seed += 1
            order = np.random.RandomState(seed).permutation(T).tolist()
        out.append(order)
    return out


def _with_order(cfg: ExperimentConfig, order: list[int]) -> ExperimentConfig:
    data = load_yaml(dump_config(cfg), source="the resolved config")
    data["scenario"]["task_order"] = list(order)
    return parse_config(data)


def summarize_orders(metrics_by_order: list[dict], orders: list[list[int]]) -> dict:
    """OPD/MOPD/AOPD (Eq. 14 of HALRP, from APD) next to Acc and BWT, from each order's ``metrics.json``."""
    finals = [{k: float(m["accuracy_matrix"][-1][j]) for j, k in enumerate(m["task_keys"])} for m in metrics_by_order]
    accs = [m.get("acc") for m in metrics_by_order]
    bwts = [m.get("bwt") for m in metrics_by_order]
    out = {
        "method": metrics_by_order[0].get("method"), "dataset": metrics_by_order[0].get("dataset"),
        "orders": orders, "final_acc_by_order": finals, "acc_per_order": accs, "bwt_per_order": bwts,
        "acc": float(np.mean(accs)),
        "acc_se": float(np.std(accs, ddof=1) / np.sqrt(len(accs))) if len(accs) > 1 else None,
        "bwt": float(np.mean([b for b in bwts if b is not None])) if any(b is not None for b in bwts) else None,
        "accuracy_curves": {f"order {r}": m.get("accuracy_curve") for r, m in enumerate(metrics_by_order)},
        "opd": None, "mopd": None, "aopd": None,
    }
    if len(metrics_by_order) > 1:
        out.update(order_robustness(finals))
    return out


def _markdown(summary: dict) -> str:
    fmt = lambda v: "—" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [f"# Order robustness: {summary['method']} on {summary['dataset']}", "",
             f"Acc {fmt(summary['acc'])} · BWT {fmt(summary['bwt'])} · MOPD {fmt(summary['mopd'])} · "
             f"AOPD {fmt(summary['aopd'])}", "", "| order | tasks | Acc | BWT |", "|---|---|---|---|"]
    for r, order in enumerate(summary["orders"]):
        lines.append(f"| {r} | {order} | {fmt(summary['acc_per_order'][r])} | {fmt(summary['bwt_per_order'][r])} |")
    if summary["opd"]:
        lines += ["", "| task (content key) | OPD | final acc per order |", "|---|---|---|"]
        for key, v in summary["opd"].items():
            per = ", ".join(fmt(d[key]) for d in summary["final_acc_by_order"])
            lines.append(f"| {key} | {fmt(v)} | {per} |")
    return "\n".join(lines) + "\n"


def run_orders(cfg: ExperimentConfig, out_dir: str | Path, n: int, *, resume: bool = False) -> dict:
    """Run ``cfg`` over ``n`` task orders into sub-run directories and write the order-robustness summary."""
    out = Path(out_dir)
    if resume and not any((out / f"order_{r}").is_dir() for r in range(n)):
        from .resume import check_resumable

        check_resumable(out / "order_0")  # refuses: a mistyped --out never starts fresh order runs
    from ..report.html import build_sweep_report
    from .run import run_experiment

    from . import distributed

    dp = distributed.setup(cfg.run.device)
    orders = task_orders(cfg, n)
    metrics = []
    for r, order in enumerate(orders):
        sub = out / f"order_{r}"
        # data parallel: process 0's view of the directory decides for every process
        state = [(sub / "metrics.json").exists(), (sub / "config.yaml").exists()]
        done, started = distributed.broadcast_json(dp, state) if dp is not None else state
        if done:
            metrics.append(read_json(sub / "metrics.json", within=out) if distributed.is_main() else {})
            continue
        metrics.append(run_experiment(_with_order(cfg, order), sub, resume=resume and started))
    if not distributed.is_main():
        return {}
    summary = summarize_orders(metrics, orders)
    write_json(out / "orders_summary.json", summary)
    atomic_write_text(out / "orders_summary.md", _markdown(summary))
    title = (f"clmerge orders: {summary['method']} on {summary['dataset']} — MOPD "
             f"{summary['mopd'] if summary['mopd'] is None else round(summary['mopd'], 2)}, AOPD "
             f"{summary['aopd'] if summary['aopd'] is None else round(summary['aopd'], 2)}")
    build_sweep_report(out / "orders_report.html", {f"order {r}": m for r, m in enumerate(metrics)}, title=title)
    return summary
