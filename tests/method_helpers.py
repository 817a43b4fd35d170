"""A tiny task-incremental config on a small MLP (permuted digits), shared by method tests."""

from __future__ import annotations


def tiny_cfg(method: str, **options) -> dict:
    return {
        "scenario": {"dataset": "digits", "kind": "task_incremental", "n_tasks": 3, "transform": "permutation",
                     "val_fraction": 0.2, "train_per_task": 400, "test_per_class": 10},
        "model": {"name": "mlp", "config": {"image_size": 8, "hidden": [32, 32]}},
        "method": {"name": method, **options},
        "optim": {"lr": 1e-2}, "train": {"epochs": 3, "batch_size": 40},
        "run": {"progress": False, "report": False, "keep_checkpoints": 3},
    }
