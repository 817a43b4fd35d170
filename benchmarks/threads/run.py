"""How much a method's result moves with the torch thread count: each method once at 1 and once at 2 threads
on the same protocol, and a Markdown table of the differences (docs/threads.md).

Usage:
    python benchmarks/threads/run.py [--methods sd_lora,seq_lora,...] [--seed 3] [--work runs/threads]
        [--out benchmarks/threads/results.md] [--set key=value ...]

Protocol: digits, class-incremental, 5 tasks, the shipped backbone, the linear head, every task trained
(``head.classifier=linear``, ``train.adapt_tasks=null``), each method's defaults otherwise; LoRA methods on
key and value (``method.targets=[key,value]``, the LoRA sites of the evidence grid); simplecil and ranpac, which
train nothing and have no linear head, with their own statistics head. Each run is a fresh
``clmerge run`` process with ``run.threads`` and ``OMP_NUM_THREADS`` equal; a run whose ``metrics.json`` exists
in ``--work`` is reused, so an interrupted table continues. Besides the accuracies, the table says whether
the two runs' logged training losses are bit-identical and, if not, the first step where they differ and
the largest relative difference of a step loss: what the thread count changes is the rounding of sums split
over threads, and these say how far the training amplifies it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = ["scenario.dataset=digits", "scenario.n_tasks=5", "head.classifier=linear", "train.adapt_tasks=null",
            "run.report=false", "run.progress=false"]
METHODS = ("sd_lora,seq_lora,pm,inflora,sd_lora_rr,sd_lora_kd,ewc,halrp,magmax,l2p,dualprompt,coda_prompt,"
           "hide_prompt,finetune,l2,gpm,stl,lora_avg,lora_dare,coma,cofima,simplecil,ranpac,er,der,derpp,slca")


def run_one(method: str, threads: int, seed: int, work: Path, extra: list[str]) -> Path:
    """Run (or reuse) ``method`` at ``threads`` threads; return its run directory."""
    out = work / f"{method}-t{threads}"
    if (out / "metrics.json").is_file():
        return out
    sets = [*PROTOCOL, f"method.name={method}", f"seed={seed}", f"run.threads={threads}", *extra]
    if not _method_class(method).trains_linear_head:  # simplecil, ranpac: their own statistics head
        sets.remove("head.classifier=linear")
    cmd = [sys.executable, "-m", "clmerge", "run", "--out", str(out), "--overwrite"]
    if _has_lora_targets(method):  # the LoRA sites of the evidence grid (a method's own default may differ)
        sets.append("method.targets=[key,value]")
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    return out


def _method_class(method: str):
    sys.path.insert(0, str(ROOT / "src"))
    from clmerge.methods import method_class

    return method_class(method)


def _has_lora_targets(method: str) -> bool:
    sys.path.insert(0, str(ROOT / "src"))
    from clmerge.methods import method_options_model

    return "targets" in method_options_model(method).model_fields


def step_losses(run: Path) -> list[float]:
    lines = (run / "events.jsonl").read_text().splitlines()
    return [e["loss"] for e in map(json.loads, lines) if e.get("event") == "step"]


def loss_divergence(a: list[float], b: list[float]) -> tuple[int | None, float]:
    """(first 1-based step whose losses differ, largest relative difference); (None, 0.0) when identical."""
    first = next((i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    rel = max((abs(x - y) / max(abs(x), abs(y), 1e-12) for x, y in zip(a, b)), default=0.0)
    return first, rel


def row(method: str, r1: Path, r2: Path) -> str:
    m1, m2 = (json.loads((r / "metrics.json").read_text()) for r in (r1, r2))
    cil, til = [m["acc"] for m in (m1, m2)], [m["til"]["acc"] for m in (m1, m2)]  # in %
    first, rel = loss_divergence(step_losses(r1), step_losses(r2))
    same = "yes" if first is None else f"no (step {first}; max {rel:.1e})"
    return (f"| {method} | {cil[0]:.1f} | {cil[1]:.1f} | {cil[1] - cil[0]:+.1f} | {til[0]:.1f} | {til[1]:.1f} | "
            f"{til[1] - til[0]:+.1f} | {same} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "threads")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "threads" / "results.md")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="another override, for every run")
    args = ap.parse_args(argv)
    rows = ["| method | CIL 1 thread | CIL 2 threads | diff | TIL 1 thread | TIL 2 threads | diff | "
            "losses bit-identical |", "|---|---|---|---|---|---|---|---|"]
    for method in args.methods.split(","):
        runs = [run_one(method, t, args.seed, args.work, args.extra) for t in (1, 2)]
        rows.append(row(method, *runs))
        print(rows[-1], flush=True)
    extra = "".join(f" --set {s}" for s in args.extra)
    text = (f"Digits, class-incremental, 5 tasks, seed {args.seed}, linear head, every task trained{extra}; "
            "accuracies in %.\n\n" + "\n".join(rows) + "\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
