"""A merge records what it really did: ``clmerge_recipe.yaml`` and the model card carry every hyperparameter as
used (each method's defaults filled in, in the one place every kind of merge goes through: ``merging.run.plan``),
the clmerge version and the git commit, so re-running the recorded recipe gives the same bits after a default
changes."""

from __future__ import annotations

import subprocess

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from clmerge import merging
from clmerge.cli import app
from clmerge.merging.methods.hparams import DATA_HPARAMS, effective_hyperparameters, method_hparams
from clmerge.merging.methods.registry import get_method
from clmerge.merging.recipes import recipe_of
from clmerge.merging.run import effective_recipe
from clmerge.utils.provenance import git_commit
from clmerge.version import VERSION


def _toy(seed: int = 0) -> tuple[dict, list[dict]]:
    g = torch.Generator().manual_seed(seed)
    keys = [f"model.layers.{i}.{m}.weight" for i in range(2) for m in ("self_attn.q_proj", "mlp.up_proj")]
    base = {k: torch.randn(6, 5, generator=g) for k in keys}
    base["model.norm.weight"] = torch.randn(5, generator=g)
    experts = [{k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(2)]
    return base, experts


@pytest.fixture()
def files(tmp_path):
    base, experts = _toy()
    paths = []
    for name, sd in zip(["base", "e0", "e1"], [base, *experts]):
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


@pytest.mark.parametrize(("method", "changed"), [("tsv_m", {"scaling": 0.5}), ("ties", {"density": 0.6})])
def test_the_recorded_recipe_reproduces_the_merge_after_a_default_changes(files, monkeypatch, method, changed):
    tmp, (pb, p0, p1) = files
    _merge("--method", method, "--base", pb, "--expert", p0, "--expert", p1, "--out", tmp / "first")
    recorded = yaml.safe_load((tmp / "first" / "clmerge_recipe.yaml").read_text())
    defaults = {n: h.default for n, h in method_hparams(get_method(method)).items()}
    assert recorded["parameters"] == defaults  # `--method tsv_m` and nothing else: every default written out

    fn = get_method(method).fn
    for name, value in changed.items():  # a later clmerge with another default
        monkeypatch.setitem(fn.__kwdefaults__, name, value)
    _merge(tmp / "first" / "clmerge_recipe.yaml", "--out", tmp / "again")
    _merge("--method", method, "--base", pb, "--expert", p0, "--expert", p1, "--out", tmp / "plain")
    first = _weights(tmp / "first")
    assert _same(_weights(tmp / "again"), first)  # bit for bit
    assert not _same(_weights(tmp / "plain"), first)  # the recipe as given would now merge otherwise
    again = yaml.safe_load((tmp / "again" / "clmerge_recipe.yaml").read_text())
    assert again["parameters"] == recorded["parameters"]


def test_the_card_and_the_recipe_name_the_version_and_the_commit(files):
    tmp, (pb, p0, p1) = files
    _merge("--method", "task_arithmetic", "--base", pb, "--expert", p0, "--expert", p1, "--set", "scaling=0.5",
           "--out", tmp / "m")
    recipe = (tmp / "m" / "clmerge_recipe.yaml").read_text()
    card = (tmp / "m" / "README.md").read_text()
    head = f"# made by clmerge {VERSION} (commit {git_commit()})"
    assert recipe.startswith(head) and head in card
    assert f"clmerge {VERSION}, commit {git_commit()}" in card
    assert yaml.safe_load(recipe)["parameters"] == {"scaling": 0.5, "normalize": False}  # given first, then defaults


def test_git_commit_is_the_checkouts_head_or_unknown():
    commit = git_commit()
    assert commit == git_commit()  # cached
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=__file__.rsplit("/tests/", 1)[0]).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        head = ""
    if commit == "unknown":
        pytest.skip("clmerge is not running from a git checkout here")
    assert len(commit) == 40 and (not head or git_commit.cache_clear() or git_commit() == head)


def test_stages_and_per_model_values_are_filled_in_with_their_own_methods(files):
    tmp, (pb, p0, p1) = files
    recipe = recipe_of({"method": "weight_average", "models": [{"model": "s1", "parameters": {"weight": 1.0}},
                                                                {"model": p1, "parameters": {"weight": 3.0}}],
                        "stages": [{"name": "s1", "method": "ties", "base": pb, "models": [p0, p1],
                                    "parameters": {"density": 0.5}}]})
    eff = effective_recipe(recipe)
    assert eff.parameters == {}  # weights come from the models' own parameters: no global `weights: null`
    assert eff.stages[0].parameters == {"density": 0.5, "scaling": 1.0, "trim_scope": "global",
                                        "merge_fn": "mean", "trim_rule": "exact", "densities": None, "weights": None}
    assert effective_recipe(eff).model_dump() == eff.model_dump()  # idempotent
    (tmp / "r.yaml").write_text(yaml.safe_dump(recipe.model_dump(exclude_defaults=True)))
    _merge(tmp / "r.yaml", "--out", tmp / "m")
    recorded = yaml.safe_load((tmp / "m" / "clmerge_recipe.yaml").read_text())
    assert recorded["stages"][0]["parameters"]["merge_fn"] == "mean" and recorded["models"][0]["model"] == "s1"


def test_effective_hyperparameters_leave_out_what_a_recipe_cannot_or_must_not_fix():
    tall = effective_hyperparameters(get_method("tall_mask_ties"), {})
    assert "task" not in tall and tall["density"] == 0.2  # task: chosen by --task
    assert "fishers" not in effective_hyperparameters(get_method("fisher_merging"), {})
    assert effective_hyperparameters(get_method("karcher"), {"nope": 1})["nope"] == 1  # left for the check
    assert "weights" not in effective_hyperparameters(get_method("karcher"), {}, ["weight"])


def _every_method():
    for name in merging.available():
        hps = method_hparams(get_method(name))
        if any(n in DATA_HPARAMS for n in hps) or any(h.required for h in hps.values()):
            continue
        yield name


def test_every_method_merges_the_same_with_its_defaults_written_out():
    """What the recorded recipe runs is what the plain one ran: for every method the CLI merges, passing each
    default explicitly gives the same tensors bit for bit (no method tells "given" from "defaulted")."""
    base, experts = _toy(1)
    small = {"dop": {"num_steps": 2}, "wudi": {"steps": 2}}  # iterative: two steps show the same as 200
    for name in _every_method():
        given = {**small.get(name, {}), **({"task": 0} if "task" in method_hparams(get_method(name)) else {})}
        try:
            plain = merging.merge(name, base=base, experts=experts, **given)
            ex = experts
        except ValueError as exc:  # a method of a base and one expert (arcee_fusion, nearswap)
            assert "one expert" in str(exc), (name, exc)
            ex = experts[:1]
            plain = merging.merge(name, base=base, experts=ex, **given)
        full = merging.merge(name, base=base, experts=ex, **{**effective_hyperparameters(get_method(name), given),
                                                             **given})
        assert _same(full, plain), name


def test_an_moe_records_every_assembly_setting_and_rebuilds_from_it(tmp_path):
    """``clmerge moe``'s ``clmerge_moe.yaml`` writes out the settings left at their defaults too, and re-running
    it rebuilds the same model bit for bit."""
    import transformers as tf
    from checkpoint_helpers import folder_state, llama_config, save_variants

    cfg = llama_config()
    cfg.hidden_size, cfg.num_hidden_layers = 32, 1
    paths = save_variants(tmp_path, cfg, ["base", "e0", "e1"], auto=tf.AutoModelForCausalLM)
    (tmp_path / "moe.yaml").write_text(yaml.safe_dump({"base_model": str(paths[0]), "gate_mode": "random",
                                                        "experts": [{"source_model": str(p)} for p in paths[1:]]}))
    res = CliRunner().invoke(app, ["moe", str(tmp_path / "moe.yaml"), "--out", str(tmp_path / "first")])
    assert res.exit_code == 0, res.output
    recorded = (tmp_path / "first" / "clmerge_moe.yaml").read_text()
    assert recorded.startswith(f"# made by clmerge {VERSION} (commit {git_commit()})")
    settings = yaml.safe_load(recorded)
    assert {k: settings[k] for k in ("layout", "first_k_dense_replace", "experts_per_token", "seed")} == \
        {"layout": "auto", "first_k_dense_replace": 0, "experts_per_token": 2, "seed": 0}
    res = CliRunner().invoke(app, ["moe", str(tmp_path / "first" / "clmerge_moe.yaml"), "--out", str(tmp_path / "again")])
    assert res.exit_code == 0, res.output
    assert _same(folder_state(tmp_path / "again"), folder_state(tmp_path / "first"))


def test_an_adapter_merge_reports_every_hyperparameter_the_version_and_the_commit(tmp_path):
    """``--adapter-out peft`` writes no model card: its merge_report.json carries the same record."""
    import json

    from test_peft_adapters import _llama, make_adapter

    _llama().save_pretrained(tmp_path / "base")
    make_adapter(tmp_path / "a1", 1)
    make_adapter(tmp_path / "a2", 2)
    _merge("--method", "ties", "--base", tmp_path / "base", "--expert", tmp_path / "a1", "--expert", tmp_path / "a2",
           "--adapter-out", "peft", "--set", "density=0.5", "--out", tmp_path / "m")
    report = json.loads((tmp_path / "m" / "merge_report.json").read_text())
    assert report["hyperparameters"] == {"density": 0.5, "scaling": 1.0, "trim_scope": "global", "merge_fn": "mean",
                                         "trim_rule": "exact", "densities": None, "weights": None}
    assert report["clmerge_version"] == VERSION and report["clmerge_commit"] == git_commit()
