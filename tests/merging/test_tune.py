"""``clmerge merge --tune``: a search over a recipe's values that must find a PLANTED optimum.

Two tiny Llamas A and B (independent random weights, the same tokenizer). The held-out text is sampled from
the interpolation (1 - w*) A + w* B at w* = 0.3, so its perplexity under task_arithmetic(base A, expert B,
scaling s) = (1 - s) A + s B is lowest near s = w* (the sampled text's maximum-likelihood weight; with these
models the curve is sharp: ppl 15.6 at 0.3 against 19.8 at 0.2 and 18.2 at 0.4). The search must find s
within 0.05 of w* on a grid of step 0.1, and within 0.1 with Optuna's TPE in 12 trials.
"""

from __future__ import annotations

import csv
import sys

import pytest
import yaml

import clmerge.merging.tune as tune_mod
from clmerge.errors import OutputError, UsageError
from clmerge.merging.recipes import load_recipe
from clmerge.merging.lm_eval import load_causal_lm, perplexity, read_texts
from clmerge.merging.task_eval import EvalSpec
from clmerge.merging.tune import TuneSpec, Dimension, grid_points, load_tune_spec, set_path, tune
from clmerge.sweep.executors import LocalExecutor
from clmerge.utils.extras import MissingExtraError
from tune_helpers import W_STAR, planted_pair


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    root, data = planted_pair(tmp_path_factory.mktemp("planted"))
    return root, load_recipe("", data)


def _spec(root, **kw) -> TuneSpec:
    return TuneSpec(space=[Dimension("parameters.scaling", 0.0, 1.0)],
                    eval=EvalSpec(str(root / "heldout.txt"), max_length=64, batch_size=8), **kw)


def test_the_grid_finds_the_planted_weight_and_writes_table_recipe_and_model(planted, tmp_path):
    root, recipe = planted
    info = tune(recipe, _spec(root, points=11), tmp_path / "out", executor=LocalExecutor(0))
    assert abs(info["best"]["parameters.scaling"] - W_STAR) <= 0.05
    rows = list(csv.DictReader((tmp_path / "out" / "tune" / "trials.csv").open()))
    assert len(rows) == 11 and set(rows[0]) == {"trial", "parameters.scaling", "metric", "seconds"}
    best = yaml.safe_load((tmp_path / "out" / "tune" / "best_recipe.yaml").read_text())
    assert best["parameters"]["scaling"] == info["best"]["parameters.scaling"]
    model, tok = load_causal_lm(tmp_path / "out")  # the best model, in DIR
    opts = _spec(root).eval
    assert perplexity(model, tok, read_texts(opts.data), opts.perplexity_options(), progress=False)["value"] == pytest.approx(
        info["metric"], rel=1e-6)
    assert not (tmp_path / "out" / "tune" / "trials").exists()


def test_a_rerun_skips_the_trials_already_in_the_table(planted, tmp_path, monkeypatch):
    root, recipe = planted
    tune(recipe, _spec(root, points=3), tmp_path / "out", executor=LocalExecutor(0))
    (tmp_path / "out" / "tune" / "best_recipe.yaml").unlink()  # as if stopped before the end

    def no_trial(*args):
        raise AssertionError("a trial ran again")

    monkeypatch.setattr(tune_mod, "run_trial", no_trial)
    info = tune(recipe, _spec(root, points=3), tmp_path / "out", executor=LocalExecutor(0))
    assert info["trials"] == 3 and info["best"]["parameters.scaling"] == 0.5


@pytest.mark.slow  # two spawned workers import torch and transformers: ~30 s on 2 shared cores
def test_trials_run_in_a_pool_of_two(planted, tmp_path):
    root, recipe = planted
    ex = LocalExecutor(2)
    try:
        info = tune(recipe, _spec(root, points=5), tmp_path / "out", executor=ex, jobs=2)
    finally:
        ex.close()
    assert info["trials"] == 5 and info["best"]["parameters.scaling"] == 0.25


def test_optuna_tpe_finds_the_planted_weight(planted, tmp_path):
    pytest.importorskip("optuna")
    root, recipe = planted
    info = tune(recipe, _spec(root, search="optuna", trials=12), tmp_path / "out", executor=LocalExecutor(0))
    assert abs(info["best"]["parameters.scaling"] - W_STAR) <= 0.1


def test_optuna_missing_is_one_error_naming_the_extra(planted, tmp_path, monkeypatch):
    root, recipe = planted
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna raises ImportError
    with pytest.raises(MissingExtraError, match=r'pip install "clmerge\[tune\]"'):
        tune(recipe, _spec(root, search="optuna"), tmp_path / "out", executor=LocalExecutor(0))
    assert not (tmp_path / "out").exists()


def test_an_existing_foreign_out_is_refused_before_any_trial(planted, tmp_path):
    root, recipe = planted
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    for overwrite in (False, True):  # --overwrite replaces a finished tune only, never a foreign folder
        with pytest.raises(OutputError, match="holds no tune"):
            tune(recipe, _spec(root), tmp_path / "out", executor=LocalExecutor(0), overwrite=overwrite)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_a_finished_tune_is_replaced_only_with_overwrite(planted, tmp_path):
    root, recipe = planted
    tune(recipe, _spec(root, points=2), tmp_path / "out", executor=LocalExecutor(0))
    with pytest.raises(OutputError, match="--overwrite"):
        tune(recipe, _spec(root, points=3), tmp_path / "out", executor=LocalExecutor(0))
    info = tune(recipe, _spec(root, points=3), tmp_path / "out", executor=LocalExecutor(0), overwrite=True)
    assert info["trials"] == 3


def test_paths_set_weights_and_gradient_values():
    data = {"models": [{"model": "a"}, {"model": "b"}],
            "overrides": [{"pattern": "*", "parameters": {"density": [0.1, 0.5]}}]}
    set_path(data, "models[1].parameters.weight", 0.7)
    set_path(data, "overrides[0].parameters.density[1]", 0.9)
    set_path(data, "parameters.scaling", 1.2)
    assert data["models"][1]["parameters"] == {"weight": 0.7}
    assert data["overrides"][0]["parameters"]["density"] == [0.1, 0.9]
    assert data["parameters"] == {"scaling": 1.2}
    with pytest.raises(UsageError, match=r"models\[2\]"):
        set_path(data, "models[2].parameters.weight", 0.5)
    with pytest.raises(UsageError, match="not a recipe path"):
        set_path(data, "models[x]", 0.5)


def test_the_grid_is_the_product_of_the_axes(tmp_path):
    spec = TuneSpec(space=[Dimension("a", 0.0, 1.0), Dimension("b", values=("x", "y"))], eval=EvalSpec("d"),
                    points=3)
    assert [tuple(p.values()) for p in grid_points(spec)] == [(0.0, "x"), (0.0, "y"), (0.5, "x"), (0.5, "y"),
                                                              (1.0, "x"), (1.0, "y")]


@pytest.mark.parametrize("text, words", [
    ("space: {parameters.scaling: [1, 0]}\neval: {data: d.txt}\n", ["parameters.scaling", "low < high"]),
    ("space: {parameters.scaling: [0, 1]}\neval: {data: d.txt}\nsearch: cma\n", ["search", "cma"]),
    ("space: {parameters.scaling: [0, 1]}\neval: {dta: d.txt}\n", ["eval.dta"]),
    ("space: {parameters.scaling: [0, 1]}\neval: {data: d.txt, stride: 0}\n", ["--stride"]),
    ("space: {}\neval: {data: d.txt}\n", ["space"]),
])
def test_a_bad_tune_file_names_its_key(tmp_path, text, words):
    (tmp_path / "t.yaml").write_text(text)
    with pytest.raises(UsageError) as err:
        load_tune_spec(tmp_path / "t.yaml")
    assert all(w in str(err.value) for w in words)
