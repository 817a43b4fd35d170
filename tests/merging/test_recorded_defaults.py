"""The recorded recipe pins the recipe-level keys whose default decides the output (``compute_dtype``,
``out_shard_size``, ``fill`` with ``embeddings``, a slice recipe's ``outer_tensors``), not only the method's
hyperparameters: re-running ``clmerge_recipe.yaml`` gives the same bits after a later clmerge changes one of
those defaults. ``merge --tune``'s ``tune/best_recipe.yaml`` is the same effective recipe, and the terminal's
``wrote ...`` line shows the hyperparameters as used. ``--print-recipe`` keeps leaving defaults out."""

from __future__ import annotations

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.merging.recipes import Recipe, load_recipe, recipe_of
from clmerge.merging.run import effective_recipe
from clmerge.merging.task_eval import EvalSpec
from clmerge.merging.tune import Dimension, TuneSpec, tune
from clmerge.sweep.executors import LocalExecutor
from clmerge.utils.provenance import git_commit
from clmerge.version import VERSION
from tune_helpers import planted_pair


@pytest.fixture()
def files(tmp_path):
    g = torch.Generator().manual_seed(0)
    keys = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(2)] + ["model.norm.weight"]
    base = {k: torch.randn(6, 5, generator=g) for k in keys}
    paths = []
    for name in ("base", "e0", "e1"):
        sd = base if name == "base" else {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in base.items()}
        save_file(sd, str(tmp_path / f"{name}.safetensors"))
        paths.append(str(tmp_path / f"{name}.safetensors"))
    return tmp_path, paths


def _merge(*args):
    res = CliRunner().invoke(app, ["merge", *map(str, args)])
    assert res.exit_code == 0, res.output
    return res


def _weights(folder):
    return load_file(str(folder / "model.safetensors"))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _set_default(field: str, value) -> None:
    Recipe.model_fields[field].default = value
    Recipe.model_rebuild(force=True)


def test_the_recorded_recipe_reproduces_the_merge_after_the_compute_dtype_default_changes(files):
    tmp, (pb, p0, p1) = files
    flags = ["--method", "task_arithmetic", "--base", pb, "--expert", p0, "--expert", p1]
    _merge(*flags, "--out", tmp / "first")
    text = (tmp / "first" / "clmerge_recipe.yaml").read_text()
    recorded = yaml.safe_load(text)
    assert recorded["compute_dtype"] == "float32" and recorded["out_shard_size"] == "5GB"
    assert "fill" not in recorded  # no embeddings: rows merged by index, fill would be refused
    assert f"# made by clmerge {VERSION} (commit {git_commit()})" in text

    _set_default("compute_dtype", "bfloat16")  # a later clmerge computing in mergekit's bf16 by default
    try:
        _merge(tmp / "first" / "clmerge_recipe.yaml", "--out", tmp / "again")
        _merge(*flags, "--out", tmp / "plain")
    finally:
        _set_default("compute_dtype", "float32")
    first = _weights(tmp / "first")
    assert _same(_weights(tmp / "again"), first)  # bit for bit
    assert not _same(_weights(tmp / "plain"), first)  # the recipe without the key now merges otherwise
    assert yaml.safe_load((tmp / "plain" / "clmerge_recipe.yaml").read_text())["compute_dtype"] == "bfloat16"


def test_the_card_shows_the_pinned_keys_and_print_recipe_leaves_defaults_out(files):
    tmp, (pb, p0, p1) = files
    flags = ["--method", "ties", "--base", pb, "--expert", p0, "--expert", p1]
    _merge(*flags, "--out", tmp / "m")
    card = (tmp / "m" / "README.md").read_text()
    assert "compute_dtype: float32" in card and "out_shard_size: 5GB" in card
    printed = _merge(*flags, "--print-recipe").output
    assert "compute_dtype" not in printed and "out_shard_size" not in printed and "density" not in printed
    assert "compute_dtype: float32" in _merge(*flags, "--compute-dtype", "float32", "--print-recipe").output


def test_fill_is_pinned_with_embeddings_and_outer_tensors_in_a_slice_recipe():
    models = [{"model": "a"}, {"model": "b"}]
    with_vocab = effective_recipe(recipe_of({"method": "weight_average", "models": models, "embeddings": "union"}))
    assert yaml.safe_load(with_vocab.to_yaml())["fill"] == "present"
    plain = yaml.safe_load(effective_recipe(recipe_of({"method": "weight_average", "models": models})).to_yaml())
    assert "fill" not in plain and recipe_of(plain).compute_dtype == "float32"  # the recorded form validates
    sliced = {"method": "passthrough", "slices": [{"sources": [{"model": "a", "layer_range": [0, 2]}]}]}
    assert yaml.safe_load(effective_recipe(recipe_of(sliced)).to_yaml())["outer_tensors"] == "slices"
    assert yaml.safe_load(effective_recipe(recipe_of({**sliced, "base": "a"})).to_yaml())["outer_tensors"] == "base"
    staged = {"method": "weight_average", "models": [{"model": "s"}, {"model": "b"}],
              "stages": [{"name": "s", "method": "ties", "models": models}]}
    stage = yaml.safe_load(effective_recipe(recipe_of(staged)).to_yaml())["stages"][0]
    assert stage["compute_dtype"] == "float32" and stage["parameters"]["density"] == 0.2


def test_the_wrote_line_shows_the_hyperparameters_as_used(files):
    tmp, (pb, p0, p1) = files
    out = _merge("--method", "tsv_m", "--base", pb, "--expert", p0, "--expert", p1, "--out", tmp / "m").output
    used = yaml.safe_load((tmp / "m" / "clmerge_recipe.yaml").read_text())["parameters"]
    line = next(s for s in out.splitlines() if s.startswith("wrote "))
    assert line.endswith(f"tensors, tsv_m {used})") and "tsv_m {}" not in line
    assert "'svd': 'exact'" in line


def test_tune_best_recipe_is_the_effective_recipe_with_version_and_commit(tmp_path_factory, tmp_path):
    root, data = planted_pair(tmp_path_factory.mktemp("planted"))
    spec = TuneSpec(space=[Dimension("parameters.scaling", 0.0, 1.0)], points=3,
                    eval=EvalSpec(str(root / "heldout.txt"), max_length=64, batch_size=8))
    tune(load_recipe("", data), spec, tmp_path / "out", executor=LocalExecutor(0))
    text = (tmp_path / "out" / "tune" / "best_recipe.yaml").read_text()
    assert text.startswith(f"# made by clmerge {VERSION} (commit {git_commit()})")
    best = yaml.safe_load(text)
    assert set(best["parameters"]) == {"scaling", "normalize"} and best["compute_dtype"] == "float32"
    assert text == (tmp_path / "out" / "clmerge_recipe.yaml").read_text()  # what the merged folder records
