"""Start-up time of the command line, as a ratio against ``python -c "import torch"`` measured in the same run.

Usage:
    python benchmarks/startup.py [--repeats 9] [--out benchmarks/startup.md] [--baseline SRC_DIR]

Each repeat runs, in fresh processes and in turn (so that a change of the machine's load hits every command
alike): the interpreter alone, ``import torch``, ``clmerge --version``, ``clmerge --help``,
``clmerge merge --help`` and a ``clmerge merge --dry-run`` of a TIES merge of two tiny Llama models (built by
this script with transformers' config classes; no download). The table gives each command's median wall time,
its ratio to the median of ``import torch``, and its median CPU seconds (less sensitive to load than the wall
time). The targets are absolute on an idle machine (``--version`` and ``--help`` within 0.5 s, the dry run
within 2 s); on a loaded machine the ratio is the figure to compare across runs.

``--baseline SRC_DIR``: also time the clmerge commands with ``SRC_DIR`` (the ``src`` folder of another
checkout, e.g. ``git archive <commit> src | tar -x -C /tmp/old``) first on ``PYTHONPATH``, interleaved with
the current tree, and add its columns.
"""

from __future__ import annotations

import argparse
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
TARGETS = {"clmerge --version": 0.5, "clmerge --help": 0.5, "clmerge merge --help": 0.5,
           "clmerge merge --dry-run (tiny)": 2.0}


def build_tiny_models(folder: Path) -> None:
    """A base and two experts: 2-layer Llama models with hidden size 16 (7,248 parameters each)."""
    code = (
        "import sys, torch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,\n"
        "                  num_attention_heads=2, num_key_value_heads=2)\n"
        "for i, name in enumerate(['base', 'e1', 'e2']):\n"
        "    torch.manual_seed(i)\n"
        "    LlamaForCausalLM(cfg).save_pretrained(sys.argv[1] + '/' + name)\n")
    subprocess.run([sys.executable, "-c", code, str(folder)], check=True, capture_output=True,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"})


def clmerge_cmd() -> list[str]:
    script = Path(sys.executable).parent / "clmerge"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "clmerge"]


def commands(tiny: Path) -> dict[str, list[str]]:
    cl = clmerge_cmd()
    dry = [*cl, "merge", "--method", "ties", "--base", str(tiny / "base"), "--expert", str(tiny / "e1"),
           "--expert", str(tiny / "e2"), "--out", str(tiny / "out"), "--dry-run"]
    return {"python -c pass": [sys.executable, "-c", "pass"],
            'python -c "import torch"': [sys.executable, "-c", "import torch"],
            "clmerge --version": [*cl, "--version"],
            "clmerge --help": [*cl, "--help"],
            "clmerge merge --help": [*cl, "merge", "--help"],
            "clmerge merge --dry-run (tiny)": dry}


def time_once(cmd: list[str], env: dict) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system) of one run of ``cmd``."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def measure(repeats: int, baseline: Path | None, tiny: Path) -> dict[tuple[str, str], list[tuple[float, float]]]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "120"}
    env.pop("PYTHONPATH", None)
    trees = {"now": env}
    if baseline is not None:
        trees["baseline"] = {**env, "PYTHONPATH": str(baseline)}
    cmds = commands(tiny)
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(2):  # warm the file cache: the first runs read torch's files from disk
        for name, cmd in cmds.items():
            time_once(cmd, env)
    for i in range(repeats):
        for name, cmd in cmds.items():
            for tree, tenv in trees.items():
                if tree != "now" and not name.startswith("clmerge"):
                    continue
                times.setdefault((tree, name), []).append(time_once(cmd, tenv))
        print(f"repeat {i + 1}/{repeats} done", flush=True)
    return times


def where_clmerge(env_path: Path | None) -> str:
    env = {**os.environ}
    env.pop("PYTHONPATH", None)
    if env_path is not None:
        env["PYTHONPATH"] = str(env_path)
    out = subprocess.run([sys.executable, "-c", "import clmerge; print(clmerge.__file__)"], env=env,
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def write_markdown(path: Path, times: dict, repeats: int, loads: tuple, baseline: Path | None) -> None:
    med = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    torch_s = med[("now", 'python -c "import torch"')]
    torch_cpu = cpu[("now", 'python -c "import torch"')]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "?"
    torch_version = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                                   capture_output=True, text=True).stdout.strip()
    lines = [
        "# Start-up time of the command line",
        "",
        "Written by `benchmarks/startup.py` (fresh processes, each command in turn, "
        f"{repeats} repeats after 2 warm-up rounds; median wall time). The ratio divides a command's median by "
        "the median of `python -c \"import torch\"` measured in the same run, so it compares across machines "
        "and loads better than the seconds do. The targets are for an idle machine.",
        "",
        f"- commit {commit}; Python {platform.python_version()}, torch {torch_version}; "
        f"{os.cpu_count()} CPU cores; {platform.platform()}",
        f"- load average (1, 5, 15 min): {loads[0][0]:.2f}, {loads[0][1]:.2f}, {loads[0][2]:.2f} before; "
        f"{loads[1][0]:.2f}, {loads[1][1]:.2f}, {loads[1][2]:.2f} after",
        "",
        "| command | median wall s | min wall s | ratio to import torch (wall) | median CPU s | ratio (CPU) | "
        "target (idle) |",
        "|---|---|---|---|---|---|---|",
    ]
    for tree, name in [k for k in times if k[0] == "now"]:
        walls = [w for w, _ in times[(tree, name)]]
        target = f"{TARGETS[name]:.1f} s" if name in TARGETS else ""
        lines.append(f"| `{name}` | {med[(tree, name)]:.3f} | {min(walls):.3f} | "
                     f"{med[(tree, name)] / torch_s:.2f} | {cpu[(tree, name)]:.3f} | "
                     f"{cpu[(tree, name)] / torch_cpu:.2f} | {target} |")
    if baseline is not None:
        lines += ["", f"Baseline tree `{baseline}` (clmerge imported from `{where_clmerge(baseline)}`), "
                  "interleaved with the rows above in the same run:", "",
                  "| command | median wall s | ratio to import torch (wall) | median CPU s | ratio (CPU) | "
                  "now / baseline (wall) |",
                  "|---|---|---|---|---|---|"]
        for tree, name in [k for k in times if k[0] == "baseline"]:
            lines.append(f"| `{name}` | {med[(tree, name)]:.3f} | {med[(tree, name)] / torch_s:.2f} | "
                         f"{cpu[(tree, name)]:.3f} | {cpu[(tree, name)] / torch_cpu:.2f} | "
                         f"{med[('now', name)] / med[(tree, name)]:.2f} |")
    lines += ["", "On a loaded machine the wall times stretch with the load while the CPU seconds hardly move; these "
              "start-ups run in one thread, so on an idle machine with the files cached their wall time should come "
              "close to their CPU seconds (not measured here: this machine is shared).", "",
              "`clmerge --version`, `--help` and every command's `--help` import neither torch nor "
              "transformers nor the method modules (`tests/test_startup.py`). The dry run needs torch (the merge "
              "runner and the methods' registry), not transformers: its floor is the `import torch` row.", ""]
    path.write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "startup.md")
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout's src folder to compare")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tiny = Path(tmp)
        build_tiny_models(tiny)
        load_before = os.getloadavg()
        times = measure(args.repeats, args.baseline, tiny)
        load_after = os.getloadavg()
    write_markdown(args.out, times, args.repeats, (load_before, load_after), args.baseline)


if __name__ == "__main__":
    main()
