"""Choose the frozen-head protocol's default head on VALIDATION data: linear probe or class prototypes.

For every task of a suite, fit both heads on the pretrained backbone's features of the task's training split
(exactly as ``clmerge merge-bench --heads frozen`` does) and report each head's validation accuracy with the
pretrained backbone. No expert is fine-tuned and no test data is read. Writes a JSON file and prints a table.

    python benchmarks/merging/head_init_probe.py --suite split8 --max-train 1700 --max-eval 500 \
        --out benchmarks/merging/head_init_split8.json
    python benchmarks/merging/head_init_probe.py --suite 8 --out benchmarks/merging/head_init_8.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from clmerge.harness.merge_bench import SUITES, BenchConfig, head_accuracy, build_base, load_task
from clmerge.harness.merge_bench_experts import fit_head, make_head
from clmerge.utils.io import write_json


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="8")
    ap.add_argument("--max-train", type=int, default=None)
    ap.add_argument("--max-eval", type=int, default=None)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = {}
    for init in ("probe", "prototypes"):
        cfg = BenchConfig(suite=a.suite, max_train=a.max_train, max_eval=a.max_eval, heads="frozen", head_init=init)
        model = build_base(cfg)
        accs = {}
        for t in SUITES[a.suite]:
            d = load_task(t, cfg)
            head = make_head(fit_head(cfg, model, *d["train"], int(d["train"][1].max()) + 1))
            accs[t.name] = head_accuracy(model, head, *d["val"])
        rows[init] = {"val": accs, "mean": float(np.mean(list(accs.values())))}
        print(f"{init}: mean val {rows[init]['mean']:.1f} " + " ".join(f"{v:.1f}" for v in accs.values()), flush=True)
    write_json(a.out, {"suite": a.suite, "max_train": a.max_train, "max_eval": a.max_eval, "heads": rows})


if __name__ == "__main__":
    main()
