"""Shared helpers for the LoRA continual-learning method tests (tiny random-init ViT, 2 tasks)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from clmerge.config import parse_config
from clmerge.engine.run import prepare, run_experiment
from clmerge.methods.base import TaskContext

TINY = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}


def tiny_config(method: dict, *, n_tasks: int = 2, keep: int = 1, **extra):
    data = {"scenario": {"dataset": "mnist5k", "n_tasks": n_tasks, "train_per_class": 6, "test_per_class": 3},
            "model": {"pretrained": False, "config": TINY},
            "method": method, "train": {"epochs": 1, "batch_size": 16},
            "run": {"progress": False, "report": False, "keep_checkpoints": keep, "threads": 1}, **extra}
    return parse_config(data)


def tiny_setup(method: dict, **kw):
    """(scenario, model, method) with ``setup`` applied."""
    scenario, model, meth, _ = prepare(tiny_config(method, **kw))
    return scenario, model, meth


def context(scenario, t: int, seed: int = 0) -> TaskContext:
    return TaskContext(task=scenario.tasks[t], seen_tasks=scenario.tasks[: t + 1], device=torch.device("cpu"),
                       generator=torch.Generator().manual_seed(seed + t), n_tasks=len(scenario))


def run_and_resume(method: dict, tmp_path: Path) -> tuple[dict, dict]:
    """Run 2 tasks; copy the run, drop its last checkpoint and metrics, resume; return both metrics."""
    cfg = tiny_config(method, keep=2)
    a, b = tmp_path / "a", tmp_path / "b"
    full = run_experiment(cfg, a)
    shutil.copytree(a, b)
    uncommit_checkpoint(b, "task_001.safetensors")
    (b / "metrics.json").unlink()
    resumed = run_experiment(cfg, b, resume=True)
    return full, resumed


def uncommit_checkpoint(run_dir: Path, name: str) -> None:
    """Delete a checkpoint and its sha256 record in manifest.json: the state of a run killed before that
    checkpoint was committed (a recorded checkpoint that is missing is refused by --resume)."""
    (run_dir / "checkpoints" / name).unlink()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    del manifest["checkpoints"][name]
    (run_dir / "manifest.json").write_text(json.dumps(manifest))


def assert_same_run(full: dict, resumed: dict) -> None:
    assert full["accuracy_matrix"] == resumed["accuracy_matrix"]
    assert full["method_metrics"] == resumed["method_metrics"]


def resume_killed_copy(cfg, full_dir: Path, checkpoint: str) -> dict:
    """Copy the finished run ``full_dir`` to ``resumed`` beside it, as a run killed before ``checkpoint`` was
    committed (its metrics and that checkpoint removed), and resume it; returns the resumed metrics."""
    dst = full_dir.parent / "resumed"
    shutil.copytree(full_dir, dst)
    (dst / "metrics.json").unlink()
    uncommit_checkpoint(dst, checkpoint)
    return run_experiment(cfg, dst, resume=True)


def assert_same_checkpoint(a_dir: Path, b_dir: Path, name: str) -> tuple:
    """The checkpoint ``name`` of two runs holds the same model and method tensors, bit for bit; returns both
    loaded checkpoints."""
    from clmerge.engine.checkpoint import load_checkpoint

    a = load_checkpoint(a_dir / "checkpoints" / name)
    b = load_checkpoint(b_dir / "checkpoints" / name)
    for x, z in zip(a[:2], b[:2]):
        assert x.keys() == z.keys() and all(torch.equal(x[k], z[k]) for k in x)
    return a, b
