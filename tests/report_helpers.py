"""A hand-written run directory (metrics, manifest, config, events) for report tests; one task name holds
markup that the report must escape."""

from __future__ import annotations

import json
from pathlib import Path


MALICIOUS = "<script>alert(1)</script>"
R3 = [[99.1, None, None], [80.0, 98.0, None], [70.0, 85.0, 97.0]]


def full_metrics() -> dict:
    return {
        "accuracy_matrix": R3,
        "til_accuracy_matrix": [[99.5, None, None], [95.0, 99.0, None], [93.0, 96.0, 98.5]],
        "initial_accuracy": None,
        "task_names": [MALICIOUS, "task 1", "task 2"],
        "task_sizes": [200, 200, 200],
        "acc": 84.0,
        "aaa": 88.0166,
        "forgetting": 21.55,
        "bwt": -21.55,
        "fwt": None,
        "plasticity": 98.0333,
        "accuracy_curve": [99.1, 89.0, 84.0],
        "forgetting_per_task": [29.1, 13.0],
        "acc_sample": 84.004,
        "aaa_sample": 88.0166,
        "forgetting_sample": 21.55,
        "bwt_sample": -21.55,
        "accuracy_curve_sample": [99.1, 89.0, 84.0],
        "til": {"acc": 95.8333, "aaa": 96.7, "forgetting": 5.0, "bwt": -5.0, "fwt": None, "plasticity": 99.0},
        "method": "seq_lora",
        "scenario": "class_incremental",
        "dataset": "mnist5k",
        "timings": {"total_s": 60.2, "per_task_s": [20.0, 20.1, 20.1]},
        "method_metrics": {"alpha": [1.0, 0.6, 0.45], "rank": 4, "note": MALICIOUS},
    }


def write_run(run_dir: Path, metrics: dict, *, extras: bool = True) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.json").write_text(json.dumps(metrics))
    if not extras:
        return run_dir
    manifest = {
        "clmerge_version": "0.1.0",
        "torch": "2.13.0",
        "seed": 0,
        "class_order": [3, 1, 0, 2, 5, 4],
        "tasks": [
            {"name": MALICIOUS, "classes": [3, 1], "n_train": 800, "n_test": 200},
            {"name": "task 1: classes [0, 2]", "classes": [0, 2], "n_train": 800, "n_test": 200},
            {"name": "task 2: classes [5, 4]", "classes": [5, 4], "n_train": 800, "n_test": 200},
        ],
        "backbone": {"preset": "vit-tiny-fmnist", "sha256": "ab" * 32},
    }
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    (run_dir / "config.yaml").write_text(f"method:\n  name: seq_lora\n  comment: '{MALICIOUS}'\nseed: 0\n")
    events = [{"event": "epoch", "task": t, "epoch": e, "loss": 1.0 / (1 + e + t), "lr": 0.005}
              for t in range(3) for e in range(2)]
    events += [{"event": "task_end", "task": 0, "seconds": 12.0}, {"event": "merge", "task": 1, "alpha": 0.6},
               {"event": "something_new", "x": 1}]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run_dir


def write_seed_run(run_dir: Path, method: str, seed: int, acc: float | None, *, til_acc: float | None = None,
                   scenario_seed: int = 0, finished: bool = True, **config: dict) -> Path:
    """A run directory for the tables across runs: ``config.yaml`` (method, seeds, dataset and ``config``'s
    sections) and, when ``finished``, a ``metrics.json`` holding ``acc`` and ``til.acc``."""
    import yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = {"seed": seed, "scenario": {"dataset": "digits", "seed": scenario_seed},
           "method": {"name": method, "rank": 8 if method == "pm" else 4}, "run": {"threads": 1}, **config}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    if finished:
        (run_dir / "metrics.json").write_text(json.dumps({"acc": acc, "fwt": None, "til": {"acc": til_acc}}))
    return run_dir


TIL_R2 = [[99.0, None], [95.0, 97.0]]


def write_matrix_run(run_dir: Path, method: str, seed: int, R: list, *, til: bool = True) -> Path:
    """A finished run directory for the sweep page: ``config.yaml`` (method, seed, dataset) and a
    ``metrics.json`` computed from the accuracy matrix ``R`` by clmerge.metrics (a fixed 2-task TIL matrix)."""
    import yaml

    from clmerge.metrics import summarize

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = {"seed": seed, "scenario": {"dataset": "digits", "seed": 0}, "method": {"name": method}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    metrics = {"accuracy_matrix": R, **summarize(R), "method": method}
    if til:
        metrics |= {"til_accuracy_matrix": TIL_R2, "til": summarize(TIL_R2)}
    (run_dir / "metrics.json").write_text(json.dumps(metrics))
    return run_dir
