"""Choose the merging benchmark's expert fine-tuning settings on VALIDATION data.

The experts of ``clmerge merge-bench`` fine-tune the whole shipped ViT. This probe trains experts for a few
tasks of the suite at several learning rates and records validation accuracy after every epoch, so the
benchmark's learning rate and epoch count are chosen on held-out validation data, never on test.

    python benchmarks/merging/lr_probe.py --tasks mnist5k:rot90,digits:invert --lrs 1e-4,3e-4,1e-3 \
        --epochs 10 --out benchmarks/merging/lr_probe.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from clmerge.harness.merge_bench import (BenchConfig, head_accuracy, index_batches, init_expert, load_task,
                                          make_optimizer, parse_task)


def probe(task: str, lr: float, epochs: int, max_train: int | None) -> dict:
    cfg = BenchConfig(lr=lr, epochs=1, max_train=max_train)
    data = load_task(parse_task(task), cfg)
    x, y = data["train"]
    backbone, head = init_expert(cfg, int(y.max()) + 1)
    opt = make_optimizer(cfg, list(backbone.parameters()) + list(head.parameters()))
    g = torch.Generator().manual_seed(cfg.seed)
    curve, t0 = [], time.perf_counter()
    for ep in range(epochs):
        backbone.train()
        for idx in index_batches(len(x), replace(cfg, epochs=1), g):
            loss = F.cross_entropy(head(backbone(x[idx])), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        backbone.eval()
        curve.append(head_accuracy(backbone, head, *data["val"]))
        print(f"{task} lr={lr:g} epoch {ep + 1}: val {curve[-1]:.1f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return {"task": task, "lr": lr, "n_train": len(x), "n_val": len(data["val"][0]), "val_by_epoch": curve,
            "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="mnist5k:rot90,digits:invert")
    ap.add_argument("--lrs", default="1e-4,3e-4,1e-3")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--max-train", type=int, default=None)
    ap.add_argument("--out", default="benchmarks/merging/lr_probe.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = [probe(t, float(lr), a.epochs, a.max_train) for t in a.tasks.split(",") for lr in a.lrs.split(",")]
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
