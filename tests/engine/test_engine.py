import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from clmerge.config import parse_config
from clmerge.engine.run import run_experiment
from clmerge.errors import RunStateError
from clmerge.methods.seq_lora import SeqLoRA
from conftest import tiny_config


def metrics_of(run_dir: Path) -> dict:
    m = json.loads((run_dir / "metrics.json").read_text())
    m.pop("timings")
    return m


def test_short_end_to_end_run_writes_run_directory(tmp_path):
    cfg = parse_config(tiny_config(**{"run.report": True}))
    metrics = run_experiment(cfg, tmp_path / "run")
    run = tmp_path / "run"
    for name in ("config.yaml", "manifest.json", "metrics.json", "events.jsonl", "report.html"):
        assert (run / name).exists(), name
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["task_001.safetensors"]
    R = metrics["accuracy_matrix"]
    assert len(R) == 2 and R[0][1] is None and all(0 <= v <= 100 for v in (R[0][0], R[1][0], R[1][1]))
    assert metrics["til_accuracy_matrix"] is not None
    manifest = json.loads((run / "manifest.json").read_text())
    assert len(manifest["tasks"]) == 2 and manifest["class_order"]
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["method"] == {"name": "seq_lora", "rank": 2, "targets": ["query", "value"], "lora_alpha": None,
                                  "fold": True}
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert sum(e["event"] == "epoch" for e in events) == 4 and sum(e["event"] == "task_end" for e in events) == 2
    with pytest.raises(FileExistsError, match="--resume"):
        run_experiment(cfg, run)


def test_same_seed_same_numbers(tmp_path):
    cfg = parse_config(tiny_config())
    a = run_experiment(cfg, tmp_path / "a")
    b = run_experiment(cfg, tmp_path / "b")
    assert a["accuracy_matrix"] == b["accuracy_matrix"]


@pytest.mark.parametrize("method", [{"name": "seq_lora", "rank": 2}, {"name": "ewc", "fisher_samples": 16},
                                    {"name": "l2"}, {"name": "finetune"}])
def test_resume_after_crash_gives_identical_metrics(tmp_path, monkeypatch, method):
    cfg = parse_config(tiny_config(**{"scenario.n_tasks": 3, "scenario.classes_per_task": [2, 2, 2],
                                      "method": method}))
    full = run_experiment(cfg, tmp_path / "full")
    from clmerge.methods import METHODS

    cls = METHODS[method["name"]]
    original = cls.end_task

    def crash_on_task_2(self, task, ctx):
        if task.index == 2:
            raise RuntimeError("simulated crash")
        return original(self, task, ctx)

    monkeypatch.setattr(cls, "end_task", crash_on_task_2)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_experiment(cfg, tmp_path / "crashed")
    monkeypatch.setattr(cls, "end_task", original)
    resumed = run_experiment(cfg, tmp_path / "crashed", resume=True)
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    assert resumed["method_metrics"] == full["method_metrics"]
    events_full = [json.loads(x)["event"] for x in (tmp_path / "full" / "events.jsonl").read_text().splitlines()]
    events_res = [json.loads(x)["event"] for x in (tmp_path / "crashed" / "events.jsonl").read_text().splitlines()]
    assert events_full == events_res


def test_resume_refuses_a_different_config(tmp_path):
    run_experiment(parse_config(tiny_config()), tmp_path / "r")
    with pytest.raises(RunStateError, match="different config"):
        run_experiment(parse_config(tiny_config(seed=1)), tmp_path / "r", resume=True)


@pytest.mark.slow  # three real `clmerge run` processes: 30-95 s on a loaded 2-core machine
def test_sigkill_mid_task_then_resume(tmp_path):
    """A real process killed with SIGKILL during task 1 resumes to the same metrics as an uninterrupted run."""
    cfg = tiny_config(**{"scenario.n_tasks": 3, "scenario.classes_per_task": [2, 2, 2],
                         "train.max_steps_per_epoch": None, "train.epochs": 5,
                         "scenario.train_per_class": 60})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "clmerge.cli", "run", str(path)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run(cmd + ["--out", str(tmp_path / "full")], check=True, env=env, capture_output=True)
    proc = subprocess.Popen(cmd + ["--out", str(tmp_path / "killed")], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    ck = tmp_path / "killed" / "checkpoints" / "task_000.safetensors"
    deadline = time.time() + 120
    while not ck.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.01)  # inside task 1 (a longer wait let an unloaded machine finish the run before the kill)
    assert proc.poll() is None, "run finished before it could be killed; make it longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed" / "metrics.json").exists()
    subprocess.run(cmd + ["--out", str(tmp_path / "killed"), "--resume"], check=True, env=env, capture_output=True)
    assert metrics_of(tmp_path / "killed") == metrics_of(tmp_path / "full")


def test_seq_lora_folds_each_task(tmp_path):
    from clmerge.adapters import lora_layers

    cfg = parse_config(tiny_config())
    from clmerge.engine.run import prepare

    _, model, method, _ = prepare(cfg)
    assert isinstance(method, SeqLoRA)
    assert all(not p.requires_grad for n, p in model.backbone.named_parameters() if "lora_" not in n)
    assert len(lora_layers(model)) == 2  # q and v of the single block


def test_the_steps_of_a_run_take_the_run_object_and_give_run_experiments_numbers(tmp_path):
    """A :class:`Run` built once by ``prepare_run`` goes through ``train_task`` / ``evaluate_row`` /
    ``final_metrics``: the same accuracy matrix as ``run_experiment``, and ``restore`` reloads the state."""
    from clmerge.engine.run import evaluate_row, final_metrics, prepare_run, restore, train_task

    cfg = parse_config(tiny_config())
    metrics = run_experiment(cfg, tmp_path / "full")
    run = prepare_run(cfg, tmp_path / "steps", "cpu")
    run.out.mkdir()
    for t in range(len(run.scenario)):
        train_task(run, t)
        evaluate_row(run, t)
    assert final_metrics(run)["accuracy_matrix"] == metrics["accuracy_matrix"]
    again = prepare_run(cfg, tmp_path / "full", "cpu")
    assert restore(again)[0] == len(again.scenario) and again.state.rows == metrics["accuracy_matrix"]
