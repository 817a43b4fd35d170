"""Why OPCM trails running averaging on a suite: the norms of the merged task vectors.

OPCM rescales its merged task vector to the mean task-vector norm; running averaging's merged task vector is
the mean task vector, whose norm is smaller when the task vectors are nearly orthogonal. This script reads a
one-seed ``merge-bench --continual`` run (its ``continual.json`` config and cached experts; it never trains)
and writes the task-vector norms, their pairwise cosines, both merged norms, and the test accuracy of OPCM's final merge as it is and rescaled to running averaging's
norm (a diagnostic on test data: nothing here is selected on it):

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/merging/continual_norms.py --run DIR \
        --out benchmarks/merging/continual_suite8/norms.json
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from clmerge.harness.merge_bench import SUITES, BenchConfig, expert_path, head_accuracy
from clmerge.harness.merge_bench_continual import load_bench, make_merger
from clmerge.utils.io import read_json, write_json


def tv_norm(params: dict, base: dict, keys: list[str]) -> float:
    return math.sqrt(sum(float((params[k].double() - base[k].double()).pow(2).sum()) for k in keys))


def cosines(experts: list[dict], base: dict, keys: list[str]) -> list[float]:
    flat = torch.stack([torch.cat([(e[k].double() - base[k].double()).flatten() for k in keys]) for e in experts])
    n = flat.norm(dim=1)
    cos = (flat @ flat.T) / (n[:, None] * n[None])
    return [float(c) for c in cos[~torch.eye(len(n), dtype=torch.bool)]]


def mean_accuracy(bench: dict, params: dict) -> float:
    bench["model"].load_state_dict(params)
    accs = [head_accuracy(bench["model"], h, *d["test"]) for h, d in zip(bench["heads"], bench["data"])]
    return sum(accs) / len(accs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, required=True, help="a one-seed merge-bench --continual output folder")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    cfg = BenchConfig(**read_json(a.run / "continual.json")["config"])
    missing = [t.name for t in SUITES[cfg.suite] if not expert_path(a.run / "experts", t, cfg).exists()]
    if missing:
        raise SystemExit(f"error: {a.run / 'experts'}: no cached expert for {', '.join(missing)} "
                         "(this script never trains)")
    bench = load_bench(cfg, a.run / "experts", log=lambda *_: None)
    opcm, avg = make_merger("opcm", bench["base"]), make_merger("running_average", bench["base"])
    for e in bench["experts"]:
        m_opcm, m_avg = opcm.add(e), avg.add(e)
    base, keys = bench["base"], opcm.keys
    c = tv_norm(m_avg, base, keys) / tv_norm(m_opcm, base, keys)
    rescaled = {k: (base[k] + c * (v - base[k])) if k in keys else v for k, v in m_opcm.items()}
    cos = cosines(bench["experts"], base, keys)
    write_json(a.out, {
        "task_vector_norms": [tv_norm(e, base, keys) for e in bench["experts"]],
        "pairwise_cosine": {"mean": sum(cos) / len(cos), "min": min(cos), "max": max(cos)},
        "merged_norm": {"opcm": tv_norm(m_opcm, base, keys), "running_average": tv_norm(m_avg, base, keys)},
        "test_mean_accuracy": {"opcm": mean_accuracy(bench, m_opcm), "running_average": mean_accuracy(bench, m_avg),
                               "opcm_rescaled_to_running_average_norm": mean_accuracy(bench, rescaled)}})


if __name__ == "__main__":
    main()
