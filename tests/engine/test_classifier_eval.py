"""``clmerge eval RUN_DIR --data NAME``: accuracy of a run's final model on its scenario's test sets."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import clmerge.engine.classifier_eval as ce
from clmerge.cli import app
from clmerge.config import parse_config
from clmerge.engine.run import run_experiment
from conftest import tiny_config


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "ft"
    run_experiment(parse_config(tiny_config(**{"method": {"name": "finetune"}, "train.epochs": 1})), run)
    return run


def test_a_planted_head_gives_the_share_of_its_class(run_dir, monkeypatch):
    """Zero weights and a bias that favours class 1: every prediction is 1, so the accuracy is the share of
    class 1 in the test sets (20 of the 80 samples: 25 %), and 100 % on none of the tasks but its own half."""
    real = ce.load_run_model

    def planted(path):
        model, *rest = real(path)
        with torch.no_grad():
            for block in model.head.blocks:
                block.weight.zero_()
                block.bias.zero_()
            model.head.blocks[0].bias[1] = 1.0
        return (model, *rest)

    monkeypatch.setattr(ce, "load_run_model", planted)
    res = ce.run_accuracy(run_dir, "digits")
    assert res["n"] == 80 and res["value"] == pytest.approx(25.0)
    assert [t["acc"] for t in res["tasks"]] == [pytest.approx(50.0), pytest.approx(0.0)]


def test_the_cli_gives_the_accuracy_the_run_recorded(run_dir, tmp_path):
    res = CliRunner().invoke(app, ["eval", str(run_dir), "--data", "digits", "--json", str(tmp_path / "a.json")])
    assert res.exit_code == 0, res.output
    out = json.loads((tmp_path / "a.json").read_text())
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert out["metric"] == "accuracy" and out["n"] == 80
    last = metrics["accuracy_matrix"][-1]
    assert [t["acc"] for t in out["tasks"]] == pytest.approx(last, abs=1e-6)
