"""Why the SVD merges do (or do not) beat task arithmetic on a merge-bench suite: two measurements of the
task vectors of the cached experts, per weight matrix, averaged over matrices.

- **energy at TSV-M's budget**: the share of each task matrix's squared Frobenius norm held by its top
  ``k = ceil(r / T)`` singular values (``r = min(m, n)``, ``T`` tasks), the part TSV-M keeps (Gargiulo et al.
  2025, Sec. 3: each task gets 1/T of the rank). Near 1: truncation loses little; low: TSV-M discards most of
  every task's update before it merges.
- **subspace overlap**: for each pair of tasks, ``||U_i^T U_j||_F^2 / k`` of their top-k left singular vectors
  (1: the same subspace, ``k / m`` expected for random subspaces). TSV-M and Iso-CTS gain over task arithmetic
  by removing the interference of overlapping subspaces; tasks that already occupy near-orthogonal subspaces
  leave them little to remove.

Reads the experts from ``OUT/experts`` (trained by ``clmerge merge-bench --suite S --seeds ... --out OUT``; an
expert missing from the cache is an error: nothing is trained). Writes JSON to ``--json``.

    python benchmarks/merging/svd_why.py --out /work/runs/suite8_svd --suite 8 --seed 0 --json why_8.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from clmerge.harness.merge_bench import SUITES, BenchConfig
from clmerge.harness.merge_bench_experts import expert_path
from clmerge.harness.merge_bench_continual import load_bench
from clmerge.harness.merge_bench_data import SUITE_CAPS
from clmerge.merging.methods.lowrank import is_lowrank_param


def measure(base: dict, experts: list[dict]) -> dict:
    """Energy at rank ceil(r/T) and mean pairwise top-k subspace overlap, per matrix and averaged."""
    T = len(experts)
    per_key = {}
    for key, b in base.items():
        if not is_lowrank_param(key, tuple(b.shape)):
            continue
        r = min(b.shape)
        k = max(1, math.ceil(r / T))
        us, energy = [], []
        for e in experts:
            d = (e[key] - b).double()
            u, s, _ = torch.linalg.svd(d, full_matrices=False)
            tot = float((s**2).sum())
            energy.append(float((s[:k] ** 2).sum()) / tot if tot > 0 else float("nan"))
            us.append(u[:, :k])
        overlaps = [float((us[i].T @ us[j]).pow(2).sum()) / k for i in range(T) for j in range(i + 1, T)]
        per_key[key] = {"rank": r, "k": k, "energy_at_k": sum(energy) / T, "overlap": sum(overlaps) / len(overlaps),
                        "random_overlap": k / b.shape[0]}
    keys = list(per_key)
    mean = lambda f: sum(per_key[x][f] for x in keys) / len(keys)  # noqa: E731
    return {"tasks": T, "matrices": len(keys), "energy_at_k": mean("energy_at_k"), "overlap": mean("overlap"),
            "random_overlap": mean("random_overlap"), "per_key": per_key}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the merge-bench output folder (its experts/ cache)")
    ap.add_argument("--suite", default="8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-train", type=int, default=None)
    ap.add_argument("--max-eval", type=int, default=None)
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args()
    cap_train, cap_eval = SUITE_CAPS.get(a.suite, (None, None))
    backbone = "minilm-l6" if a.suite.startswith("text") else "vit-tiny-fmnist"
    cfg = BenchConfig(suite=a.suite, backbone=backbone, epochs=5, lr=1e-4,
                      max_train=cap_train if a.max_train is None else a.max_train,
                      max_eval=cap_eval if a.max_eval is None else a.max_eval, pretrained=True, arch={},
                      heads="frozen", head_init="probe", train_seed=a.seed, data_options={})
    missing = [t.name for t in SUITES[a.suite] if not expert_path(a.out / "experts", t, cfg).exists()]
    if missing:  # this tool measures; it does not fine-tune
        raise SystemExit(f"svd_why.py: error: no cached expert in {a.out / 'experts'} for {', '.join(missing)} "
                         f"(suite {a.suite}, seed {a.seed}); run merge-bench with the same options first")
    bench = load_bench(cfg, a.out / "experts", log=lambda *_: None)
    res = {"suite": a.suite, "seed": a.seed, **measure(bench["base"], bench["experts"])}
    a.json.write_text(json.dumps(res, indent=1))
    print(f"suite {a.suite} seed {a.seed}: {res['matrices']} matrices, energy at k=ceil(r/T) {res['energy_at_k']:.3f}, "
          f"top-k overlap {res['overlap']:.3f} (random {res['random_overlap']:.3f})")


if __name__ == "__main__":
    main()
