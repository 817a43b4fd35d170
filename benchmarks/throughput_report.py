"""The tables and the plot of benchmarks/throughput.py, from its JSON (so ``--report-only`` rebuilds them)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

LIMIT = 1.15  # the target: a LoRA method's step time <= 1.15 x seq_lora's, in every precision
GPU_SUITES = ["vit-tiny-fmnist", "vit-b16"]


def _ratio_key(data: dict) -> str:
    """The step time the ratios compare: CPU time on a CPU (robust to other jobs' time slices), else wall."""
    return "cpu_step_s" if data["machine"]["device"] == "cpu" else "step_s"


def summarize(data: dict) -> dict:
    """{(suite, precision, method): row} with medians over rounds and the per-round paired ratios (of the
    wall-clock step time: ``wall_ratio``; of ``_ratio_key``'s: ``ratio``, the one held to the limit)."""
    key = _ratio_key(data)
    by_cell: dict[tuple, list[dict]] = defaultdict(list)
    for c in data["cells"]:
        by_cell[(c["suite"], c["precision"], c["method"])].append(c)
    rows = {}
    for (suite, precision, method), cells in by_cell.items():
        ok = [c for c in cells if "step_s" in c]
        base_cells = {c["round"]: c for c in by_cell.get((suite, precision, data["suites"][suite]), [])
                      if "step_s" in c}
        ratios = [c[key] / base_cells[c["round"]][key] for c in ok if c["round"] in base_cells]
        wall = [c["step_s"] / base_cells[c["round"]]["step_s"] for c in ok if c["round"] in base_cells]
        row = {"kind": cells[0]["kind"], "n": len(ok), "errors": [c["error"] for c in cells if "error" in c]}
        if ok:
            step = statistics.median(c["step_s"] for c in ok)
            row.update(ms=statistics.median(c[key] for c in ok) * 1e3, wall_ms=step * 1e3,
                       steps_per_s=1.0 / step,
                       peak_mib=statistics.median(c["peak_bytes"] for c in ok) / 2**20,
                       loss_ms=statistics.median(c["hook_s"]["loss"] for c in ok) * 1e3,
                       hooks_ms=statistics.median(c["hook_s"]["before_step"] + c["hook_s"]["after_step"]
                                                  for c in ok) * 1e3)
        if ratios:
            row.update(ratio=statistics.median(ratios), ratio_lo=min(ratios), ratio_hi=max(ratios),
                       wall_ratio=statistics.median(wall))
        rows[(suite, precision, method)] = row
    return rows


def _verdict(row: dict, baseline: bool) -> str:
    if baseline:
        return "baseline"
    if row["kind"] != "lora" or "ratio" not in row:
        return "n/a (not LoRA)" if row["kind"] != "lora" else "no ratio"
    return "pass" if row["ratio"] <= LIMIT else "**fail**"


def _breakdown(row: dict, base: dict) -> str:
    """Where a cell's extra time per step goes, relative to the baseline (ms): loss = the forward pass and the
    method's loss terms; hooks = before_step + after_step; rest = backward, optimizer, data."""
    d_loss, d_hooks = row["loss_ms"] - base["loss_ms"], row["hooks_ms"] - base["hooks_ms"]
    rest = [r["ms"] - r["loss_ms"] - r["hooks_ms"] for r in (row, base)]
    d_rest = rest[0] - rest[1]
    return f"{d_loss:+.1f} / {d_hooks:+.1f} / {d_rest:+.1f}"


def _table(rows: dict, suite: str, precision: str, methods: list[str], baseline: str,
           clock: str) -> list[str]:
    out = [f"| method | kind | steps/s (wall) | ms/step (wall) | ms/step ({clock}) | ratio to {baseline} "
           f"({clock}; min-max over rounds) | wall ratio | <= {LIMIT} | peak memory MiB | loss ms | "
           "hooks ms | extra ms: loss / hooks / rest |", "|---" * 12 + "|"]
    base = rows.get((suite, precision, baseline), {})
    for m in methods:
        row = rows.get((suite, precision, m))
        if row is None:
            continue
        if "ms" not in row:
            shown = f"error: {'; '.join(row['errors'])[:200]}" if row["errors"] else "no training step"
            out.append(f"| {m} | {row['kind']} | {shown} |" + " |" * 9)
            continue
        ratio = f"{row['ratio']:.3f} ({row['ratio_lo']:.2f}-{row['ratio_hi']:.2f})" if "ratio" in row else "-"
        extra = _breakdown(row, base) if "ms" in base and m != baseline else "-"
        wall = f"{row['wall_ratio']:.3f}" if "wall_ratio" in row else "-"
        out.append(f"| {m} | {row['kind']} | {row['steps_per_s']:.2f} | {row['wall_ms']:.1f} | "
                   f"{row['ms']:.1f} | {ratio} | {wall} | {_verdict(row, m == baseline)} | "
                   f"{row['peak_mib']:.1f} | {row['loss_ms']:.1f} | {row['hooks_ms']:.2f} | {extra} |")
    return out


def _header(data: dict) -> list[str]:
    m, s = data["machine"], data["settings"]
    argv, gpu = data["argv"], f" ({m['gpu']})" if m.get("gpu") else ""
    load = [" / ".join(f"{x:.2f}" for x in m[k]) for k in ("load_start", "load_end")]
    fp16 = min(s["steps"], s["fp16_cpu_steps"])
    memory = ("`torch.cuda.max_memory_allocated` over task 2 (absolute)." if m["device"] != "cpu" else
              "growth of the peak RSS (VmHWM) over task 2 above the RSS at its start, in a fresh (forked) "
              "process per cell.")
    lines = ["# Training throughput and peak memory per method", ""]
    if s["quick"]:
        lines += ["**QUICK SMOKE SETTING: the numbers are not measurements.**", ""]
    lines += ["Command (from the repository root): `PYTHONPATH=src OMP_NUM_THREADS=1 nice -n 5 python "
              f"benchmarks/throughput.py{' ' + argv if argv else ''}`; the tables and the plot rebuild from "
              "`throughput.json` with `--report-only`.", "",
              f"Device: **{m['device']}**{gpu}; CPU {m['cpu']}, {m['cores']} cores "
              f"({m['cores_usable']} usable), {m['threads']} torch thread(s); torch {m['torch']}, "
              f"Python {m['python']}; {m['platform']}.",
              f"Load average (1/5/15 min) at the start {load[0]}, at the end {load[1]} (a shared machine: "
              "absolute times are inflated by other jobs; the ratios are paired within a round and, on a "
              "CPU, taken on the process's CPU time per step, which time slices lost to other jobs do not "
              f"inflate). Started {m['started']}, {m['seconds'] / 60:.1f} min.", "",
              f"Per cell: batch {s['batch']}, task 1 trained {s['task1_steps']} step(s) in fp32 + its "
              f"end-of-task work, then task 2: {s['warmup']} warm-up step(s), then the median of "
              f"{s['steps']} timed steps of the engine's `fit` loop (fp16 on a CPU: 1 warm-up, {fp16} "
              "timed: it runs ~9x slower there, see the notes); "
              f"{s['rounds']} round(s), the reported numbers are medians over rounds. Peak memory: "
              + memory, ""]
    return lines


def write_report(data: dict, out: Path, *, plot: Path | None = None, notes: str = "") -> None:
    rows = summarize(data)
    lines = _header(data)
    if plot is not None:
        lines += [f"![ratio to the baseline and peak memory]({plot.name})", ""]
    order = list(dict.fromkeys(c["method"] for c in data["cells"]))
    measured = set()
    for suite, baseline in data["suites"].items():
        for precision in data["settings"]["precisions"]:
            methods = [m for m in order if (suite, precision, m) in rows]
            if not methods:
                continue
            measured.add((suite, precision))
            lines += [f"## {suite} on {data['machine']['device']}, {precision}", ""]
            clock = "CPU time" if _ratio_key(data) == "cpu_step_s" else "wall"
            lines += _table(rows, suite, precision, methods, baseline, clock) + [""]
    lines += _summary(rows, data) + _gpu_section(data, measured)
    if notes:
        lines += ["", notes.strip()]
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(out)


def _summary(rows: dict, data: dict) -> list[str]:
    fails = [f"{m} ({p}: {r['ratio']:.2f}x)" for (s, p, m), r in rows.items()
             if r["kind"] == "lora" and r.get("ratio", 0) > LIMIT]
    lora = sorted({m for (s, p, m), r in rows.items() if r["kind"] == "lora" and m != data["suites"][s]})
    passing = [m for m in lora if not any(f.startswith(m + " ") for f in fails)]
    return ["## The 1.15x requirement (LoRA methods, every precision measured)", "",
            f"Pass in every precision: {', '.join(passing) or 'none'}.",
            f"Over the limit: {', '.join(fails) or 'none'}.", ""]


def _gpu_section(data: dict, measured: set) -> list[str]:
    if data["machine"]["device"] != "cpu":
        return []
    methods = list(dict.fromkeys(c["method"] for c in data["cells"] if c["suite"] in GPU_SUITES))
    lines = ["## GPU (CUDA)", "",
             "**Not measured**: this machine has no GPU. On a CUDA machine, "
             "`python benchmarks/throughput.py --device cuda` fills these columns (tiny ViT and ViT-B/16, "
             "random init, batch 64).", "",
             "| method | " + " | ".join(f"{n} {p}" for n in GPU_SUITES for p in ("fp32", "bf16", "fp16"))
             + " |",
             "|---" * 7 + "|"]
    lines += [f"| {m} |" + " not measured |" * 6 for m in methods]
    return lines


def write_plot(data: dict, out: Path) -> None:
    """Left: step time ratio to the baseline per method and precision (the 1.15 line); right: peak memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summarize(data)
    precisions = data["settings"]["precisions"]
    suites = list(data["suites"])
    fig, axes = plt.subplots(len(suites), 2, figsize=(13, 3.6 * len(suites)), squeeze=False)
    width = 0.8 / max(1, len(precisions))
    for i, suite in enumerate(suites):
        methods = list(dict.fromkeys(c["method"] for c in data["cells"] if c["suite"] == suite))
        for j, p in enumerate(precisions):
            xs = [k + (j - (len(precisions) - 1) / 2) * width for k in range(len(methods))]
            rs = [rows.get((suite, p, m), {}) for m in methods]
            axes[i, 0].bar(xs, [r.get("ratio", 0) for r in rs], width, label=p)
            axes[i, 1].bar(xs, [r.get("peak_mib", 0) for r in rs], width, label=p)
        if data["suites"][suite] == "seq_lora":  # the limit is on the LoRA methods' ratio to seq_lora
            axes[i, 0].axhline(LIMIT, color="red", lw=1, ls="--", label=f"{LIMIT}x")
        clock = "CPU time" if _ratio_key(data) == "cpu_step_s" else "wall time"
        axes[i, 0].set_ylabel(f"{clock} per step / {data['suites'][suite]}'s", fontsize=9)
        axes[i, 1].set_ylabel("peak memory MiB")
        for ax in axes[i]:
            ax.set_xticks(range(len(methods)), methods, rotation=45, ha="right", fontsize=8)
            ax.set_title(f"{suite} ({data['machine']['device']})", fontsize=10)
        axes[i, 0].legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
