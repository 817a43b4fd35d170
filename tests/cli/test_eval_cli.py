"""``clmerge eval`` on a causal LM and ``clmerge merge --tune`` end to end through the command line."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.merging.lm_eval import EvalOptions, load_causal_lm, perplexity, read_texts
from tune_helpers import planted_pair


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    return planted_pair(tmp_path_factory.mktemp("planted"))


def test_eval_prints_and_writes_the_perplexity_with_progress_lines_in_a_log(planted, tmp_path):
    root, _ = planted
    res = CliRunner().invoke(app, ["eval", str(root / "A"), "--data", str(root / "heldout.txt"), "--max-length",
                                   "16", "--stride", "8", "--batch-size", "16", "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    written = json.loads((tmp_path / "r.json").read_text())
    assert json.loads(res.stdout) == written
    model, tok = load_causal_lm(root / "A")
    opts = EvalOptions(str(root / "heldout.txt"), max_length=16, stride=8)
    assert written["value"] == pytest.approx(perplexity(model, tok, read_texts(opts.data), opts,
                                                        progress=False)["value"], rel=1e-6)
    assert written["stride"] == 8 and written["tokens"] == 40 * 30
    assert "eval batch" in res.stderr and "\x1b[" not in res.stderr  # piped: plain lines, no bar codes


def test_merge_tune_writes_the_table_the_best_recipe_and_the_model(planted, tmp_path):
    root, _ = planted
    (tmp_path / "tune.yaml").write_text(yaml.safe_dump({
        "points": 3, "space": {"parameters.scaling": [0.0, 0.6]},
        "eval": {"data": str(root / "heldout.txt"), "max_length": 64, "batch_size": 8}}))
    res = CliRunner().invoke(app, ["merge", str(root / "recipe.yaml"), "--tune", str(tmp_path / "tune.yaml"),
                                   "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "best {'parameters.scaling': 0.3}" in res.stdout
    assert len((tmp_path / "out" / "tune" / "trials.csv").read_text().splitlines()) == 4
    best = yaml.safe_load((tmp_path / "out" / "tune" / "best_recipe.yaml").read_text())
    assert best["parameters"]["scaling"] == 0.3 and (tmp_path / "out" / "config.json").is_file()


def test_merge_tune_on_ray_runs_one_task_per_trial(planted, tmp_path, monkeypatch):
    """The real ``RayExecutor`` on the in-process Ray stand-in (every trial a pickled Ray task)."""
    import sys

    from executor_helpers import FakeRay

    fake = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    root, _ = planted
    (tmp_path / "tune.yaml").write_text(yaml.safe_dump({
        "points": 3, "space": {"parameters.scaling": [0.0, 0.6]},
        "eval": {"data": str(root / "heldout.txt"), "max_length": 64, "batch_size": 8}}))
    res = CliRunner().invoke(app, ["merge", str(root / "recipe.yaml"), "--tune", str(tmp_path / "tune.yaml"),
                                   "--backend", "ray", "--jobs", "2", "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert fake.calls == 3 and not fake.initialized and "best {'parameters.scaling': 0.3}" in res.stdout
