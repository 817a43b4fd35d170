"""The cost of the continual-learning baselines of recent papers against seq_lora; writes cl_baselines_cost.md.

The cells are benchmarks/throughput.py's (forked process per cell, task 1 with its end-of-task work, then the
median of the timed task-2 steps, CPU time per step on a CPU, ratios paired within a round) on the tiny ViT
suite in fp32, with ``--inference-reps``: task 2 then runs to its end and each cell adds the parameters its step
trains, the state the method keeps (replay buffer, prototypes, covariances, adapters: the method's state and
the head suite's statistics, plus the inference model's weights beyond seq_lora's) and the time per evaluated
test batch of the classifier a run reports (EASE: one backbone pass per subspace; MOS: retrieval and ensemble).

    PYTHONPATH=src OMP_NUM_THREADS=1 nice -n 10 python benchmarks/cl_baselines_cost.py           # ~20 min
    PYTHONPATH=src python benchmarks/cl_baselines_cost.py --quick --methods er,simplecil           # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import throughput  # noqa: E402

SUITE, BASE = "vit-tiny-fmnist", "seq_lora"
MB = 1e6


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=",".join(throughput.CL_BASELINES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--inference-reps", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="smoke: 1 round, 1+2 steps, 1 inference pass")
    ap.add_argument("--out", type=Path, default=HERE / "cl_baselines_cost.md")
    ap.add_argument("--report-only", action="store_true", help="rebuild OUT from its JSON")
    return ap.parse_args(argv)


def throughput_args(c) -> list[str]:
    """The throughput.py arguments of this run (seq_lora always runs: it is the baseline of every ratio)."""
    methods = [BASE] + [m for m in c.methods.split(",") if m and m != BASE]
    reps = 1 if c.quick else c.inference_reps
    args = ["--methods", ",".join(methods), "--precisions", "fp32", "--suites", SUITE, "--rounds", str(c.rounds),
            "--warmup", str(c.warmup), "--steps", str(c.steps), "--inference-reps", str(reps),
            "--out", str(c.out), "--json", str(c.out.with_suffix(".json"))]
    return args + (["--quick"] if c.quick else [])


def _paired(cells: list[dict], base: dict, key: str) -> list[float]:
    return [c[key] / base[c["round"]][key] for c in cells if c["round"] in base and c.get(key) is not None
            and base[c["round"]].get(key)]


def _extra_bytes(c: dict, base_model: float) -> float:
    return c["method_state_bytes"] + c["head_state_bytes"] + max(0.0, c["model_bytes"] - base_model)


def summarize(data: dict) -> dict:
    """{method: row}: medians over rounds, and ratios to seq_lora paired within a round (step: CPU time)."""
    key = "cpu_step_s" if data["machine"]["device"] == "cpu" else "step_s"
    by: dict[str, list[dict]] = defaultdict(list)
    for c in data["cells"]:
        if "error" not in c:
            c = {**c, "step": c.get(key)}
            by[c["method"]].append(c)
    base = {c["round"]: c for c in by.get(BASE, [])}
    base_model = statistics.median(c["model_bytes"] for c in base.values()) if base else 0.0
    rows = {}
    for m, cells in by.items():
        med = lambda k: statistics.median(c[k] for c in cells)  # noqa: E731
        steps = _paired([c for c in cells if c["step"] is not None], base, "step")
        rows[m] = {"kind": cells[0]["kind"], "n": len(cells), "timed_task": cells[0].get("timed_task", 2), "trainable": med("trainable"),
                   "extra_mb": statistics.median(_extra_bytes(c, base_model) for c in cells) / MB,
                   "buffer_mb": med("method_state_bytes") / MB, "heads_mb": med("head_state_bytes") / MB,
                   "peak_mib": med("peak_bytes") / 2**20, "infer_ms": med("infer_batch_s") * 1e3,
                   "step_ms": (statistics.median(c["step"] for c in cells if c["step"] is not None) * 1e3
                               if steps else None), "step_ratio": _ratio_range(steps),
                   "peak_ratio": _ratio_range(_paired(cells, base, "peak_bytes")),
                   "infer_ratio": _ratio_range(_paired(cells, base, "infer_batch_s"))}
    return rows


def _ratio_range(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(rows: dict, order: list[str]) -> list[str]:
    base = rows.get(BASE, {})
    out = ["| method | kind | ms/step (CPU) | step ratio to seq_lora | trainable params | x seq_lora's | "
           "extra state MB | of it: method state / head stats MB | peak memory MiB | peak ratio | "
           "inference ms/batch | inference ratio |", "|---" * 12 + "|"]
    for m in order:
        r = rows.get(m)
        if r is None:
            continue
        step = f"{r['step_ms']:.1f}" if r["step_ms"] is not None else "no step (statistics only)"
        step += " (task 1's)" if r["timed_task"] == 1 else ""
        params = f"{r['trainable'] / base['trainable']:.2f}" if base.get("trainable") else "-"
        out.append(f"| {m} | {r['kind']} | {step} | {r['step_ratio']} | {r['trainable']:,.0f} | {params} | "
                   f"{r['extra_mb']:.2f} | {r['buffer_mb']:.2f} / {r['heads_mb']:.2f} | {r['peak_mib']:.1f} | "
                   f"{r['peak_ratio']} | {r['infer_ms']:.1f} | {r['infer_ratio']} |")
    return out


def write_report(data: dict, out: Path) -> None:
    m, s = data["machine"], data["settings"]
    load = [" / ".join(f"{x:.2f}" for x in m[k]) for k in ("load_start", "load_end")]
    order = list(dict.fromkeys([BASE] + [c["method"] for c in data["cells"]]))
    errors = [f"{c['method']} (round {c['round'] + 1}): {c['error']}" for c in data["cells"] if "error" in c]
    lines = ["# Cost of the continual-learning baselines against seq_lora", ""]
    if s["quick"]:
        lines += ["**QUICK SMOKE SETTING: the numbers are not measurements.**", ""]
    lines += [f"Command: `PYTHONPATH=src OMP_NUM_THREADS=1 nice -n 10 python benchmarks/cl_baselines_cost.py`"
              f" (throughput.py {data['argv'].replace(str(HERE.parent) + '/', '')}); raw cells in "
              f"`{out.with_suffix('.json').name}` (`--report-only` rebuilds this file from them).", "",
              f"Device: **{m['device']}**, CPU {m['cpu']}, {m['cores']} cores, {m['threads']} torch thread; "
              f"torch {m['torch']}. Load average (1/5/15 min) at the start {load[0]}, at the end {load[1]} "
              f"(a shared machine); started {m['started']}, {m['seconds'] / 60:.1f} min.", ""]
    lines += table(summarize(data), order) + [""] + HOW.format(**s).split("\n")
    if errors:
        lines += ["", "Cells that failed: " + "; ".join(errors)]
    notes = HERE / "cl_baselines_cost_notes.md"  # the hand-written reading of a full run
    if notes.exists() and not s["quick"] and out.parent == HERE:
        lines += [""] + notes.read_text().strip().split("\n")
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(out)


HOW = """## How measured

Suite: tiny ViT (`vit-tiny-fmnist`) on MNIST-5k (5 tasks of 2 classes), batch {batch}, fp32, one thread, Adam.
Each cell is a fresh forked process: task 1 trains {task1_steps} step(s) and runs its end-of-task work (buffer
filled, prototypes / covariances / subspaces set up), then task 2 trains: {warmup} warm-up step(s), then the
median of {steps} timed steps of the engine's loop (CPU time of the process, so other jobs' time slices do not
count); then task 2 runs to its end, untimed. {rounds} round(s), the method order rotating; every ratio is paired
with seq_lora's cell of the same round, the median over rounds shown with its min-max.

APER adapts its backbone in the first task only: its step, trainable parameters and peak memory are task 1's
(then task 2 runs, untimed, so its state and inference are measured after two tasks like the others').

- **trainable params**: parameters with gradients during the timed steps (the model's and the inference model's).
- **extra state MB**: what the method keeps besides the backbone after task 2: its own state tensors (the
  replay buffer's images, labels and logits; MOS's adapter pool and class statistics; EASE's prototypes), the
  head suite's statistics (class means / covariances of NCM, RanPAC's projection and Gram matrix, SLCA's
  alignment statistics) and the inference model's weights beyond seq_lora's (e.g. EASE's per-task adapters).
- **peak memory**: growth of the peak RSS over task 2 up to the last timed step, above the RSS at its start
  (the frozen-backbone methods take no step: their whole task 2, the statistics pass).
- **inference ms/batch**: one evaluation of tasks 1-2's test images with the classifier the run reports (the
  primary head), divided by its number of batches of {batch}; median of {inference_reps} pass(es)."""


def main(argv: list[str] | None = None) -> None:
    c = parse_args(argv)
    targs = throughput_args(c)
    if c.report_only:
        data = json.loads(c.out.with_suffix(".json").read_text())
    else:
        data = throughput.collect(throughput.parse_args(targs), targs)
    write_report(data, c.out)
    print(f"wrote {c.out}", flush=True)


if __name__ == "__main__":
    main()
