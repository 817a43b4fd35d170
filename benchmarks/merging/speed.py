"""Speed and peak memory of clmerge's merges on synthetic ViT-B/16-shaped experts, next to FusionBench and a
memory-bandwidth reference.

```bash
nice -n 10 python benchmarks/merging/speed.py --phase data
nice -n 10 python benchmarks/merging/speed.py --phase time --fusion-bench /tmp/fusion_bench_checkout
nice -n 10 python benchmarks/merging/speed.py --phase memory --fusion-bench /tmp/fusion_bench_checkout
python benchmarks/merging/speed.py --phase report      # -> benchmarks/merging/speed.md (+ speed.json)
```

- Experts: the parameter list of ``transformers.ViTModel(ViTConfig())`` (ViT-B/16, 86.4 M parameters; shapes
  read on the meta device, nothing downloaded), fp32, base ~ N(0, 0.02), expert = base + N(0, 1e-3) noise,
  stored as safetensors in ``--workdir``.
- ``time``: one process holds the base and the experts in memory; every repeat runs each row once, in an order
  rotated between repeats, each row preceded by the bandwidth reference (``torch.add`` over the same input
  bytes, one call per pair of input tensors). Times are reported as median / median-of-references.
  clmerge and FusionBench get the same in-memory dicts; outputs of the first repeat are compared.
- ``memory``: one subprocess per row; clmerge reads the safetensors files lazily (streaming), FusionBench
  loads models as its algorithm classes do (TA/averaging one at a time, TIES all at once). ``ru_maxrss``
  above the after-import ``VmRSS`` is reported, in units of one model.
- Without ``--fusion-bench`` (a checkout of tanganke/fusion_bench) the FusionBench rows are skipped and the
  report says so.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from fusionbench_rows import FB_METHODS, load_fusion_bench  # noqa: E402
from speed_report import EQUIV, HEADER, NOTES, report, targets  # noqa: E402

SD = dict[str, torch.Tensor]
HP = {"weight_average": {}, "task_arithmetic": {"scaling": 0.3}, "ties": {"density": 0.2, "scaling": 1.0},
      "dare": {"drop_rate": 0.5, "scaling": 0.3}}
CART_HP = {"rank_ratio": 0.08, "scaling": 1.0}


def vit_shapes(blocks: int) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of ``ViTModel(ViTConfig(num_hidden_layers=blocks))`` (ViT-B/16 for 12), built on meta."""
    from transformers import ViTConfig, ViTModel

    with torch.device("meta"):
        model = ViTModel(ViTConfig(num_hidden_layers=blocks))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def make_data(workdir: Path, blocks: int, n: int, seed: int = 0) -> dict[str, Any]:
    """Write ``base.safetensors`` and ``expert{i}.safetensors`` (skipped when the spec file matches)."""
    from safetensors.torch import save_file

    spec = {"blocks": blocks, "experts": n, "seed": seed, "version": 1}
    spec_file = workdir / "spec.json"
    if spec_file.exists() and json.loads(spec_file.read_text()) == spec:
        return spec
    workdir.mkdir(parents=True, exist_ok=True)
    shapes = vit_shapes(blocks)
    g = torch.Generator().manual_seed(seed)
    base = {k: 0.02 * torch.randn(s, generator=g) for k, s in shapes.items()}
    save_file(base, str(workdir / "base.safetensors"))
    for i in range(n):
        save_file({k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in base.items()},
                  str(workdir / f"expert{i}.safetensors"))
    spec_file.write_text(json.dumps(spec))
    return spec


def paths(workdir: Path) -> tuple[Path, list[Path]]:
    n = json.loads((workdir / "spec.json").read_text())["experts"]
    return workdir / "base.safetensors", [workdir / f"expert{i}.safetensors" for i in range(n)]


def bandwidth_reference(tensors: list[SD]) -> None:
    """One ``torch.add`` over each pair of input tensors of every key: reads every input byte once."""
    for key in tensors[0]:
        xs = [t[key] for t in tensors]
        for i in range(0, len(xs), 2):
            torch.add(xs[i], xs[i + 1] if i + 1 < len(xs) else xs[i])


def clmerge_rows(cart_keys: list[str]) -> dict[str, Callable[[SD, list[SD]], SD]]:
    """clmerge's rows: ``name -> fn(base, experts)``."""
    from clmerge import merging

    rows: dict[str, Callable[[SD, list[SD]], SD]] = {
        m: (lambda b, e, m=m: merging.merge(m, base=b, experts=e, **HP[m])) for m in HP}

    def cart(svd: str) -> Callable[[SD, list[SD]], SD]:
        def run(b: SD, e: list[SD]) -> SD:
            sub = [{k: x[k] for k in cart_keys} if isinstance(x, dict) else x for x in e]
            return merging.cart(experts=sub, svd=svd, **CART_HP)
        return run

    rows["cart_exact"] = cart("exact")
    rows["cart_randomized"] = cart("randomized")
    return rows


def cart_subset(keys: list[str], blocks: int) -> list[str]:
    """The keys of the first ``blocks`` encoder blocks (CART's SVDs are timed on them only)."""
    pat = re.compile(r"(^|\.)layers?\.(\d+)\.")  # "layers.3." (transformers >= 5) or "encoder.layer.3."
    return [k for k in keys if (m := pat.search(k)) and int(m.group(2)) < blocks]


def max_abs_diff(a: SD, b: SD) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def run_time(args: argparse.Namespace) -> dict[str, Any]:
    """The ``time`` phase (in this process): interleaved repeats, medians, equivalence of outputs."""
    from safetensors.torch import load_file

    torch.set_num_threads(args.threads)
    bpath, epaths = paths(args.workdir)
    base, experts = load_file(str(bpath)), [load_file(str(p)) for p in epaths]
    cart_keys = cart_subset(list(base), args.cart_blocks)
    rows = {f"clmerge:{k}": v for k, v in clmerge_rows(cart_keys).items()}
    fb = load_fusion_bench(args.fusion_bench) if args.fusion_bench else None
    if fb is not None:
        rows |= {f"fusionbench:{m}": (lambda b, e, m=m: FB_METHODS[m](fb, b, e, **HP[m])) for m in FB_METHODS}
    names = [n for n in rows if not args.rows or any(r in n for r in args.rows)]
    for x in [base] + experts:  # warm-up: fault every input page in before anything is timed
        for v in x.values():
            v.add_(0)
    times: dict[str, list[float]] = {n: [] for n in names}
    refs: dict[str, list[float]] = {n: [] for n in names}  # the reference run just before each timing
    kept: dict[str, SD] = {}
    equiv: dict[str, float] = {}
    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            gc.collect()
            t0 = time.perf_counter()
            bandwidth_reference([base] + experts)
            refs[name].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            out = rows[name](base, experts)
            times[name].append(time.perf_counter() - t0)
            method = name.split(":")[1]
            if rep == 0 and method in EQUIV and fb is not None:
                other = name.replace("clmerge:", "fusionbench:") if name.startswith("clmerge") else \
                    name.replace("fusionbench:", "clmerge:")
                if other in kept:
                    equiv[method] = max_abs_diff(out, kept.pop(other))
                elif other in names:
                    kept[name] = out
            del out
            print(f"rep {rep} {name}: {times[name][-1]:.3f}s (ref {refs[name][-1]:.3f}s)", flush=True)
    return {"times": times, "refs": refs, "equiv_max_abs_diff": equiv, "threads": args.threads,
            "repeats": args.repeats,
            "cart_fraction": sum(base[k].numel() for k in cart_keys) / sum(v.numel() for v in base.values()),
            "fusion_bench": str(args.fusion_bench) if fb is not None else None}


def proc_status() -> dict[str, int]:
    """``VmRSS`` and ``RssAnon`` of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name = line.split(":")[0]
            if name in ("VmRSS", "RssAnon"):
                out[name] = int(line.split()[1]) * 1024
    return out


def memory_worker(args: argparse.Namespace) -> dict[str, Any]:
    """One row's peak memory, in this (fresh) process. clmerge streams from files; FusionBench loads them."""
    from safetensors.torch import load_file

    torch.set_num_threads(args.threads)
    impl, method = args.row.split(":")
    bpath, epaths = paths(args.workdir)
    if impl == "fusionbench":
        fb = load_fusion_bench(args.fusion_bench)
        fn = FB_METHODS[method]
    else:
        from safetensors import safe_open

        with safe_open(str(bpath), framework="pt") as f:
            cart_keys = cart_subset(list(f.keys()), args.cart_blocks)
        fn = clmerge_rows(cart_keys)[method]
    gc.collect()
    # no sampling thread: a second thread that allocates changes glibc's arena choice, and with it the heap
    # growth being measured (seen here: the same TIES run peaking at 2 or 10 models)
    before = proc_status()
    if impl == "fusionbench":
        base = load_file(str(bpath))
        # TIES keeps every model (a list of state dicts); TA / averaging / DARE load one model at a time.
        experts = [load_file(str(p)) for p in epaths] if method == "ties" else LazyList(epaths, load_file)
        out = fn(fb, base, experts, **HP[method])
    else:
        out = fn(str(bpath), [str(p) for p in epaths])
    del out
    return {"row": args.row, "baseline": before, "after": proc_status(),
            "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


class LazyList(list):
    """A list of paths whose items are loaded when read (FusionBench's ``modelpool.load_model`` one by one)."""

    def __init__(self, items: list[Path], load: Callable[[str], SD]) -> None:
        super().__init__(items)
        self._load = load

    def __iter__(self):
        for p in super().__iter__():
            yield self._load(str(p))


def run_memory(args: argparse.Namespace) -> dict[str, Any]:
    """The ``memory`` phase: one subprocess per row."""
    rows = [f"clmerge:{m}" for m in (*HP, "cart_exact", "cart_randomized")]
    if args.fusion_bench:
        rows += [f"fusionbench:{m}" for m in FB_METHODS]
    rows = [r for r in rows if not args.rows or any(x in r for x in args.rows)]
    out = {}
    for row in rows:
        cmd = [sys.executable, __file__, "--phase", "memory-worker", "--row", row, "--workdir", str(args.workdir),
               "--threads", str(args.threads), "--cart-blocks", str(args.cart_blocks)]
        if args.fusion_bench:
            cmd += ["--fusion-bench", str(args.fusion_bench)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            out[row] = {"error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else str(res.returncode)}
        else:
            out[row] = json.loads(res.stdout.strip().splitlines()[-1])
        print(row, out[row], flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--phase", choices=["data", "time", "memory", "memory-worker", "report"], required=True)
    p.add_argument("--fusion-bench", type=Path, default=None, help="a checkout of tanganke/fusion_bench")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/clmerge_speed"))
    p.add_argument("--blocks", type=int, default=12, help="ViT blocks (12 = ViT-B/16)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cart-blocks", type=int, default=1)
    p.add_argument("--rows", nargs="*", default=None, help="only rows whose name contains one of these")
    p.add_argument("--row", default=None)
    p.add_argument("--json", type=Path, nargs="+", default=[HERE / "speed.json"],
                   help="results file (time/memory write the first; report reads all, in order)")
    p.add_argument("--out", type=Path, default=HERE / "speed.md")
    args = p.parse_args(argv)
    if args.fusion_bench is not None and not (args.fusion_bench / "fusion_bench").is_dir():
        print(f"note: {args.fusion_bench} holds no fusion_bench/ package: FusionBench rows skipped")
        args.fusion_bench = None
    if args.phase == "data":
        print(make_data(args.workdir, args.blocks, args.experts))
        return
    if args.phase == "memory-worker":
        print(json.dumps(memory_worker(args)))
        return
    if args.phase in ("time", "memory"):
        res = json.loads(args.json[0].read_text()) if args.json[0].exists() else {}
        spec = json.loads((args.workdir / "spec.json").read_text())
        res |= {"blocks": spec["blocks"], "experts": spec["experts"], "cart_blocks": args.cart_blocks,
                "machine": f"{os.cpu_count()} CPUs visible, shared"}
        new = (run_time if args.phase == "time" else run_memory)(args)
        old = res.get(args.phase, {})
        if args.phase == "time" and old:  # rows measured in another invocation are kept (each with its refs)
            for key in ("times", "refs", "equiv_max_abs_diff"):
                new[key] = old.get(key, {}) | new[key]
            new["fusion_bench"] = new["fusion_bench"] or old.get("fusion_bench")
        res[args.phase] = old | new if args.phase == "memory" else new
        args.json[0].write_text(json.dumps(res, indent=1))
    results = [json.loads(p.read_text()) for p in args.json if p.exists()]
    shapes = [vit_shapes(r["blocks"]) for r in results]
    model_bytes = [4 * sum(torch.Size(s).numel() for s in sh.values()) for sh in shapes]
    tensor_bytes = [4 * max(torch.Size(s).numel() for s in sh.values()) for sh in shapes]
    text = HEADER + "".join(f"## {r['blocks']} ViT-B/16 blocks ({p.name})\n\n" + report(r, mb)
                            for r, mb, p in zip(results, model_bytes, args.json) if True) + "\n"
    args.out.write_text(text + targets(results, model_bytes, tensor_bytes) + NOTES)
    print(args.out.read_text())


if __name__ == "__main__":
    main()
