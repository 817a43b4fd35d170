"""A run end to end: plain progress lines on a pipe, step-loss records that survive a resume, and task
names that agree with the classes the report lists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from clmerge.config import parse_config
from clmerge.data import TensorData, build_scenario
from clmerge.data.base import DataSplits
from clmerge.data.scenarios import class_group_key, task_name
from clmerge.engine.run import run_experiment
from conftest import tiny_config


def _events(run: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("time", "seconds")} for r in rows if r["event"] == kind]


def test_piped_run_prints_plain_lines_and_records_step_losses(tmp_path, capsys) -> None:
    cfg = parse_config(tiny_config(**{"run.progress": True, "run.report": True}))
    run_experiment(cfg, tmp_path / "run")
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\r" not in err
    lines = err.splitlines()
    expected = [f"task {t}/2 epoch {e}/2 loss" for t in (1, 2) for e in (1, 2)]
    assert [line.split(" loss")[0] + " loss" for line in lines if " epoch " in line] == expected
    done = [line for line in lines if re.fullmatch(r"task [12]/2 done: avg acc \d+\.\d\d \(\d+\.\d s\)", line)]
    assert [line[:8] for line in done] == ["task 1/2", "task 2/2"]
    assert len(lines) == 6  # 4 epoch lines and 2 task lines, nothing else
    steps = _events(tmp_path / "run", "step")
    # 2 epochs x 3 steps per task: fewer than LOSS_POINTS steps, so one record per step
    assert [(e["task"], e["step"], e["steps"]) for e in steps] == [(t, s, 1) for t in (0, 1) for s in range(1, 7)]
    assert "training loss" in (tmp_path / "run" / "report.html").read_text()


def test_step_losses_come_back_exactly_on_resume(tmp_path, monkeypatch) -> None:
    cfg = parse_config(tiny_config(**{"scenario.n_tasks": 3, "scenario.classes_per_task": [2, 2, 2],
                                      "run.log_every_steps": 2}))
    run_experiment(cfg, tmp_path / "full")
    from clmerge.methods.seq_lora import SeqLoRA

    original = SeqLoRA.end_task

    def crash_on_task_2(self, task, ctx):
        if task.index == 2:
            raise RuntimeError("simulated crash")
        return original(self, task, ctx)

    monkeypatch.setattr(SeqLoRA, "end_task", crash_on_task_2)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_experiment(cfg, tmp_path / "crashed")
    monkeypatch.setattr(SeqLoRA, "end_task", original)
    run_experiment(cfg, tmp_path / "crashed", resume=True)
    full, resumed = _events(tmp_path / "full", "step"), _events(tmp_path / "crashed", "step")
    assert len(full) == 3 * 3 and [e["steps"] for e in full[:3]] == [2, 2, 2]  # 6 steps per task, every 2
    assert resumed == full  # same records, same losses to the last bit


def _splits(n_classes: int = 6) -> DataSplits:
    g = torch.Generator().manual_seed(0)
    y = np.repeat(np.arange(n_classes), 4)
    return DataSplits(train=TensorData(torch.rand(len(y), 1, 2, 2, generator=g), y),
                      test=TensorData(torch.rand(len(y), 1, 2, 2, generator=g), y))


def test_task_names_list_the_classes_in_head_order() -> None:
    s = build_scenario(_splits(), kind="class_incremental", n_tasks=3, class_order=[5, 0, 3, 1, 4, 2])
    assert [t.name for t in s.tasks] == ["task 0: classes[5, 0]", "task 1: classes[3, 1]", "task 2: classes[4, 2]"]
    assert [t.key for t in s.tasks] == ["classes[0, 5]", "classes[1, 3]", "classes[2, 4]"]  # identity: sorted
    assert all(t.describe()["name"] == f"task {t.index}: classes{t.describe()['classes']}" for t in s.tasks)
    moved = build_scenario(_splits(), kind="class_incremental", n_tasks=3, class_order=[5, 0, 3, 1, 4, 2],
                           task_order=[2, 0, 1])
    assert [t.name for t in moved.tasks] == ["task 0: classes[4, 2]", "task 1: classes[5, 0]", "task 2: classes[3, 1]"]
    assert [t.key for t in moved.tasks] == ["classes[2, 4]", "classes[0, 5]", "classes[1, 3]"]


def test_task_name_of_other_keys_is_the_key() -> None:
    assert task_name(3, class_group_key([9, 0]), [9, 0]) == "task 3: classes[9, 0]"
    assert task_name(1, "rotate(90)", [0, 1, 2]) == "task 1: rotate(90)"
    s = build_scenario(_splits(), kind="domain_incremental", n_tasks=2, transform="permute")
    assert [t.name for t in s.tasks] == [f"task {j}: {t.key}" for j, t in enumerate(s.tasks)]
