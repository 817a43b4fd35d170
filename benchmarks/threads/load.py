"""Thread counts under load: ``clmerge merge`` (task arithmetic, TIES, DARE), the same merges through the
Python API, and a training step, each at several thread settings, idle and beside busy processes.

``python benchmarks/threads/load.py --work DIR [--busy 2] [--json OUT]``: writes a merge set under DIR
(base + 8 experts, 4 bf16 tensors of 2.5 M entries each, one safetensors file per model), then runs every
cell in its own process and records wall seconds, CPU seconds (user + system of the child, from ``wait4``),
and the 1-minute load average before and after. ``--busy N`` starts N ``while True: pass`` processes for the
"load" condition (2 on a 2-core machine: load 4 with the cell and the machine's own load). Run it with
``nice -n 10`` on a shared machine; the table in docs/threads.md ("Default thread count under load") comes
from it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

EXPERTS, TENSORS, SHAPE = 8, 4, (1000, 2500)

TRAIN = r"""
import os, sys, time, resource
n = int(sys.argv[1])
import torch
if n > 0:
    torch.set_num_threads(n)
torch.manual_seed(0)
layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True, dropout=0.0)
model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2), torch.nn.Flatten(), torch.nn.Linear(64 * 256, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 64, 256), torch.randint(0, 10, (32,))
for step in range(int(os.environ.get("STEPS", "20"))):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
print(torch.get_num_threads())
"""

API = r"""
import sys
import torch
from clmerge.merging import methods
n = int(sys.argv[1])
if n > 0:
    torch.set_num_threads(n)
fn = getattr(methods, sys.argv[2])
out = fn(base=sys.argv[3], experts=sys.argv[4:])
print(torch.get_num_threads(), len(out))
"""


def make_set(root: Path) -> tuple[Path, list[Path]]:
    import torch
    from safetensors.torch import save_file

    paths = [root / "base.safetensors"] + [root / f"e{i}.safetensors" for i in range(EXPERTS)]
    if all(p.exists() for p in paths):
        return paths[0], paths[1:]
    root.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    base = {f"layer{j}.weight": (0.02 * torch.randn(SHAPE, generator=g)) for j in range(TENSORS)}
    save_file({k: v.bfloat16() for k, v in base.items()}, str(paths[0]))
    for p in paths[1:]:
        save_file({k: (v + 0.002 * torch.randn(SHAPE, generator=g)).bfloat16() for k, v in base.items()}, str(p))
    return paths[0], paths[1:]


def timed(cmd: list[str], env: dict[str, str]) -> dict:
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    out = proc.stdout.read().decode()[-400:]
    rc = os.waitstatus_to_exitcode(status)
    return {"rc": rc, "wall_s": round(wall, 2), "cpu_s": round(ru.ru_utime + ru.ru_stime, 2),
            "load_before": round(load0, 2), "load_after": round(os.getloadavg()[0], 2),
            "tail": out if rc else out.strip().splitlines()[-1:]}


def cells(base: Path, experts: list[Path], out: Path) -> list[tuple[str, str, list[str], dict[str, str]]]:
    py, clm = sys.executable, str(Path(sys.executable).with_name("clmerge"))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS")}
    passive = {**env, "OMP_WAIT_POLICY": "PASSIVE"}
    hp = {"task_arithmetic": [], "ties": ["--set", "density=0.2"], "dare": ["--set", "drop_rate=0.5"]}
    rows = []
    for m in ("task_arithmetic", "ties", "dare"):
        args = [clm, "merge", "--method", m, "--base", str(base)] + sum((["--expert", str(e)] for e in experts), [])
        args += hp[m] + ["--overwrite", "--no-hash-inputs", "--out", str(out / f"{m}.safetensors")]
        for label, extra in (("default", []), ("--threads 1", ["--threads", "1"]), ("--threads 3", ["--threads", "3"])):
            rows.append((f"merge {m}", f"CLI {label}", args + extra, env))
        api = [py, "-c", API, "0", m, str(base)] + [str(e) for e in experts]
        rows.append((f"merge {m}", "API, torch default threads, OMP default policy", api, env))
        rows.append((f"merge {m}", "API, torch default threads, OMP_WAIT_POLICY=PASSIVE", api, passive))
        rows.append((f"merge {m}", "API, 1 thread", api[:3] + ["1"] + api[4:], env))
    for label, n, e in (("torch default threads, OMP default policy", "0", env),
                        ("torch default threads, OMP_WAIT_POLICY=PASSIVE", "0", passive),
                        ("1 thread", "1", env)):
        rows.append(("training step x20", label, [py, "-c", TRAIN, n], e))
    return rows


def table(results: list[dict]) -> str:
    """The markdown table of docs/threads.md: one row per (what, setting), idle and load side by side."""
    rows: dict[tuple[str, str], dict[str, dict]] = {}
    for r in results:
        rows.setdefault((r["what"], r["setting"]), {})[r["condition"]] = r
    out = ["| what | setting | idle: CPU s | idle: wall s | idle: load avg | load: CPU s | load: wall s | "
           "load: load avg |", "|---|---|---|---|---|---|---|---|"]
    for (what, setting), c in rows.items():
        cells = []
        for cond in ("idle", "load"):
            r = c.get(cond)
            cells += (["", "", ""] if r is None else
                      [f"{r['cpu_s']:.2f}", f"{r['wall_s']:.1f}", f"{r['load_before']:.1f} -> {r['load_after']:.1f}"])
        out.append(f"| {what} | {setting} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--busy", type=int, default=2)
    p.add_argument("--json", type=Path)
    p.add_argument("--only", default="", help="substring of the cell names to run")
    p.add_argument("--report", type=Path, help="print the table of this JSON and exit")
    args = p.parse_args()
    if args.report:
        print(table(json.loads(args.report.read_text())))
        return
    base, experts = make_set(args.work / "set")
    results = []
    for cond in ("idle", "load"):
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy if cond == "load" else 0)]
        try:
            if busy:
                time.sleep(20)  # let the load average rise
            for what, setting, cmd, env in cells(base, experts, args.work / "out"):
                if args.only and args.only not in what + " " + setting:
                    continue
                r = {"condition": cond, "what": what, "setting": setting, **timed(cmd, env)}
                results.append(r)
                print(json.dumps(r), flush=True)
        finally:
            for b in busy:
                b.kill()
                b.wait()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
