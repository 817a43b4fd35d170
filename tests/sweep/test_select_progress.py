"""A ``select:`` sweep's progress lines show the validation score its choice is made by, not the test
accuracy (which the fake cells here rank the other way round)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from clmerge.sweep import runner
from clmerge.sweep.grid import spec_from_dict
from conftest import tiny_config

VAL = {1e-3: 50.0, 3e-3: 70.0, 1e-2: 60.0}


def _fake_cell(data: dict, out: str, resume: bool) -> dict:
    """A cell whose test accuracy (100 - val) ranks the rates the other way round from validation."""
    v = VAL[data["optim"]["lr"]]
    metrics = {"acc": 100.0 - v, "head": {"val_acc": v}}
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "metrics.json").write_text(json.dumps(metrics))
    return runner.headline(metrics)


def test_selection_lines_show_the_validation_score(tmp_path, monkeypatch):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_config(**{"scenario.val_fraction": 0.2})))
    spec = spec_from_dict({"base": str(tmp_path / "tiny.yaml"), "grid": {"seed": [0]},
                           "select": {"key": "optim.lr", "values": list(VAL)}})
    monkeypatch.setattr(runner, "run_cell", _fake_cell)
    lines: list[str] = []
    runner.run_sweep(spec, tmp_path / "sw", log=lines.append)
    picked = [ln for ln in lines if ln.startswith("select/") and ": done" in ln]
    assert sorted(picked) == ["select/seed0-lr0.001: done (val acc 50.00)",
                              "select/seed0-lr0.003: done (val acc 70.00)",
                              "select/seed0-lr0.01: done (val acc 60.00)"]
    assert "selected optim.lr=0.003 for all on validation" in lines


def test_headline_carries_the_validation_score():
    assert runner.headline({"acc": 1.0, "head": {"val_acc": 2.0}}) == {"acc": 1.0, "aaa": None, "forgetting": None,
                                                                      "val": 2.0}
    assert runner.headline({"acc": 1.0})["val"] is None
