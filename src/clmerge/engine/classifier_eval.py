"""Accuracy of a continual run's final model on a dataset of this library (``clmerge eval RUN_DIR --data NAME``).

The model is the one ``clmerge export`` writes (:func:`.export.load_run_model`: the last checkpoint, the
method's inference model, LoRA folded). The data is the run's own scenario, rebuilt from its ``config.yaml``
(class order, tasks, test split), with the dataset and its options replaced when asked: the accuracy is over
every test sample of every task, class-incremental (argmax over all the classes the model knows).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import load_config
from ..errors import UsageError
from .evaluate import evaluate_tasks
from .export import load_run_model
from .setup import prepare

__all__ = ["run_accuracy"]


def run_accuracy(run_dir: str | Path, dataset: str | None = None, options: dict[str, Any] | None = None, *,
                 batch_size: int = 256) -> dict:
    """``{"metric": "accuracy", "value": %, "n": test samples, "tasks": [{"task", "acc", "n"}, ...]}``."""
    run_dir = Path(run_dir)
    model, _, _, _ = load_run_model(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    if dataset is not None:
        cfg.scenario.dataset = dataset
    if options:
        cfg.scenario.options = {**(cfg.scenario.options or {}), **options}
    scenario, _, _, _ = prepare(cfg)
    n_outputs = sum(t.class_range[1] - t.class_range[0] for t in scenario.tasks)
    head = getattr(getattr(model, "head", None), "num_classes", None)
    if head is not None and head != n_outputs:
        raise UsageError(f"--data {cfg.scenario.dataset}: {n_outputs} classes in its tasks, but the model of "
                         f"{run_dir} has {head} outputs")
    rows = evaluate_tasks(model, scenario.tasks, n_outputs=n_outputs, batch_size=batch_size)
    n = sum(r["n"] for r in rows)
    value = sum(r["acc"] * r["n"] for r in rows) / n
    return {"metric": "accuracy", "value": value, "n": n, "dataset": cfg.scenario.dataset,
            "tasks": [{"task": i, "acc": r["acc"], "n": r["n"]} for i, r in enumerate(rows)]}
