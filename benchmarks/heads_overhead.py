"""Overhead of the class-incremental heads: seconds per task and the statistics' memory.

Usage:
    python benchmarks/heads_overhead.py [--threads 1] [--ranpac-dim 2000] [--out benchmarks/heads_overhead.md]

On the shipped ``vit-tiny-fmnist`` backbone (frozen, so that only the heads cost anything) and the default
Split-MNIST-5k tasks, it runs the head suite's end-of-task hook with all four variants and records, per
task: the feature pass over the task's training data (shared by every feature-based head), the class
statistics, RanPAC's update + ridge solve, SLCA's alignment; then the evaluation time of each variant on the
seen tasks' test data; and the bytes each variant keeps.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from clmerge.config import parse_config
from clmerge.engine.heads import HeadSuite
from clmerge.engine.run import prepare

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ranpac-dim", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "heads_overhead.md")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = parse_config({"method": {"name": "finetune"}, "head": {"compare": True, "ranpac_dim": a.ranpac_dim}})
    scenario, model, _, _ = prepare(cfg)
    model.eval()
    suite = HeadSuite(cfg.head, seed=0, feature_dim=model.head.in_features)
    evals: dict[str, list[float]] = {v: [] for v in suite.variants}
    for t, task in enumerate(scenario.tasks):
        model.head.ensure_classes(task.offset + task.n_classes, generator=torch.Generator().manual_seed(t))
        suite.end_task(model, task, scenario.tasks[: t + 1], batch_size=500, device="cpu")
        n_out = task.offset + task.n_classes
        for v in suite.variants:
            clock = time.perf_counter()
            suite.evaluate(model, scenario.tasks[: t + 1], n_outputs=n_out, variants=[v], batch_size=500, device="cpu")
            evals[v].append(time.perf_counter() - clock)
    write(a, suite, evals, scenario)


def write(a, suite: HeadSuite, evals: dict[str, list[float]], scenario) -> None:
    sec = suite.seconds
    mib = {k: v / 2**20 for k, v in suite.nbytes().items()}
    n_cls = len(suite.stats.counts)
    means_mib = n_cls * suite.stats.dim * 8 / 2**20
    rows = [("feature pass over the task's training data (shared)", sec["features"]),
            ("class statistics (means + full covariances)", sec["stats"]),
            ("SLCA alignment (5 epochs, 256 pseudo-features per class)", sec["align"]),
            (f"RanPAC update + lambda search + solve (M={a.ranpac_dim})", sec["ranpac"])]
    rows += [(f"evaluation on the seen tasks' test data: {v}", evals[v]) for v in suite.variants]
    table = "\n".join(f"| {name} | {np.mean(s):.3f} | {' / '.join(f'{x:.2f}' for x in s)} |" for name, s in rows)
    text = f"""# Head overhead of the class-incremental heads

Command: `python benchmarks/heads_overhead.py --threads {a.threads} --ranpac-dim {a.ranpac_dim}` (frozen shipped
`vit-tiny-fmnist`, D = {suite.stats.dim}; default Split-MNIST-5k, {len(scenario)} tasks, {n_cls} classes;
{sum(len(t.train) for t in scenario.tasks)} training images).
Machine: {platform.machine()}, {os.cpu_count()} cores, {a.threads} thread(s); load average {os.getloadavg()[0]:.2f}
at the end (the machine is shared: absolute seconds are inflated by other jobs).

Seconds per task (mean, then task 1 / ... / task {len(scenario)}):

| part | mean s | per task |
|---|---|---|
{table}

Memory kept after the last task:

| what | MiB |
|---|---|
| class means only (all NCM needs) | {means_mib:.3f} |
| class means + full DxD covariances (alignment; grows with classes x D^2) | {mib['class_stats']:.3f} |
| RanPAC G (MxM) + Q + W_o, float64 (constant in the number of tasks; M^2) | {mib.get('ranpac', 0):.3f} |
| the aligned copy of the linear head | {mib.get('aligned_head', 0):.4f} |
"""
    a.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
