"""Why do merges of the benchmark's experts fall so far below the experts? A weight-space diagnosis.

For the cached experts of a ``clmerge merge-bench`` suite, on the VALIDATION split:
- the size of each task vector relative to the pretrained weights, ||tau_t|| / ||theta_0||;
- the pairwise cosine similarity of the task vectors;
- accuracy of theta_0 + a * tau_t on task t (with expert t's head) for a in {0, 0.25, 0.5, 0.75, 1}: whether
  the expert's gain survives scaling its task vector down, as every merge (averaging scales it by 1/N) does;
- accuracy on task t of theta_0 + tau_t + tau_s for every other s (adding one other task vector), the
  pairwise interference of task arithmetic.

    python benchmarks/merging/diagnose.py --suite 8 --out benchmarks/merging/diagnosis_8.json
    python benchmarks/merging/diagnose.py --suite split8 --max-train 1700 --max-eval 500 \
        --out benchmarks/merging/diagnosis_split8.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from clmerge.harness.merge_bench import SUITES, BenchConfig, head_accuracy, build_base, expert_for_task, load_task

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="8")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max-train", type=int, default=None)
    ap.add_argument("--max-eval", type=int, default=None)
    ap.add_argument("--heads", default="cotrained", help="head protocol of the experts: cotrained (the committed "
                    "diagnosis files) or frozen")
    ap.add_argument("--head-init", default="probe")
    ap.add_argument("--cache", type=Path, default=HERE / "experts")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = BenchConfig(suite=a.suite, epochs=a.epochs, lr=a.lr, max_train=a.max_train, max_eval=a.max_eval,
                      heads=a.heads, head_init=a.head_init)
    tasks = SUITES[a.suite]
    model = build_base(cfg)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    keys = [k for k, v in base.items() if v.is_floating_point()]
    data, taus, heads = [], [], []
    for t in tasks:
        d = load_task(t, cfg)
        bp, hp = expert_for_task(t, cfg, d, a.cache)  # trains the expert if it is not cached
        head = nn.Linear(model.feature_dim, hp["weight"].shape[0])
        head.load_state_dict(hp)
        data.append(d)
        heads.append(head)
        taus.append({k: bp[k] - base[k] for k in keys})
    flat = lambda sd: torch.cat([sd[k].flatten().double() for k in keys])  # noqa: E731
    base_norm = float(flat(base).norm())
    vecs = [flat(t) for t in taus]
    rel = [float(v.norm()) / base_norm for v in vecs]
    cos = [[float(u @ v / (u.norm() * v.norm())) for v in vecs] for u in vecs]

    def acc(params: dict, i: int) -> float:
        model.load_state_dict(params)
        return head_accuracy(model, heads[i], *data[i]["val"])

    scales = [0.0, 0.25, 0.5, 0.75, 1.0]
    scaled = [[acc({**base, **{k: base[k] + s * taus[i][k] for k in keys}}, i) for s in scales]
              for i in range(len(tasks))]
    pair = [[acc({**base, **{k: base[k] + taus[i][k] + taus[j][k] for k in keys}}, i) if j != i else None
             for j in range(len(tasks))] for i in range(len(tasks))]
    res = {"suite": a.suite, "tasks": [t.name for t in tasks], "relative_norm": rel, "cosine": cos,
           "scales": scales, "acc_scaled_own_vector": scaled, "acc_own_plus_other": pair}
    a.out.write_text(json.dumps(res, indent=1))
    off = [cos[i][j] for i in range(len(tasks)) for j in range(len(tasks)) if i != j]
    print(f"suite {a.suite}: ||tau||/||theta0|| {np.round(rel, 3).tolist()}")
    print(f"pairwise cosine: mean {np.mean(off):.3f}, max {np.max(off):.3f}")
    for t, row in zip(tasks, scaled):
        other = [v for v in pair[tasks.index(t)] if v is not None]
        print(f"{t.name}: acc at a*tau, a={scales}: {np.round(row, 1).tolist()}; "
              f"+ one other tau: mean {np.mean(other):.1f} (min {np.min(other):.1f})")


if __name__ == "__main__":
    main()
