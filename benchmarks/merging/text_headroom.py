"""Headroom of the text6 suite: frozen-probe vs fine-tuned expert validation accuracy per task.

Trains the experts of the chosen text6 tasks at the chosen learning rates with the merge-bench defaults
(frozen linear-probe heads, 5 epochs, batch 64, the suite's caps) on the real MiniLM and WordNet, and writes
per task the probe's and each expert's validation accuracy and the seconds per expert:

    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/merging/text_headroom.py --tasks 0,1 --lrs 1e-4,5e-5 \
        --out benchmarks/merging/text_headroom.json
    python benchmarks/merging/text_headroom.py --report benchmarks/merging/text_headroom.json  # the markdown table
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from clmerge.harness.merge_bench import SUITES, BenchConfig, load_task
from clmerge.harness.merge_bench_data import SUITE_CAPS, TEXT6_GROUPS
from clmerge.harness.merge_bench_experts import init_expert, loss_and_accuracy, make_head, split_expert, train_expert


def val_accuracy(backbone, head, data) -> float:
    x, y = data["val"]
    return 100.0 * loss_and_accuracy(backbone, head, x, y)[1] / len(y)


def markdown(rows: list[dict]) -> str:
    """The rows as a table, then the mean gain per learning rate."""
    group = {t.name: g for t, g in zip(SUITES["text6"], TEXT6_GROUPS)}
    lines = ["| task (classes) | lr | probe val | expert val | gain | s / expert |", "|---|---|---|---|---|---|"]
    for r in rows:
        n = len(TEXT6_GROUPS[group[r["task"]]])
        lines.append(f"| {group[r['task']]} ({n}) | {r['lr']:g} | {r['probe_val']:.1f} | {r['expert_val']:.1f} | "
                     f"{r['gain']:+.1f} | {r['seconds']:.0f} |")
    lines.append("")
    for lr in sorted({r["lr"] for r in rows}, reverse=True):
        gains = [r["gain"] for r in rows if r["lr"] == lr]
        lines.append(f"- mean gain at lr {lr:g}: {sum(gains) / len(gains):+.1f} points over {len(gains)} tasks")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default="0,1", help="indices into SUITES['text6']")
    ap.add_argument("--lrs", default="1e-4,5e-5")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("text_headroom.json"))
    ap.add_argument("--report", type=Path, nargs="*", help="print the table of these result files and stop")
    args = ap.parse_args()
    if args.report:
        print(markdown([r for f in args.report for r in json.loads(f.read_text())]), end="")
        return
    torch.set_num_threads(1)
    max_train, max_eval = SUITE_CAPS["text6"]
    rows = []
    for i in (int(t) for t in args.tasks.split(",")):
        task = SUITES["text6"][i]
        for lr in (float(v) for v in args.lrs.split(",")):
            cfg = BenchConfig(suite="text6", backbone="minilm-l6", heads="frozen", epochs=args.epochs, lr=lr,
                              max_train=max_train, max_eval=max_eval)
            data = load_task(task, cfg)
            backbone, head = init_expert(cfg, int(data["train"][1].max()) + 1, data)
            probe = val_accuracy(backbone, head, data)
            t0 = time.perf_counter()
            bb, hd = split_expert(train_expert(cfg, data))
            seconds = time.perf_counter() - t0
            backbone.load_state_dict(bb)
            expert = val_accuracy(backbone, make_head(hd), data)
            rows.append({"task": task.name, "lr": lr, "n_train": len(data["train"][1]), "n_val": len(data["val"][1]),
                         "probe_val": probe, "expert_val": expert, "gain": expert - probe, "seconds": seconds})
            print(json.dumps(rows[-1]), flush=True)
            args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
