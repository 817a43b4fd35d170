"""GPU check of ``--device cuda``: TA / TIES / DARE merges and extract-lora on the CPU and on CUDA, compared.

Uses (or generates, from seeds, offline) the llm_scale set of ``llm_models.py``: TinyLlama-1.1B widths in bf16,
here with ``--layers`` decoder layers (default 4: about 0.31B parameters per model, base + 3 variants, 2.5 GB),
so that generation plus every cell fits in about 8 minutes on one H100 with its 16 cores. ``--layers 22`` is
the full 1.1B set (expect about 4x the time). Writes a Markdown table (``--out``): wall seconds on each device,
the peak device memory (``torch.cuda.max_memory_allocated``), and the largest |cpu - cuda| difference of the
outputs (merged weights; extract-lora's B A products, whose factors are defined only up to signs).

    HF_HUB_OFFLINE=1 PYTHONPATH=src python benchmarks/merging/gpu_check.py --data /tmp/gpu_check \\
        --out /tmp/gpu_check/gpu_check.md

``--forced-cpu`` runs the device column on the CPU forced as the device (no GPU needed: a smoke test of this
script; its numbers say nothing about a GPU).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from llm_models import make_models, model_dirs  # noqa: E402

# (row, method, --set values)
MERGES = [
    ("task_arithmetic", "task_arithmetic", ["scaling=0.4"]),
    ("ties per tensor", "ties", ["density=0.2", "trim_scope=per_tensor"]),
    ("ties global", "ties", ["density=0.2", "trim_scope=global"]),
    ("dare (linear)", "dare", ["drop_rate=0.7", "scaling=0.4", "seed=0"]),
    ("dare_ties", "dare", ["drop_rate=0.7", "combine=ties", "density=1.0", "seed=0"]),
]
EXTRACT_RANK = 16


def _state(folder: Path) -> dict[str, torch.Tensor]:
    from clmerge.merging.io import open_checkpoint

    src = open_checkpoint(folder)
    return {k: src.get(k) for k in src.keys()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest |a - b| over every floating tensor of two state dicts with the same keys."""
    worst = 0.0
    for k, x in a.items():
        if x.is_floating_point():
            worst = max(worst, float((x.double() - b[k].double()).abs().max()) if x.numel() else 0.0)
    return worst


def _lora_products(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    w = load_file(str(folder / "adapter_model.safetensors"))
    return {k: w[k.replace("lora_A", "lora_B")].double() @ w[k].double() for k in w if "lora_A" in k}


def _timed(fn) -> tuple[dict, float]:
    t0 = time.perf_counter()
    res = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return res, time.perf_counter() - t0


def run_cells(data: Path, device, work: Path) -> list[dict]:
    """Every cell on the CPU and on ``device``; the outputs are removed as soon as they are compared."""
    from clmerge.merging.io.extract import extract_lora
    from clmerge.merging.run import build_recipe, run_merge
    from clmerge.utils.device import Device

    base, variants = model_dirs(data)
    rows = []

    def cell(label: str, run, read) -> None:
        """``run(out, device)`` on the CPU (device None) and on ``device``, timed; outputs compared by ``read``."""
        outs = {d: work / f"{label.split()[0]}_{label.split()[-1]}_{d}" for d in ("cpu", "dev")}
        for p in outs.values():
            shutil.rmtree(p, ignore_errors=True)
        _, cpu_s = _timed(lambda: run(outs["cpu"], None))
        info, dev_s = _timed(lambda: run(outs["dev"], Device(device.torch, forced=device.forced)))
        dev_info = info["device"] if isinstance(info, dict) else info.device  # extract-lora: a dict; merge: MergeResult
        rows.append({"cell": label, "cpu_s": cpu_s, "dev_s": dev_s, "peak": dev_info["peak_device_memory_bytes"],
                     "max_abs_diff": max_abs_diff(read(outs["cpu"]), read(outs["dev"]))})
        for p in outs.values():
            shutil.rmtree(p, ignore_errors=True)
        print(rows[-1], flush=True)

    for name, method, sets in MERGES:
        recipe = build_recipe(None, method, str(base), [str(v) for v in variants], sets, {})
        cell(f"merge {name}", lambda out, dev, r=recipe: run_merge(r, out, hash_inputs=False,
                                                                  **({} if dev is None else {"device": dev})), _state)
    cell(f"extract-lora rank {EXTRACT_RANK}",
         lambda out, dev: extract_lora(base=base, tuned=variants[0], rank=EXTRACT_RANK, out=out,
                                       **({} if dev is None else {"device": dev})), _lora_products)
    return rows


def markdown(rows: list[dict], device: str, gpu: str, shapes: str, gen_s: float) -> str:
    """The Markdown report of :func:`run_cells`' rows."""
    lines = [f"# `--device` check: {device} ({gpu}) against the CPU",
             "",
             f"{shapes}, bf16, base + 3 variants (llm_models.py; generated or reused in {gen_s:.0f} s). "
             f"CPU threads: {torch.get_num_threads()}.",
             "",
             "| cell | CPU wall (s) | device wall (s) | speed-up | peak device memory | max abs(cpu - device) |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        peak = "n/a" if r["peak"] is None else f"{r['peak'] / 1e9:.2f} GB"
        lines.append(f"| {r['cell']} | {r['cpu_s']:.1f} | {r['dev_s']:.1f} | {r['cpu_s'] / max(r['dev_s'], 1e-9):.1f}x "
                     f"| {peak} | {r['max_abs_diff']:.3g} |")
    lines += ["", "extract-lora's difference is over the products B A (the factors are defined up to signs)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=Path("/tmp/clmerge_gpu_check"), help="models and scratch outputs")
    p.add_argument("--layers", type=int, default=4, help="decoder layers at TinyLlama widths (22: the 1.1B set)")
    p.add_argument("--tiny", action="store_true", help="the tiny test shapes (seconds; for smoke tests)")
    p.add_argument("--device", default="cuda", help="cuda or cuda:N")
    p.add_argument("--forced-cpu", action="store_true", help="the CPU forced as the device (a smoke test)")
    p.add_argument("--out", type=Path, default=None, help="Markdown file (default: DATA/gpu_check.md)")
    args = p.parse_args(argv)
    from clmerge.errors import UsageError
    from clmerge.utils.device import Device, parse_device
    from clmerge.utils.threads import default_threads

    try:
        device = Device("cpu", forced=True) if args.forced_cpu else parse_device(args.device)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(max(default_threads(), (os.cpu_count() or 2) // 2))
    _, gen_s = _timed(lambda: make_models(args.data, tiny=args.tiny, layers=None if args.tiny else args.layers,
                                          shard="200KB" if args.tiny else "500MB"))
    work = args.data / "outputs"
    work.mkdir(parents=True, exist_ok=True)
    rows = run_cells(args.data, device, work)
    gpu = torch.cuda.get_device_name(device.torch) if device.torch.type == "cuda" else "CPU forced as the device"
    shapes = "tiny test shapes" if args.tiny else f"TinyLlama-1.1B widths, {args.layers} decoder layers"
    text = markdown(rows, str(device.torch), gpu, shapes, gen_s)
    out = args.out or args.data / "gpu_check.md"
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
