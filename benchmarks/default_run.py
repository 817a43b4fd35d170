"""Time the default experiment (`clmerge run` with no arguments) end to end and record its metrics.

Usage:
    python benchmarks/default_run.py [--repeats 3] [--threads 2] [--out benchmarks/default_run.md]

Each repeat runs `clmerge run --out <tmp>` in a fresh process (interpreter start, imports, data loading,
training, evaluation, report) and measures wall time and the child's peak RSS. The machine's load average is
recorded next to the figures, because a loaded 2-core machine inflates them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_once(threads: int) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
        cmd = [sys.executable, "-m", "clmerge.cli", "run", "--out", str(out), "--set", "run.progress=false",
               "--set", f"run.threads={threads}"]
        t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
        metrics = json.loads((out / "metrics.json").read_text())
        # CPU seconds of the run: on a loaded shared machine they say more than the wall time (with one
        # thread, the wall time on an idle machine is about this)
        metrics["_cpu_s"] = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        return wall, metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "default_run.md")
    args = ap.parse_args()
    load_before = os.getloadavg()
    walls, metrics, cpus = [], None, []
    for i in range(args.repeats):
        wall, metrics = run_once(args.threads)
        walls.append(wall)
        cpus.append(metrics.pop("_cpu_s"))
        print(f"repeat {i + 1}: {wall:.1f} s, Acc {metrics['acc']:.2f}", flush=True)
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    write_markdown(args, walls, metrics, peak_mb, load_before, os.getloadavg(), cpus)


def _head_cost(m: dict) -> str:
    """Bytes kept by the head and its mean end-of-task seconds per part (features, statistics, solve)."""
    head = m.get("head") or {}
    mem = sum((head.get("stats_bytes") or {}).values())
    parts = {k: sum(v) / len(v) for k, v in (head.get("seconds_per_task") or {}).items() if v}
    secs = ", ".join(f"{k} {v:.2f} s" for k, v in parts.items()) or "none"
    return f"{mem / 2**20:.1f} MiB; {secs}"


def write_markdown(args, walls: list[float], m: dict, peak_mb: float, load_before, load_after,
                   cpus: list[float]) -> None:
    til = m.get("til") or {}
    rows = "\n".join(
        f"| task {i} | " + " | ".join("" if v is None else f"{v:.1f}" for v in row) + " |"
        for i, row in enumerate(m["accuracy_matrix"])
    )
    header = "| after | " + " | ".join(f"T{j}" for j in range(len(m["accuracy_matrix"]))) + " |"
    sep = "|---" * (len(m["accuracy_matrix"]) + 1) + "|"
    text = f"""# Default run: `clmerge run` with no arguments

Command: `python benchmarks/default_run.py --repeats {args.repeats} --threads {args.threads}`
(each repeat is a fresh `clmerge run` process: imports, data, training, evaluation, report).

Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()};
load average before/after: {load_before[0]:.2f} / {load_after[0]:.2f}. On a loaded shared machine the wall
time is inflated by other jobs; with one thread, the CPU time is about what the run takes on an idle one.

| figure | value |
|---|---|
| wall time, median of {len(walls)} (min-max) | **{statistics.median(walls):.1f} s** ({min(walls):.1f}-{max(walls):.1f}) |
| CPU time (user + sys) of a run, median | {statistics.median(cpus):.1f} s |
| peak RSS of a run | {peak_mb:.0f} MB |
| method / head / scenario | {m['method']} / {(m.get('head') or {}).get('variant', 'linear')} / {m['scenario']} on {m['dataset']}, {len(m['accuracy_matrix'])} tasks |
| head statistics (memory; seconds per task) | {_head_cost(m)} |
| Acc (task-weighted) | {m['acc']:.2f} |
| AAA | {m['aaa']:.2f} |
| average forgetting | {m['forgetting']:.2f} |
| BWT | {m['bwt']:.2f} |
| TIL Acc / AAA (task id known) | {til.get('acc', float('nan')):.2f} / {til.get('aaa', float('nan')):.2f} |

Accuracy matrix (%, class-incremental, from the head above; row i = after task i):

{header}
{sep}
{rows}
"""
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
