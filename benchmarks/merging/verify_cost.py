"""What verification adds to a merge's wall time: ``clmerge merge`` with and without the verifier, alternated.

Models: the llm_scale set (``llm_models.py``: TinyLlama-1.1B widths, bf16, sharded, base + 3 variants), made
under ``--data`` with ``--layers`` decoder layers (8: the 478M set; 22: the 1.1B set). Each run is one child
process (``python -c`` running clmerge's command line ``merge --method task_arithmetic ...``: start-up, merge,
verification, move into place); "off" runs the same command with ``OutputFolder.verify`` and the warm-up replaced by no-ops (what a
merge cost before the verifier); "on_cold" verifies with an empty cache (transformers imported in the
background and asked for its loading info: the first merge of such inputs on a machine); "on_warm" with
transformers' answer for these tensors cached by an earlier merge (a re-merge of the same models with other
weights or another method: nothing of transformers is imported). The order of the modes rotates, so a change
of the machine's load hits each. The page cache is warmed before each run (every input read once). Recorded per run: wall seconds, CPU seconds of
the child (user + system), the in-process verification seconds (its log line) and the load average before.

```bash
nice -n 10 env PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/python benchmarks/merging/verify_cost.py \
    --data /work/evidence/verify/llm8 --layers 8 --reps 3 --json verify_cost.json
```
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from llm_models import make_models, model_dirs  # noqa: E402

OFF = ("import sys; import clmerge.merging.io.output as o; o.OutputFolder.verify = lambda self: None; "
       "o._warm_verifier = lambda inputs, **kw: None; from clmerge.cli import main; sys.argv[0] = 'clmerge'; main()")
ON = "import sys; from clmerge.cli import main; sys.argv[0] = 'clmerge'; main()"


def warm(dirs: list[Path]) -> None:
    for d in dirs:
        for f in sorted(d.glob("*.safetensors")):
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass


def run(mode: str, args: argparse.Namespace, out: Path) -> dict:
    base, experts = model_dirs(args.data)
    argv = [sys.executable, "-c", OFF if mode == "off" else ON, "merge", "--method", "task_arithmetic",
            "--base", str(base), *[a for e in experts for a in ("--expert", str(e))], "--set", "scaling=0.3",
            "--out", str(out), "--threads", str(args.threads), "--no-hash-inputs"]
    warm([base, *experts])
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if mode == "on_cold":  # an empty cache: transformers is imported and asked (the first merge of these inputs)
        import tempfile

        env["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="verify-cold-", dir=args.data)
    elif mode == "on_warm":  # transformers' answer for these tensors cached by an earlier merge
        env["XDG_CACHE_HOME"] = str(args.data / "verify-warm-cache")
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    stderr = res.stderr
    if res.returncode:
        raise SystemExit(f"{mode}: exit {res.returncode}\n{stderr[-2000:]}")
    verify_s = None
    for line in stderr.splitlines():
        if "verification passed" in line:
            verify_s = float(line.rsplit("(", 1)[1].split(" s)")[0])
    import shutil

    shutil.rmtree(out)
    return {"mode": mode, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "verify_s": verify_s,
            "load_before": round(load, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    make_models(args.data, layers=args.layers)
    rows = []
    modes = ("off", "on_cold", "on_warm")
    run("on_warm", args, args.data / "out_prime")  # fills the warm cache; not counted
    for i in range(args.reps):
        for mode in modes[i % 3:] + modes[:i % 3]:  # the order rotates, so a change of load hits every mode
            rows.append(run(mode, args, args.data / f"out_{mode}"))
            print(json.dumps(rows[-1]), flush=True)
            if args.json:  # the rows so far, so a run cut short still leaves its finished repetitions
                args.json.write_text(json.dumps({"layers": args.layers, "threads": args.threads, "rows": rows,
                                                 "partial": True}, indent=2) + "\n")
    summary = {}
    for mode in modes:
        walls = [r["wall_s"] for r in rows if r["mode"] == mode]
        cpus = [r["cpu_s"] for r in rows if r["mode"] == mode]
        summary[mode] = {"median_wall_s": statistics.median(walls), "min_wall_s": min(walls), "walls": walls,
                         "median_cpu_s": statistics.median(cpus), "min_cpu_s": min(cpus), "max_cpu_s": max(cpus),
                         "cpus": cpus}
    for mode in modes[1:]:
        off = summary["off"]
        summary[mode]["verify_s"] = [r["verify_s"] for r in rows if r["mode"] == mode]
        summary[mode]["overhead_wall_median"] = summary[mode]["median_wall_s"] / off["median_wall_s"] - 1
        summary[mode]["overhead_wall_min"] = summary[mode]["min_wall_s"] / off["min_wall_s"] - 1
        summary[mode]["overhead_cpu_median"] = summary[mode]["median_cpu_s"] / off["median_cpu_s"] - 1
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps({"layers": args.layers, "threads": args.threads, "rows": rows,
                                         "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
