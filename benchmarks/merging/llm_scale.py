"""clmerge against mergekit on a 1.1B Llama (TinyLlama shapes, random init, bf16, sharded), base + 3 variants.

One command runs everything, unattended; finished cells are skipped on a re-run (delete a cell from the JSON,
or pass ``--redo``, to measure it again):

```bash
python3 -m venv /work/venvs/mergekit                       # once, ~1 min, 1.6 GB; outside the repo
/work/venvs/mergekit/bin/pip install -c constraints.txt mergekit==0.1.5
nice -n 5 env PYTHONPATH=src .venv/bin/python benchmarks/merging/llm_scale.py \
    --data /work/llm_models --mergekit /work/venvs/mergekit          # -> llm_scale.md + llm_scale.json
```

- Models (``llm_models.py``): generated under ``--data`` on the first run (~4 x 2.2 GB, a few minutes).
- Cells: {idle, busy} x {clmerge, mergekit} x method. ``busy`` runs the merge beside ``python -c "while True:
  pass"``. Each cell is one child process: wall seconds, CPU seconds (user + system, from ``wait4``), peak RSS
  (``ru_maxrss`` from ``wait4``: the kernel's high-water mark of the child), and the anonymous / file-backed
  parts of the RSS polled every 0.1 s from ``/proc``; the load average before and after. The inputs are read
  once before each cell so both tools start from a warm page cache.
- After each cell the output is checked (``llm_scale_check.py loads``); the idle outputs of the two tools are
  compared key by key (``llm_scale_check.py compare``) and then deleted (``--keep-outputs`` keeps them).
- clmerge runs through its command line (``clmerge_command``, the only clmerge-specific function). A clmerge
  whose ``merge`` does not take model folders (no ``--out-shard-size`` in its help) gives "pending" cells.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from llm_models import model_dirs, make_models  # noqa: E402
from llm_scale_report import write_report  # noqa: E402

# method -> clmerge: (CLI method, --set values); mergekit: (merge_method, global parameters, per-model ones)
METHODS: dict[str, dict[str, Any]] = {
    "task_arithmetic": {"clmerge": ("task_arithmetic", {"scaling": 0.3}),
                        "mergekit": ("task_arithmetic", {"lambda": 0.3}, {"weight": 1.0})},
    "linear": {"clmerge": ("weight_average", {}), "mergekit": ("linear", {}, {"weight": 1.0})},
    "ties_per_tensor": {"clmerge": ("ties", {"density": 0.2, "scaling": 1.0, "trim_scope": "per_tensor"}),
                        "mergekit": ("ties", {"lambda": 1.0}, {"weight": 1.0, "density": 0.2})},
    "ties_global": {"clmerge": ("ties", {"density": 0.2, "scaling": 1.0, "trim_scope": "global"}),
                    "mergekit": None},
    "dare_linear": {"clmerge": ("dare", {"drop_rate": 0.5, "scaling": 0.3, "seed": 0}),
                    "mergekit": ("dare_linear", {"lambda": 0.3}, {"weight": 1.0, "density": 0.5}),
                    "ta_scaling": 0.3},
    "dare_ties": {"clmerge": ("dare", {"drop_rate": 0.5, "combine": "ties", "density": 1.0, "scaling": 1.0,
                                       "seed": 0}),
                  "mergekit": ("dare_ties", {"lambda": 1.0, "normalize": True},
                               {"weight": 1.0, "density": 0.5})},
    # the SVD merges: mergekit has none of them; "fusionbench": fusionbench_llm.py's arguments (no CART there)
    "cart": {"clmerge": ("cart", {"rank_ratio": 0.08, "scaling": 1.0, "svd": "randomized"}),
             "mergekit": None, "fusionbench": None},
    "tsv_m": {"clmerge": ("tsv_m", {"scaling": 1.0, "svd": "randomized"}), "mergekit": None,
              "fusionbench": {"method": "tsv_m", "scaling": 1.0}},
    "iso_cts": {"clmerge": ("iso_cts", {"scaling": 1.0, "common_space_fraction": 0.8, "svd": "randomized"}),
                "mergekit": None, "fusionbench": {"method": "iso_cts", "scaling": 1.0,
                                                  "common_space_fraction": 0.8}},
    # mergekit's newer methods, clmerge only here (their agreement with mergekit: methods_vs_mergekit.md)
    "della_linear": {"clmerge": ("della_linear", {}), "mergekit": None, "fusionbench": None},
    "breadcrumbs_ties": {"clmerge": ("breadcrumbs_ties", {}), "mergekit": None, "fusionbench": None},
    "sce": {"clmerge": ("sce", {}), "mergekit": None, "fusionbench": None},
    "karcher": {"clmerge": ("karcher", {}), "mergekit": None, "fusionbench": None},
    "multislerp": {"clmerge": ("multislerp", {}), "mergekit": None, "fusionbench": None},
    # the floor: every input read once, one model written once, no arithmetic (llm_floor.py)
    "floor": {"clmerge": ("floor", {}), "mergekit": None, "fusionbench": None},
}
TOOLS = ("clmerge", "mergekit", "fusionbench")
# 2-D keys that clmerge's default rule (``lowrank.DEFAULT_EXCLUDE``) averages in these Llama folders
FB_EXCLUDE = "embed"
CONDITIONS = ("idle", "busy")


def clmerge_command(args: argparse.Namespace, method: str, out: Path) -> list[str] | str:
    """clmerge's argv for one cell, or the reason it cannot run (the cell is then "pending")."""
    env = child_env(args, "clmerge")
    help_text = subprocess.run([args.python, "-m", args.clmerge_module, "merge", "--help"],
                               capture_output=True, text=True, env=env).stdout
    if "--out-shard-size" not in help_text:
        return "pending: this clmerge's `merge` reads flat weight files only (no --out-shard-size in --help)"
    name, sets = METHODS[method]["clmerge"]
    base, experts = model_dirs(args.data)
    if name == "floor":
        return [args.python, str(HERE / "llm_floor.py"), "--base", str(base),
                *[a for e in experts for a in ("--expert", str(e))], "--out", str(out)]
    argv = [args.python, "-m", args.clmerge_module, "merge", "--method", name, "--base", str(base)]
    for e in experts:
        argv += ["--expert", str(e)]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    return argv + ["--out", str(out), "--threads", str(args.threads), "--out-shard-size", args.shard]


def mergekit_command(args: argparse.Namespace, method: str, out: Path) -> list[str] | str:
    """mergekit-yaml's argv for one cell (the recipe is written next to the output), or why it cannot run."""
    exe = args.mergekit / "bin" / "mergekit-yaml"
    if not exe.exists():
        return (f"skipped: no {exe}; create it with `python3 -m venv {args.mergekit}` and "
                f"`{args.mergekit}/bin/pip install -c constraints.txt mergekit==0.1.5`")
    name, shared, per_model = METHODS[method]["mergekit"]
    base, experts = model_dirs(args.data)
    lines = [f"merge_method: {name}"] + ([] if name == "linear" else [f"base_model: {base}"]) + ["models:"]
    for e in experts:
        lines += [f"  - model: {e}", f"    parameters: {json.dumps(per_model)}"]
    if shared:
        lines.append(f"parameters: {json.dumps(shared)}")
    # arithmetic in fp32 (mergekit casts the inputs to `dtype`), output in the base's bf16, as clmerge does
    lines += ["dtype: float32", "out_dtype: bfloat16", ""]
    recipe = out.parent / f"{out.name}.yaml"
    recipe.write_text("\n".join(lines))
    return [str(exe), str(recipe), str(out), "--out-shard-size", args.shard.replace("GB", "B"),
            "--num-threads", str(args.threads), "--random-seed", "0", "--copy-tokenizer", "--quiet"]


def fusionbench_command(args: argparse.Namespace, method: str, out: Path) -> list[str] | str:
    """``fusionbench_llm.py``'s argv for one cell (FusionBench's own functions), or why it cannot run."""
    if args.fusion_bench is None:
        return "skipped: no --fusion-bench checkout given"
    base, experts = model_dirs(args.data)
    argv = [args.python, str(HERE / "fusionbench_llm.py"), "--fusion-bench", str(args.fusion_bench),
            "--base", str(base), "--out", str(out), "--exclude-regex", FB_EXCLUDE]
    for e in experts:
        argv += ["--expert", str(e)]
    for k, v in METHODS[method]["fusionbench"].items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


def child_env(args: argparse.Namespace, tool: str) -> dict[str, str]:
    threads = str(args.threads)
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, HF_HUB_OFFLINE="1")
    if tool == "clmerge":
        env["PYTHONPATH"] = str(args.clmerge_src)
    else:
        env.pop("PYTHONPATH", None)
    return env


def _tree_rss(pid: int) -> tuple[int, int]:
    """(RssAnon, RssFile) in bytes summed over ``pid`` and its descendants."""
    import psutil

    total = [0, 0]
    try:
        procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return 0, 0
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/status") as f:
                for line in f:
                    if line.startswith(("RssAnon:", "RssFile:")):
                        total[line.startswith("RssFile:")] += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total[0], total[1]


def measure(argv: list[str], env: dict[str, str], log: Path) -> dict[str, Any]:
    """Run ``argv`` to completion: wall and CPU seconds, peak RSS (``ru_maxrss``) and polled RSS parts."""
    load_before = os.getloadavg()
    peak_anon = peak_file = peak_sum = 0
    with open(log, "w") as logf:
        t0 = time.perf_counter()
        child = subprocess.Popen(argv, env=env, stdout=logf, stderr=subprocess.STDOUT)
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            anon, file_ = _tree_rss(child.pid)
            peak_anon, peak_file = max(peak_anon, anon), max(peak_file, file_)
            peak_sum = max(peak_sum, anon + file_)
            time.sleep(0.1)
        wall = time.perf_counter() - t0
    child.returncode = os.waitstatus_to_exitcode(status)
    return {"rc": child.returncode, "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "user_s": usage.ru_utime, "sys_s": usage.ru_stime, "peak_rss_bytes": usage.ru_maxrss * 1024,
            "polled_peak_anon_bytes": peak_anon, "polled_peak_file_bytes": peak_file,
            "polled_peak_rss_bytes": peak_sum, "load_before": load_before, "load_after": os.getloadavg(),
            "log_tail": log.read_text()[-1500:] if child.returncode else ""}


def warm_page_cache(dirs: list[Path]) -> None:
    for d in dirs:
        for f in sorted(d.glob("*.safetensors")):
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass


def run_cell(args: argparse.Namespace, condition: str, tool: str, method: str) -> dict[str, Any]:
    out = args.data / "out" / f"{condition}_{tool}_{method}"
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = COMMANDS[tool](args, method, out)
    if isinstance(argv, str):
        return {"status": argv}
    base, experts = model_dirs(args.data)
    warm_page_cache([base, *experts])
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if condition == "busy" else None
    try:
        if busy:
            time.sleep(1.0)
        res = measure(argv, child_env(args, tool), out.parent / f"{out.name}.log")
    finally:
        if busy:
            busy.kill()
            busy.wait()
    res["command"] = " ".join(argv)
    res["status"] = "ok" if res["rc"] == 0 else "error"
    if res["rc"] == 0:
        res["loads"] = check(args, "loads", str(out), str(base))
        res["output_bytes"] = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        if condition == "idle":
            res["stats"] = check(args, *stats_args(args, method, [out, None]))
    if condition != "idle" and not args.keep_outputs:
        shutil.rmtree(out, ignore_errors=True)
    return res


COMMANDS = {"clmerge": clmerge_command, "mergekit": mergekit_command, "fusionbench": fusionbench_command}


def check(args: argparse.Namespace, *cmd: str) -> dict[str, Any]:
    env = child_env(args, "clmerge")
    r = subprocess.run([args.python, str(HERE / "llm_scale_check.py"), *cmd], capture_output=True, text=True,
                       env=env)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1][:300]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def needs_output(args: argparse.Namespace, res: dict[str, Any], condition: str, tool: str,
                 method: str) -> bool:
    """An idle output still to be compared whose folder is gone (a run stopped mid-way): measure it again."""
    return (condition == "idle" and METHODS[method].get("mergekit") is not None
            and f"agreement/{method}" not in res["cells"]
            and not (args.data / "out" / f"idle_{tool}_{method}").exists())


def stats_args(args: argparse.Namespace, method: str, outs: list[Path | None]) -> list[str]:
    base, experts = model_dirs(args.data)
    cmd = ["compare", *(str(o) if o else "-" for o in outs), str(base), *map(str, experts)]
    if "ta_scaling" in METHODS[method]:
        cmd += ["--ta-scaling", str(METHODS[method]["ta_scaling"])]
    return cmd


def agreement(args: argparse.Namespace, method: str, res: dict[str, Any]) -> None:
    """Compare the idle outputs of clmerge and mergekit for ``method`` once both exist, then delete them.

    A method mergekit lacks is done when clmerge's output has its statistics. Outputs whose partner is not
    measured yet (clmerge pending) stay on disk for the re-run.
    """
    tools = [t for t in ("clmerge", "mergekit") if METHODS[method].get(t) is not None]
    outs = {t: args.data / "out" / f"idle_{t}_{method}" for t in tools}
    ok = all(res["cells"].get(f"idle/{t}/{method}", {}).get("status") == "ok" and outs[t].exists()
             for t in tools)
    key = f"agreement/{method}"
    if len(tools) == 2 and ok and (key not in res["cells"] or args.redo):
        print(f"compare {method}", flush=True)
        res["cells"][key] = check(args, *stats_args(args, method, [outs["clmerge"], outs["mergekit"]]))
    if ok and not args.keep_outputs:
        for o in outs.values():
            shutil.rmtree(o, ignore_errors=True)


def import_baselines(args: argparse.Namespace, res: dict[str, Any]) -> None:
    """Peak RSS of each tool's interpreter after its imports (a constant in the 7B extrapolation)."""
    cmds = {"clmerge": [args.python, "-c", f"import {args.clmerge_module}.cli"],
            "mergekit": [str(args.mergekit / "bin" / "python"), "-c",
                         "import mergekit.merge, mergekit.scripts.run_yaml"]}
    for tool in args.tools:
        if tool in cmds and f"baseline/{tool}" not in res["cells"] and Path(cmds[tool][0]).exists():
            log = args.data / "out" / f"baseline_{tool}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            r = measure(cmds[tool], child_env(args, tool), log)
            res["cells"][f"baseline/{tool}"] = r | {"status": "ok" if r["rc"] == 0 else "error"}


NA = {"mergekit": "not in mergekit 0.1.5", "fusionbench": "not in FusionBench"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, default=Path("/work/llm_models"),
                   help="models and outputs (outside the repo)")
    p.add_argument("--mergekit", type=Path,
                   default=Path(os.environ.get("MERGEKIT_VENV", "/work/venvs/mergekit")),
                   help="mergekit 0.1.5's venv (env MERGEKIT_VENV)")
    p.add_argument("--fusion-bench", type=Path, default=None,
                   help="a FusionBench checkout: its TSV-M and Iso-CTS as a third tool (fusionbench_llm.py)")
    p.add_argument("--python", default=sys.executable, help="the Python that runs clmerge")
    p.add_argument("--clmerge-src", default=str(REPO / "src"), help="PYTHONPATH of the clmerge runs")
    p.add_argument("--clmerge-module", default="clmerge", help="the module run with `python -m`")
    p.add_argument("--threads", type=int, default=1,
                   help="threads of both tools (OMP_NUM_THREADS and their flag)")
    p.add_argument("--shard", default="5GB", help="output shard size of both tools (both default to 5 GB)")
    p.add_argument("--methods", nargs="*", default=list(METHODS))
    p.add_argument("--tools", nargs="*", default=["clmerge", "mergekit"])
    p.add_argument("--conditions", nargs="*", default=list(CONDITIONS))
    p.add_argument("--redo", action="store_true", help="measure finished cells again")
    p.add_argument("--keep-outputs", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (a smoke test of the script)")
    p.add_argument("--layers", type=int, default=None,
                   help="TinyLlama's widths with this many layers (the same tensor shapes, a quicker set)")
    p.add_argument("--json", type=Path, default=HERE / "llm_scale.json")
    p.add_argument("--out", type=Path, default=HERE / "llm_scale.md")
    args = p.parse_args(argv)
    t_start = time.time()
    spec = (make_models(args.data, tiny=True, shard="200KB", layers=args.layers) if args.tiny
            else make_models(args.data, layers=args.layers))
    res = json.loads(args.json.read_text()) if args.json.exists() else {"cells": {}}
    res |= {"spec": spec, "threads": args.threads, "shard": args.shard, "cpus": os.cpu_count(),
            "mem_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}
    import_baselines(args, res)
    for condition in args.conditions:
        for method in args.methods:
            for tool in args.tools:
                key = f"{condition}/{tool}/{method}"
                old = res["cells"].get(key, {})
                if METHODS[method].get(tool, "none") is None:
                    res["cells"][key] = {"status": f"n/a: {NA[tool]}"}
                    continue
                if tool not in METHODS[method]:
                    continue
                done = old.get("status") == "ok" and not needs_output(args, res, condition, tool, method)
                if done and not args.redo:
                    continue
                print(f"{key} ...", flush=True)
                res["cells"][key] = run_cell(args, condition, tool, method)
                c = res["cells"][key]
                print(f"{key}: {c['status'][:120]} wall {c.get('wall_s', 0):.1f}s "
                      f"peak {c.get('peak_rss_bytes', 0) / 2**30:.2f} GiB", flush=True)
                args.json.write_text(json.dumps(res, indent=1))
            agreement(args, method, res)
            args.json.write_text(json.dumps(res, indent=1))
    res["last_run_s"] = time.time() - t_start
    args.json.write_text(json.dumps(res, indent=1))
    write_report(res, args.out)
    print(f"wrote {args.out} ({res['last_run_s']:.0f} s)")


if __name__ == "__main__":
    main()
