"""Merge recipes, per-key overrides and depth gradients, --dry-run, --task, typed --set errors, merges -v."""

from __future__ import annotations

import pytest
import torch
import yaml
from checkpoint_helpers import folder_state, invoke
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from clmerge import merging
from clmerge.cli import app
from clmerge.merging.recipes import key_groups, layer_index, load_recipe


@pytest.fixture()
def files(tmp_path):
    """A 4-layer toy model: base + 2 experts as safetensors files."""
    g = torch.Generator().manual_seed(0)
    keys = [f"model.layers.{i}.{m}.weight" for i in range(4) for m in ("self_attn.q_proj", "mlp.up_proj")]
    keys += ["model.embed_tokens.weight", "model.norm.weight"]
    base = {k: torch.randn(6, 5, generator=g) for k in keys}
    experts = [{k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(2)]
    paths = []
    for name, sd in zip(["base", "e0", "e1"], [base, *experts]):
        save_file(sd, str(tmp_path / f"{name}.safetensors"))
        paths.append(str(tmp_path / f"{name}.safetensors"))
    return tmp_path, base, experts, paths


def write_recipe(tmp, data):
    p = tmp / "recipe.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_overrides_and_depth_gradient_equal_merging_the_groups_by_hand(files):
    tmp, base, ex, (pb, p0, p1) = files
    recipe = write_recipe(tmp, {
        "method": "ties", "base": pb, "models": [{"model": p0}, {"model": p1}],
        "parameters": {"density": 0.2, "scaling": [0.5, 1.1]},  # scaling from 0.5 (layer 0) to 1.1 (layer 3)
        "overrides": [{"pattern": "*.self_attn.*", "parameters": {"density": 0.6}},
                      {"pattern": "re:embed|norm", "parameters": {"scaling": 1.0}}]})
    out = tmp / "m"
    r = invoke(recipe, "--out", out)
    assert r.exit_code == 0, r.output
    got = folder_state(out)
    want = {}
    for layer in range(4):
        scaling = 0.5 + 0.6 * layer / 3
        for part, density in (("self_attn.q_proj", 0.6), ("mlp.up_proj", 0.2)):
            k = f"model.layers.{layer}.{part}.weight"
            # one key per group here, so TIES's global top-k is per key
            want.update(merging.ties(base={k: base[k]}, experts=[{k: e[k]} for e in ex], density=density,
                                     scaling=scaling))
    rest = ["model.embed_tokens.weight", "model.norm.weight"]  # one group: global top-k over both keys
    want.update(merging.ties(base={k: base[k] for k in rest}, experts=[{k: e[k] for k in rest} for e in ex],
                             density=0.2, scaling=1.0))
    assert got.keys() == want.keys()
    assert all(torch.allclose(got[k], want[k], rtol=0, atol=1e-6) for k in want)
    assert "scaling" in (out / "clmerge_recipe.yaml").read_text()


def test_key_groups_and_layer_index():
    assert layer_index("model.layers.12.mlp.up_proj.weight") == 12 and layer_index("lm_head.weight") is None
    keys = ["emb", "l.0.w", "l.1.w", "l.2.w"]
    groups = key_groups(keys, {"a": [0.0, 1.0], "w": [1, 2]}, [], {"w"})
    assert [(g["a"], k) for g, k in groups] == [(0.0, ["emb", "l.0.w"]), (0.5, ["l.1.w"]), (1.0, ["l.2.w"])]
    assert groups[0][0]["w"] == [1, 2]  # a per-expert list is not a gradient


def test_per_model_weights_feed_the_methods_list(files):
    tmp, base, ex, (pb, p0, p1) = files
    recipe = write_recipe(tmp, {"method": "weight_average", "models": [
        {"model": p0, "parameters": {"weight": 1.0}}, {"model": p1, "parameters": {"weight": 3.0}}]})
    r = invoke(recipe, "--out", tmp / "m.safetensors")
    assert r.exit_code == 0, r.output
    want = merging.weight_average(experts=ex, weights=[1.0, 3.0])
    got = load_file(str(tmp / "m.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)
    bad = write_recipe(tmp, {"method": "task_arithmetic", "base": pb, "models": [
        {"model": p0, "parameters": {"weight": 1.0}}, {"model": p1, "parameters": {"weight": 2.0}}]})
    r = invoke(bad, "--out", tmp / "x")
    assert r.exit_code == 2 and "no per-expert list" in r.output and r.output.count("\n") == 1


@pytest.mark.parametrize("data, words", [
    ({"method": "ties", "modles": []}, ["modles", "did you mean 'models'"]),
    ({"method": "ties", "models": [{"model": "x", "paramters": {}}]}, ["models[0]", "paramters", "parameters"]),
    ({"method": "ties", "models": [{"model": "x"}], "overrides": [{"pattern": "re:(", "parameters": {}}]},
     ["overrides", "regular expression"]),
    ({"method": "ties", "models": [{"model": "x"}], "out_dtype": "float8"}, ["out_dtype"]),
])
def test_recipe_errors_name_the_key(files, data, words):
    tmp = files[0]
    r = invoke(write_recipe(tmp, data), "--out", tmp / "never")
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert all(w in r.output for w in words), r.output
    assert not (tmp / "never").exists()


def test_dry_run_prints_the_plan_and_writes_nothing(files):
    tmp, _, _, (pb, p0, p1) = files
    before = sorted(tmp.iterdir())
    r = invoke("--method", "ties", "--base", pb, "--expert", p0, "--expert", p1, "--out", tmp / "m", "--dry-run",
               "--set", "density=[0.1, 0.4]")
    assert r.exit_code == 0, r.output
    assert "memory estimate" in r.output and "10 tensors" in r.output and "density" in r.output
    assert "groups (keys with equal hyperparameters): 4" in r.output
    assert sorted(tmp.iterdir()) == before


@pytest.mark.parametrize("sets, words", [
    (["density=abc"], ["--set density", "finite number", "'abc'"]),
    (["scaling=nan"], ["--set scaling", "finite number"]),
    (["trim_scope=3"], ["--set trim_scope", "a string"]),
    (["densty=0.1"], ["not a hyperparameter", "did you mean 'density'"]),
])
def test_bad_set_values_are_one_line(files, sets, words):
    tmp, _, _, (pb, p0, p1) = files
    r = invoke("--method", "ties", "--base", pb, "--expert", p0, "--expert", p1, "--out", tmp / "m",
               *[x for s in sets for x in ("--set", s)])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert all(w in r.output for w in words), r.output
    assert not (tmp / "m").exists()


def test_per_task_methods_need_task_and_all_writes_one_folder_per_task(files):
    tmp, base, ex, (pb, p0, p1) = files
    args = ["--method", "emr_merging", "--base", pb, "--expert", p0, "--expert", p1]
    r = invoke(*args, "--out", tmp / "m")
    assert r.exit_code == 2 and "--task" in r.output and not (tmp / "m").exists()
    r = invoke(*args, "--out", tmp / "m", "--task", "all")
    assert r.exit_code == 0, r.output
    for t in range(2):
        want = merging.emr_merging(base=base, experts=ex, task=t)
        got = folder_state(tmp / "m" / f"task_{t}")
        assert all(torch.equal(got[k], want[k]) for k in want)
    r = invoke(*args, "--out", tmp / "m1.safetensors", "--task", "1")
    assert r.exit_code == 0, r.output
    r = invoke("--method", "ties", "--base", pb, "--expert", p0, "--out", tmp / "t", "--task", "1")
    assert r.exit_code == 2 and "not one per task" in r.output


def test_data_methods_point_to_the_api_and_merges_verbose_lists_hyperparameters(files):
    tmp, _, _, (pb, p0, p1) = files
    r = invoke("--method", "regmean", "--expert", p0, "--expert", p1, "--out", tmp / "m")
    assert r.exit_code == 2 and "Python API" in r.output and "clmerge.merging.regmean" in r.output
    r = CliRunner().invoke(app, ["merges", "--verbose"])
    assert r.exit_code == 0
    assert "density (float, default 0.2): fraction of each task vector kept" in r.output
    assert "trim_scope (str, default 'global')" in r.output


def test_load_recipe_accepts_plain_model_strings(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("method: task_arithmetic\nbase: b\nmodels: [x, y]\nparameters: {scaling: 0.4}\n")
    rec = load_recipe(str(p))
    assert [m.model for m in rec.models] == ["x", "y"] and rec.parameters == {"scaling": 0.4}


def test_a_merge_run_is_library_code_the_command_only_wraps(files, tmp_path):
    # build_recipe / run_merge live in clmerge.merging.run: a script merges without the typer command
    from clmerge.merging.run import build_recipe, run_merge

    *_, (base, a, b) = files
    recipe = build_recipe(None, "task_arithmetic", str(base), [str(a), str(b)], ["scaling=0.5"], {})
    info = run_merge(recipe, tmp_path / "lib.safetensors")
    r = invoke("--method", "task_arithmetic", "--base", base, "--expert", a, "--expert", b, "--set", "scaling=0.5",
               "--out", tmp_path / "cli.safetensors")
    assert r.exit_code == 0, r.output
    got, want = load_file(str(tmp_path / "lib.safetensors")), load_file(str(tmp_path / "cli.safetensors"))
    assert info.keys == len(want) and got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
