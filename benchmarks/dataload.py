"""Images per second for data loading alone (no model): worker processes, pinned memory, fast JPEG decoding.

Usage:
    nice -n 5 python benchmarks/dataload.py [--data DIR] [--n 2000] [--repeats 3] [--workers 0 1 2]

Writes synthetic image folders once (fixed seed; under ``--data`` or a temporary directory): ``n`` JPEGs of
500x375 (the typical ImageNet-R / CUB size), ``n`` PNGs of 500x375 and ``n // 2`` JPEGs of 1024x768 (large
photos, where ``fast_jpeg`` can decode at reduced size). Each measurement is one pass of
``TaskData.batches(64, shuffle=True)`` over a folder at image_size 224, as training reads it (worker start-up
included: ``persistent_workers=False`` starts them every pass). Reported: the median of ``repeats`` passes in
images/s, the ratio to ``num_workers=0`` of the same folder and decoding in this run, and the CPU time the
calling (training) process spends per image. Writes ``benchmarks/dataload.md`` and ``benchmarks/dataload.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from clmerge.data.base import FileListData
from clmerge.data.loading import pinning_available
from clmerge.data.scenarios import TaskData

ROOT = Path(__file__).resolve().parents[1]
IMAGE_SIZE, BATCH = 224, 64
SETS = {"jpeg 500x375": ("JPEG", (500, 375), 1), "png 500x375": ("PNG", (500, 375), 1),
        "jpeg 1024x768": ("JPEG", (1024, 768), 2)}  # name -> (format, size, divisor of n)


@dataclass
class Row:
    folder: str
    workers: int
    pin: bool
    fast: bool
    rates: list[float] = field(default_factory=list)
    main_cpu_ms: list[float] = field(default_factory=list)  # CPU time of the calling process per image
    total_cpu_ms: list[float] = field(default_factory=list)  # the same, calling process + workers
    ratio: float = float("nan")

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)


def write_folder(folder: Path, n: int, fmt: str, size: tuple[int, int], seed: int) -> list[Path]:
    """``n`` photo-like images: a smooth random field plus pixel noise, so that JPEG/PNG sizes are realistic."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{i:05d}.{fmt.lower()}" for i in range(n)]
    if all(p.exists() for p in paths):
        return paths
    rng = np.random.default_rng(seed)
    for p in paths:
        coarse = Image.fromarray(rng.integers(0, 256, size=(12, 16, 3), dtype=np.uint8)).resize(size, Image.BICUBIC)
        noise = rng.integers(-12, 13, size=(size[1], size[0], 3))
        arr = np.clip(np.asarray(coarse, dtype=np.int16) + noise, 0, 255).astype(np.uint8)
        tmp = p.with_suffix(".tmp")
        Image.fromarray(arr).save(tmp, format=fmt, **({"quality": 90} if fmt == "JPEG" else {"compress_level": 6}))
        tmp.replace(p)
    return paths


def _cpu_seconds(who: int) -> float:
    use = resource.getrusage(who)
    return use.ru_utime + use.ru_stime


def one_pass(paths: list[Path], workers: int, pin: bool, fast: bool, seed: int) -> tuple[float, float, float]:
    """(images/s, calling-process CPU ms per image, calling process + workers CPU ms per image) of one pass."""
    src = FileListData(paths, np.zeros(len(paths), dtype=np.int64), image_size=IMAGE_SIZE, fast_jpeg=fast)
    data = TaskData(src, np.arange(len(paths)), np.zeros(1, dtype=np.int64), num_workers=workers, pin_memory=pin)
    gen = torch.Generator().manual_seed(seed)
    count, t0 = 0, time.perf_counter()
    c0, k0 = _cpu_seconds(resource.RUSAGE_SELF), _cpu_seconds(resource.RUSAGE_CHILDREN)
    for x, _ in data.batches(BATCH, shuffle=True, generator=gen):
        count += x.shape[0]
    wall = time.perf_counter() - t0
    # the workers have exited and been waited for when the loop ends: their CPU time is in RUSAGE_CHILDREN
    main = _cpu_seconds(resource.RUSAGE_SELF) - c0
    workers_cpu = _cpu_seconds(resource.RUSAGE_CHILDREN) - k0
    return count / wall, 1e3 * main / count, 1e3 * (main + workers_cpu) / count


def configs(name: str, workers: list[int]) -> list[tuple[int, bool, bool]]:
    """(workers, pin_memory, fast_jpeg) measured for one folder."""
    fasts = (False, True) if name.startswith("jpeg") else (False,)
    out = [(w, False, f) for f in fasts for w in workers]
    if name == "jpeg 500x375":
        out += [(w, True, False) for w in (workers[0], workers[-1])]
    return out


def measure(folders: dict[str, list[Path]], workers: list[int], repeats: int) -> list[Row]:
    """Every configuration once per round, ``repeats`` rounds: a change in the machine's load then affects all
    configurations alike instead of the ones measured while it lasted."""
    rows = [Row(name, w, pin, fast) for name in folders for w, pin, fast in configs(name, workers)]
    for r in range(repeats):
        for row in rows:
            rate, main_ms, total_ms = one_pass(folders[row.folder], row.workers, row.pin, row.fast, seed=r)
            row.rates.append(rate)
            row.main_cpu_ms.append(main_ms)
            row.total_cpu_ms.append(total_ms)
            print(f"round {r + 1}: {row.folder:14s} workers={row.workers} pin={row.pin!s:5s} "
                  f"fast_jpeg={row.fast!s:5s} {rate:7.1f} img/s  CPU main {main_ms:.2f} / total {total_ms:.2f} "
                  f"ms/img", flush=True)
    for row in rows:  # ratio against num_workers=0 with the same folder, pinning and decoding
        base = next(r for r in rows if (r.folder, r.pin, r.fast, r.workers) == (row.folder, row.pin, row.fast, 0))
        row.ratio = row.rate / base.rate
    return rows


def machine() -> str:
    import PIL

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor() or "unknown CPU")
    return (f"{cpu}, {os.cpu_count()} cores; Python {platform.python_version()}, torch {torch.__version__}, "
            f"Pillow {PIL.__version__}; CUDA available: {torch.cuda.is_available()}")


def write_table(rows: list[Row], args, load_start, load_end, seconds: float, machine_text: str) -> str:
    lines = ["| folder | num_workers | pin_memory | fast_jpeg | images/s (median) | min-max | × workers=0 "
             "| CPU ms/img: main process | CPU ms/img: main + workers |", "|---|---:|---|---|---:|---:|---:|---:|---:|"]
    med = statistics.median
    for r in rows:
        lines.append(f"| {r.folder} | {r.workers} | {'on' if r.pin else 'off'} | {'on' if r.fast else 'off'} | "
                     f"**{r.rate:.0f}** | {min(r.rates):.0f}-{max(r.rates):.0f} | {r.ratio:.2f} | "
                     f"{med(r.main_cpu_ms):.2f} | {med(r.total_cpu_ms):.2f} |")
    pin_note = ("pinning is real here (CUDA available)" if pinning_available() else
                "no CUDA on this machine, so `pin_memory` is accepted and does nothing (its rows measure noise)")
    return f"""# Data loading alone: images per second

Command: `nice -n 5 python benchmarks/dataload.py --n {args.n} --repeats {args.repeats} --workers \
{' '.join(map(str, args.workers))}` ({seconds / 60:.1f} min).

Machine: {machine_text}.
Load average (1 min) at start / end: **{load_start[0]:.2f} / {load_end[0]:.2f}** ({os.cpu_count()} cores shared with
other jobs; the figures are **under load** and understate what an idle machine does, the worker ratios most).

Each figure is one pass of `TaskData.batches({BATCH}, shuffle=True)` over a synthetic folder at image_size
{IMAGE_SIZE} (decode, resize of the shorter side to 256, centre crop, one float conversion per batch), worker
start-up included; median of {args.repeats} passes (each round measures every configuration once, so that load
changes hit all alike). "× workers=0": against `num_workers=0` with the same folder, `pin_memory` and
`fast_jpeg`, in this run. "CPU ms/img, main process": CPU time the calling (training) process spends per image,
what the workers take off the training loop; "main + workers": the whole cost of decoding an image, which,
unlike images/s, hardly depends on the load (on an idle machine, `num_workers` cores give about
`1000 * num_workers / that` images/s while the main process keeps up). Folders: {args.n} JPEGs and {args.n} PNGs of 500x375, {args.n // 2}
JPEGs of 1024x768. {pin_note}.

{chr(10).join(lines)}

![images per second](dataload.png)
"""


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if not r.pin]
    labels = [f"{r.folder.replace(' ', chr(10))}\nworkers {r.workers}{chr(10) + 'fast_jpeg' if r.fast else ''}"
              for r in shown]
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(shown)), 4.6))
    colors = {"jpeg 500x375": "tab:blue", "png 500x375": "tab:orange", "jpeg 1024x768": "tab:green"}
    ax.bar(range(len(shown)), [r.rate for r in shown], color=[colors[r.folder] for r in shown],
           hatch=None, alpha=0.85)
    ax.set_xticks(range(len(shown)), labels, fontsize=6.5)
    ax.set_ylabel("images / s (median)")
    ax.set_title(f"Data loading alone at {IMAGE_SIZE}px, {os.cpu_count()} cores under load")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def report(record: dict, out: Path) -> None:
    """Write the table (``out``), the plot (``.png``) and the raw figures (``.json``) from ``record``."""
    rows = [Row(**r) for r in record["rows"]]
    args = argparse.Namespace(**record["args"])
    _write_atomic(out, write_table(rows, args, record["load_start"], record["load_end"], record["seconds"],
                                   record["machine"]))
    _write_atomic(out.with_suffix(".json"), json.dumps(record, indent=1) + "\n")
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and its .png / .json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=None, help="where the synthetic folders go (default: a temp dir)")
    ap.add_argument("--n", type=int, default=2000, help="images per 500x375 folder")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "dataload.md")
    ap.add_argument("--replot", type=Path, default=None, help="rewrite the table and plot from a .json of a run")
    args = ap.parse_args()
    if args.replot is not None:
        report(json.loads(args.replot.read_text()), args.out)
        return
    if args.workers[0] != 0:
        ap.error("--workers must start with 0 (the baseline of the ratios)")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.data or Path(tmp)
        folders = {name: write_folder(root / name.replace(" ", "_"), args.n // div, fmt, size, seed=i)
                   for i, (name, (fmt, size, div)) in enumerate(SETS.items())}
        load_start, t0 = os.getloadavg(), time.perf_counter()
        rows = measure(folders, args.workers, args.repeats)
    record = {"args": {"n": args.n, "repeats": args.repeats, "workers": args.workers}, "machine": machine(),
              "load_start": list(load_start), "load_end": list(os.getloadavg()),
              "seconds": time.perf_counter() - t0, "rows": [asdict(r) for r in rows]}
    report(record, args.out)


if __name__ == "__main__":
    main()
