"""Log sinks (``run.log``): the CSV sink read back against events.jsonl, its rebuild on resume, and a missing
sink package refused before the run directory exists. TensorBoard and wandb are tested only where installed."""

from __future__ import annotations

import csv
import json
import sys

import pytest

from clmerge.config import parse_config
from clmerge.engine.run import run_experiment
from clmerge.engine.sinks import Sinks, scalars
from clmerge.utils.extras import MissingExtraError

from conftest import tiny_config


def _read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _expected(events):
    return [(e["event"], name, value) for e in events for name, value in scalars(e)]


def test_the_csv_sink_holds_every_logged_scalar(tmp_path):
    out = tmp_path / "run"
    run_experiment(parse_config(tiny_config(**{"run.log": ["csv"]})), out)
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    rows = _read_csv(out / "scalars.csv")
    assert [(r["event"], r["name"], float(r["value"])) for r in rows] == _expected(events)
    names = {(r["event"], r["name"]) for r in rows}
    assert {("step", "loss"), ("epoch", "loss"), ("task_end", "avg_acc"), ("task_end", "acc_row/1")} <= names
    end = next(r for r in rows if r["event"] == "task_end" and r["name"] == "avg_acc")
    assert end["task"] == "0" and float(end["value"]) == events[[e["event"] for e in events].index("task_end")]["avg_acc"]


def test_no_sink_writes_no_csv(tmp_path):
    out = tmp_path / "run"
    run_experiment(parse_config(tiny_config()), out)
    assert not (out / "scalars.csv").exists()


def test_on_resume_the_csv_is_rebuilt_from_the_kept_events(tmp_path):
    kept = [{"time": 1.0, "event": "step", "task": 0, "epoch": 0, "step": 3, "loss": 0.5, "lr": 0.01},
            {"time": 2.0, "event": "task_end", "task": 0, "acc_row": [80.0], "avg_acc": 80.0}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in kept) + '{"time": 3, "ev')
    (tmp_path / "scalars.csv").write_text("stale rows of the interrupted task\n")
    sinks = Sinks(tmp_path, ["csv"])
    sinks.write({"time": 4.0, "event": "step", "task": 1, "epoch": 0, "step": 1, "loss": 0.25, "lr": 0.01})
    sinks.close()
    rows = _read_csv(tmp_path / "scalars.csv")
    assert [(r["task"], r["name"], float(r["value"])) for r in rows] == [
        ("0", "loss", 0.5), ("0", "lr", 0.01), ("0", "acc_row/0", 80.0), ("0", "avg_acc", 80.0),
        ("1", "loss", 0.25), ("1", "lr", 0.01)]


@pytest.mark.parametrize("sink", ["tensorboard", "wandb"])
def test_a_missing_sink_package_is_refused_before_the_run_starts(sink, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, sink, None)  # as if not installed
    out = tmp_path / "run"
    with pytest.raises(MissingExtraError, match=rf'run.log: {sink} needs the package {sink}.*clmerge\[{sink}\]'):
        run_experiment(parse_config(tiny_config(**{"run.log": [sink]})), out)
    assert not out.exists()


def test_an_unknown_sink_is_a_config_error():
    with pytest.raises(ValueError, match=r"run\.log.*'csv', 'tensorboard' or 'wandb'"):
        parse_config(tiny_config(**{"run.log": ["mlflow"]}))


def test_the_tensorboard_sink_reads_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    run_experiment(parse_config(tiny_config(**{"run.log": ["tensorboard"]})), out)
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    ends = [e["avg_acc"] for e in events if e["event"] == "task_end"]
    assert [s.value for s in acc.Scalars("task_end/avg_acc")] == pytest.approx(ends)
