"""mergekit configs read as they are: each key's translation, each mergekit method name, the refusals, the
aliases, ``--print-recipe``, and the three rules where a mergekit config follows mergekit (karcher with a base,
the slices' non-layer tensors, DELLA's window and L1 rescale)."""

from __future__ import annotations

import pytest
import torch
import yaml
from safetensors.torch import save_file
from typer.testing import CliRunner

from clmerge import merging
from clmerge.cli import app
from clmerge.errors import ConfigError
from clmerge.merging.mergekit_config import METHODS
from clmerge.merging.methods.hparams import check_hyperparameters
from clmerge.merging.methods.registry import get_method
from clmerge.merging.methods.sparse_family import magprune_drop_probabilities, magprune_tensor
from clmerge.merging.recipes import key_groups, recipe_of

LLAMA_KEYS = [f"model.layers.{i}.{m}" for i in range(5) for m in
              ("self_attn.q_proj.weight", "mlp.up_proj.weight", "input_layernorm.weight")]
KEYS = ["model.embed_tokens.weight", *LLAMA_KEYS, "model.norm.weight", "lm_head.weight"]


def _mk(**kw):
    data = {"merge_method": "ties", "base_model": "B", "models": [{"model": "X"}, {"model": "Y"}]}
    data.update(kw)
    return data


def _values(recipe, name):
    """``{key: value}`` of hyperparameter ``name`` over :data:`KEYS` (as the runner groups them)."""
    out = {}
    for hp, keys in key_groups(KEYS, recipe.parameters, recipe.overrides, {"weights"}):
        out.update({k: hp.get(name) for k in keys})
    return out


# -- a transcription of mergekit's evaluate_setting (mergekit 0.1.5, mergekit/config.py, evaluate_setting) --

def _mergekit_setting(name: str, setting, t: float):
    if isinstance(setting, (int, float, bool, str)):
        return setting
    if all(isinstance(e, (int, float)) for e in setting):
        scaled = t * (len(setting) - 1)
        i0 = int(scaled)
        i1 = min(len(setting) - 1, i0 + 1)
        return (1 - (scaled - i0)) * setting[i0] + (scaled - i0) * setting[i1]
    for cond in setting:
        if cond.get("filter") in (None, "*") or cond["filter"] in name:
            return _mergekit_setting(name, cond["value"], t)
    return None


def test_gradients_and_filters_give_mergekits_value_on_every_key():
    # mergekit: t = layer / (num_layers - 1) for layer tensors, 0 for the others (mergekit/plan.py plan_slice,
    # plan_module); the first filter that is a substring of the name wins
    setting = [{"filter": "self_attn", "value": [0.0, 0.5, 0.3, 0.7, 1.0]},
               {"filter": "mlp", "value": [1.0, 0.5, 0.7, 0.3, 0.0]}, {"value": 0.5}]
    r = recipe_of({"merge_method": "slerp", "base_model": "A", "models": [{"model": "A"}, {"model": "B"}],
                   "parameters": {"t": setting}})
    got = _values(r, "t")
    for key in KEYS:
        layer = int(key.split(".")[2]) if ".layers." in key else 0
        assert got[key] == pytest.approx(_mergekit_setting(key, setting, layer / 4)), key


def test_a_per_model_setting_overrides_the_global_one_and_falls_through_without_a_match():
    # mergekit's ConfigReader.parameter: the model's own setting, then the global one
    per_model = [{"filter": "mlp", "value": 0.9}]
    models = [{"model": m, "parameters": {"density": per_model, "weight": 1.0}} for m in ("X", "Y")]
    r = recipe_of(_mk(models=models, parameters={"density": [0.2, 0.6]}))
    got = _values(r, "density")
    for key in KEYS:
        layer = int(key.split(".")[2]) if ".layers." in key else 0
        want = _mergekit_setting(key, per_model, 0) or _mergekit_setting(key, [0.2, 0.6], layer / 4)
        assert got[key] == pytest.approx(want), key


def test_each_top_level_key():
    data = _mk(models=[{"model": "B"}, {"model": "X", "parameters": {"weight": 0.5, "density": 0.3}},
                       {"model": "Y", "parameters": {"weight": 0.5, "density": 0.3}}],
               parameters={"normalize": False, "int8_mask": True, "lambda": 2.0}, dtype="bfloat16",
               tokenizer_source="union", chat_template="Y")
    r = recipe_of(data)
    assert (r.method, r.base, [m.model for m in r.models]) == ("ties", "B", ["X", "Y"])  # the base left out
    assert r.parameters == {"trim_scope": "per_tensor", "merge_fn": "sum", "scaling": 1.0, "density": 0.3}
    assert (r.out_dtype, r.embeddings, r.chat_template_from) == ("bfloat16", "union", "Y")
    assert recipe_of(_mk(dtype="float32", out_dtype="float16",
                         models=[{"model": "X", "parameters": {"weight": 1}}])).out_dtype == "float16"
    r = recipe_of(_mk(tokenizer={"source": "base"}, models=[{"model": "X", "parameters": {"weight": 1}}]))
    assert r.embeddings == "base" and r.tokenizer_from is None
    r = recipe_of(_mk(tokenizer_source="Y", models=[{"model": "X", "parameters": {"weight": 1}}]))
    assert (r.embeddings, r.tokenizer_from) == ("base", "Y")


def test_slices_with_layer_range_and_passthrough():
    data = {"merge_method": "passthrough", "dtype": "float16",
            "slices": [{"sources": [{"model": "A", "layer_range": [0, 24]}]},
                       {"sources": [{"model": "B", "layer_range": [20, 40]}]}]}
    r = recipe_of(data)
    assert r.method == "passthrough" and r.base is None and r.outer_tensors is None
    assert [(s.sources[0].model, s.sources[0].layer_range) for s in r.slices] == [("A", [0, 24]), ("B", [20, 40])]
    # a merge of slices with a base: mergekit merges the non-layer tensors from the slices' sources
    data = {"merge_method": "slerp", "base_model": "A", "parameters": {"t": 0.3},
            "slices": [{"sources": [{"model": "A", "layer_range": [0, 4]}, {"model": "B", "layer_range": [0, 4]}]}]}
    r = recipe_of(data)
    assert (r.base, r.outer_tensors, r.parameters) == ("A", "slices", {"t": 0.3})
    # passthrough of one model (a copy, mergekit's dtype conversion)
    r = recipe_of({"merge_method": "passthrough", "models": [{"model": "A"}], "dtype": "bfloat16"})
    assert (r.method, [m.model for m in r.models], r.out_dtype) == ("weight_average", ["A"], "bfloat16")


def _minimal(name: str) -> dict:
    spec = METHODS[name]
    data = {"merge_method": name, "models": [{"model": "X"}, {"model": "Y"}], "base_model": "B"}
    if name in ("slerp", "nearswap", "arcee_fusion"):
        data["models"] = [{"model": "X"}]
    if name in ("passthrough", "linear"):
        data = {"merge_method": name, "models": data["models"][:1 if name == "passthrough" else 2]}
    if "weight" in spec.per_model:
        for m in data["models"]:
            m["parameters"] = {"weight": 1.0}
    if "t" in spec.globals_:
        data["parameters"] = {"t": 0.4}
    return data


@pytest.mark.parametrize("name", sorted(n for n, s in METHODS.items() if not isinstance(s, str)))
def test_every_mergekit_method_name_becomes_a_valid_clmerge_recipe(name):
    r = recipe_of(_minimal(name))
    method = get_method(r.method)
    check_hyperparameters(method, r.parameters, "parameters.")
    assert method.name == METHODS[name].target or name == "passthrough"


@pytest.mark.parametrize("name", sorted(n for n, s in METHODS.items() if isinstance(s, str)))
def test_a_mergekit_method_without_a_clmerge_equivalent_is_refused_by_name(name):
    with pytest.raises(ConfigError, match=rf"cfg.yml: mergekit config: merge_method: {name}: .*no clmerge"):
        recipe_of({"merge_method": name, "models": ["X"], "base_model": "B"}, "cfg.yml")


def test_mergekit_meanings_of_weight_lambda_normalize_density():
    w = [{"model": m, "parameters": {"weight": 0.5, "density": 0.4}} for m in ("X", "Y")]
    ta = recipe_of({"merge_method": "task_arithmetic", "base_model": "B", "models": w,
                    "parameters": {"lambda": 0.8}})
    assert (ta.method, ta.parameters) == ("task_arithmetic", {"scaling": pytest.approx(0.4)})  # weight x lambda
    dare = recipe_of({"merge_method": "dare_ties", "base_model": "B", "models": w})
    assert dare.method == "dare" and dare.parameters["combine"] == "ties"
    assert dare.parameters["drop_rate"] == pytest.approx(0.6) and dare.parameters["merge_fn"] == "sum"
    assert dare.parameters["rescale_rule"] == "l1"  # mergekit's rescale: true
    lin = recipe_of({"merge_method": "dare_linear", "base_model": "B", "models": w,
                     "parameters": {"normalize": True, "lambda": 3.0}})
    assert lin.parameters["scaling"] == pytest.approx(1.5)  # lambda / T: the normalised mean of 2 task vectors
    della = recipe_of({"merge_method": "della", "base_model": "B", "models": w, "parameters": {"epsilon": 0.1}})
    assert della.parameters == {"window": "mergekit", "merge_fn": "mean", "scaling": 1.0, "density": 0.4,
                                "epsilon": pytest.approx(0.2), "rescale": "l1"}
    bc = recipe_of({"merge_method": "breadcrumbs", "base_model": "B", "models": w})
    assert bc.parameters["beta"] == 0.01 and bc.parameters["density"] == 0.4
    kar = recipe_of({"merge_method": "karcher", "base_model": "B", "models": ["X", "Y"]})
    assert (kar.base, kar.parameters) == ("B", {"include_base": True, "max_iter": 10, "tol": 1e-5})
    lin = recipe_of({"merge_method": "linear", "models": [{"model": "X", "parameters": {"weight": 0.3}},
                                                          {"model": "Y", "parameters": {"weight": 0.7}}]})
    assert lin.method == "weight_average" and [m.parameters for m in lin.models] == [{"weight": 0.3}, {"weight": 0.7}]


REFUSED = [
    ({"modules": {}}, "modules: per-module"),
    ({"tokenizer": {"source": "union", "tokens": {"<x>": {"source": "X"}}}}, "tokenizer.tokens: per-token"),
    ({"tokenizer": {"source": "union", "pad_to_multiple_of": 64}}, "tokenizer.pad_to_multiple_of"),
    ({"chat_template": "chatml"}, "chat_template: 'chatml': clmerge takes the chat template of one of the inputs"),
    ({"merge_method": "della", "models": [{"model": "X", "parameters": {"weight": 1, "density": 0.3}},
                                          {"model": "Y", "parameters": {"weight": 1, "density": 0.5}}]},
     r"models\[1\].parameters.density: differs from models\[0\]'s"),
    ({"merge_method": "breadcrumbs_ties",
      "models": [{"model": "X", "parameters": {"weight": 1}}, {"model": "Y", "parameters": {"weight": 2}}]},
     r"models\[1\].parameters.weight: differs .* breadcrumbs_ties takes one weight"),
    ({"parameters": {"rescale": True}}, "parameters.rescale: mergekit's L1 rescale of ties"),
    ({"parameters": {"densty": 0.3}}, "parameters.densty: not a parameter of mergekit's ties"),
    ({"models": [{"model": "X+lora", "parameters": {"weight": 1}}]}, r"models\[0\].model: 'X\+lora': a model with a LoRA"),
    ({"merge_method": "teis"}, "merge_method: unknown mergekit method 'teis'"),
    ({"base_model": None}, "base_model: mergekit's ties needs a base_model"),
    ({"slices": [{"sources": [{"model": "X", "layer_range": [0, 2]}], "residual_weight": 0.5}], "models": None},
     r"slices\[0\].residual_weight"),
    ({"merge_method": "model_stock", "models": ["X", "Y"], "parameters": {"filter_wise": True}},
     "parameters.filter_wise: model_stock's filter_wise"),
    ({"merge_method": "model_stock", "models": [{"model": "X", "parameters": {"weight": 1}}, "Y"]},
     r"models\[0\].parameters.weight: not a per-model parameter of mergekit's model_stock"),
    ({"merge_method": "linear", "parameters": {"normalize": False}}, "parameters.normalize"),
    ({"dtype": "int8"}, "dtype: expected one of"),
    ({"random_key": 1}, "random_key: not a mergekit key"),
]


@pytest.mark.parametrize("change,words", REFUSED, ids=[w.split(":")[0][:30] for _, w in REFUSED])
def test_an_unsupported_key_is_refused_in_one_line_naming_the_file_and_the_key(change, words):
    data = _mk(models=[{"model": "X", "parameters": {"weight": 1}}, {"model": "Y", "parameters": {"weight": 1}}])
    data.update(change)
    data = {k: v for k, v in data.items() if v is not None or k == "base_model"}
    if data.get("base_model") is None:
        data.pop("base_model")
    with pytest.raises(ConfigError) as exc:
        recipe_of(data, "cfg.yml")
    msg = str(exc.value)
    assert msg.startswith("cfg.yml: mergekit config: ") and "\n" not in msg
    assert __import__("re").search(words, msg), msg


def test_aliases_name_their_method():
    assert get_method("linear").name == "weight_average" and get_method("ta").name == "task_arithmetic"
    r = recipe_of({"method": "dare_ties", "base": "B", "models": ["X"], "parameters": {"drop_rate": 0.3}})
    assert (r.method, r.parameters) == ("dare", {"combine": "ties", "drop_rate": 0.3})
    base = {"w": torch.zeros(3)}
    xs = [{"w": torch.ones(3)}, {"w": torch.full((3,), 3.0)}]
    assert torch.equal(merging.merge("linear", experts=xs)["w"], torch.full((3,), 2.0))
    assert torch.allclose(merging.merge("ta", base=base, experts=xs, scaling=0.5)["w"], torch.full((3,), 2.0))


@pytest.fixture()
def files(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(0)
    for name in ("base", "x", "y"):
        save_file({"lin.weight": torch.randn(4, 4, generator=g)}, str(tmp_path / f"{name}.safetensors"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_cli_method_linear_and_ta_run(files):
    res = CliRunner().invoke(app, ["merge", "--method", "linear", "--expert", "x.safetensors", "--expert",
                                   "y.safetensors", "--out", "lin.safetensors"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["merge", "--method", "ta", "--base", "base.safetensors", "--expert",
                                   "x.safetensors", "--out", "ta.safetensors"])
    assert res.exit_code == 0, res.output


def test_print_recipe_shows_what_a_mergekit_config_becomes_and_merges_nothing(files):
    (files / "mk.yml").write_text(yaml.safe_dump({
        "merge_method": "dare_ties", "base_model": "base.safetensors", "dtype": "bfloat16",
        "models": [{"model": m, "parameters": {"weight": 0.5, "density": 0.7}} for m in ("x.safetensors",
                                                                                       "y.safetensors")]}))
    res = CliRunner().invoke(app, ["merge", "mk.yml", "--print-recipe"])
    assert res.exit_code == 0, res.output
    printed = yaml.safe_load(res.stdout)
    assert printed["method"] == "dare" and printed["out_dtype"] == "bfloat16"
    assert printed["parameters"]["drop_rate"] == pytest.approx(0.3) and printed["parameters"]["scaling"] == 0.5
    assert recipe_of(printed).model_dump() == recipe_of(yaml.safe_load((files / "mk.yml").read_text())).model_dump()
    assert sorted(p.name for p in files.iterdir()) == ["base.safetensors", "mk.yml", "x.safetensors",
                                                       "y.safetensors"]
    res = CliRunner().invoke(app, ["merge", "mk.yml", "--out", "out.safetensors"])  # and it runs
    assert res.exit_code == 0, res.output


def test_a_refused_config_exits_2_in_one_line(files):
    (files / "mk.yml").write_text(yaml.safe_dump({"merge_method": "ram", "models": ["x.safetensors"]}))
    res = CliRunner().invoke(app, ["merge", "mk.yml", "--out", "o"])
    assert res.exit_code == 2 and "mk.yml: mergekit config: merge_method: ram" in res.output
    assert not (files / "o").exists()


# -- where a mergekit config follows mergekit -------------------------------------------------------------

def test_karcher_include_base_is_the_mean_with_the_base_as_one_more_point():
    g = torch.Generator().manual_seed(1)
    base, a, b = ({"w": torch.randn(6, 5, generator=g)} for _ in range(3))
    with_base = merging.merge("karcher", base=base, experts=[a, b], include_base=True)["w"]
    assert torch.allclose(with_base, merging.merge("karcher", experts=[base, a, b])["w"], atol=1e-6)
    ignored = merging.merge("karcher", base=base, experts=[a, b])["w"]  # clmerge's default: the base unused
    assert torch.equal(ignored, merging.merge("karcher", experts=[a, b])["w"])
    with pytest.raises(ValueError, match="include_base"):
        merging.merge("karcher", experts=[a, b], include_base=True)


def test_della_mergekit_window_is_mergekits_probabilities():
    # mergekit 0.1.5 mergekit/sparsify.py della_magprune (lines 160-170): ranks ascending by magnitude along
    # dim 1, normalised by (max - min) = n - 1, keep probability (density - e) + rank_norm * 2 e
    g = torch.Generator().manual_seed(2)
    tv = torch.randn(5, 11, generator=g)
    density, e = 0.6, 0.15
    ranks = tv.abs().argsort(dim=1).argsort(dim=1).double()
    keep = (density - e) + ranks / (tv.shape[1] - 1) * 2 * e
    got = magprune_drop_probabilities(tv, density, 2 * e, window="mergekit")
    assert torch.allclose(1 - got, keep, atol=1e-12)
    assert torch.equal(magprune_tensor(tv, 1.0, 0.3, generator=g, window="mergekit"), tv)  # density 1: kept


def test_della_l1_rescale_keeps_the_l1_norm_and_favours_large_magnitudes():
    # mergekit/sparsify.py rescaled_masked_tensor: masked * (|tensor|_1 / |masked|_1)
    g = torch.Generator().manual_seed(3)
    tv = torch.randn(1, 400, generator=g)
    out = magprune_tensor(tv, 0.5, 0.3, generator=g, window="mergekit", rescale="l1")
    assert float(out.abs().sum()) == pytest.approx(float(tv.abs().sum()), rel=1e-5)
    order = tv.abs().argsort(dim=1)[0]
    ratio = {"l1": torch.zeros(400), "paper": torch.zeros(400)}
    for mode in ratio:
        gen = torch.Generator().manual_seed(4)
        for _ in range(300):
            ratio[mode] += (magprune_tensor(tv, 0.5, 0.3, generator=gen, window="mergekit", rescale=mode)
                            / tv)[0] / 300
    small, large = order[:40], order[-40:]
    assert float(ratio["l1"][small].mean()) < 0.85 < 1.05 < float(ratio["l1"][large].mean())
    assert 0.9 < float(ratio["paper"][small].mean()) < 1.1 and 0.9 < float(ratio["paper"][large].mean()) < 1.1


@pytest.mark.parametrize("combine", ["task_arithmetic", "ties"])
def test_dare_l1_rescale_rule_keeps_each_task_vectors_l1_norm(combine):
    # mergekit 0.1.5 mergekit/sparsify.py bernoulli + rescaled_masked_tensor: masked * (|tv|_1 / |masked|_1)
    g = torch.Generator().manual_seed(6)
    base, x = {"w": torch.randn(8, 30, generator=g)}, {"w": torch.randn(8, 30, generator=g)}
    hp = {"drop_rate": 0.6, "scaling": 1.0, "combine": combine, "seed": 1}
    l1 = merging.merge("dare", base=base, experts=[x], rescale_rule="l1", **hp)["w"] - base["w"]
    paper = merging.merge("dare", base=base, experts=[x], **hp)["w"] - base["w"]
    tv = x["w"] - base["w"]
    assert float(l1.abs().sum()) == pytest.approx(float(tv.abs().sum()), rel=1e-5)
    assert torch.equal(l1 != 0, paper != 0)  # the same draws, only the rescale differs
    kept = paper != 0
    assert torch.allclose(paper[kept], tv[kept] / 0.4, atol=1e-5)
    with pytest.raises(ValueError, match="rescale_rule"):
        merging.merge("dare", base=base, experts=[x], rescale_rule="l2", **hp)


def test_slices_outer_tensors_slices_merges_the_non_layer_tensors(tmp_path):
    from safetensors.torch import load_file

    from clmerge.merging.run import run_merge

    g = torch.Generator().manual_seed(5)
    keys = ["model.embed_tokens.weight", "model.layers.0.mlp.weight", "model.layers.1.mlp.weight",
            "model.norm.weight", "lm_head.weight"]
    for name in ("a", "b"):
        save_file({k: torch.randn(4, 4, generator=g) for k in keys}, str(tmp_path / f"{name}.safetensors"))
    a, b = (str(tmp_path / f"{n}.safetensors") for n in "ab")
    recipe = {"method": "slerp", "base": a, "parameters": {"t": [0.25, 0.75]},
              "slices": [{"sources": [{"model": a, "layer_range": [0, 2]}, {"model": b, "layer_range": [0, 2]}]}]}
    for outer in (None, "slices"):
        r = recipe_of({**recipe, **({"outer_tensors": outer} if outer else {})})
        run_merge(r, tmp_path / f"out_{outer}", hash_inputs=False)
    copied, merged = (load_file(str(tmp_path / f"out_{o}" / "model.safetensors")) for o in (None, "slices"))
    sa, sb = load_file(a), load_file(b)
    for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(copied[k], sa[k])  # clmerge's default with a base: copied from it
        want = merging.merge("slerp", base={k: sa[k]}, experts=[{k: sb[k]}], t=0.25)[k]  # the gradient's first
        assert torch.allclose(merged[k], want, atol=1e-6)
    for k in keys[1:3]:
        assert torch.equal(copied[k], merged[k])
    with pytest.raises(ValueError, match="outer_tensors applies to slice recipes"):
        recipe_of({"method": "slerp", "base": a, "models": [b], "outer_tensors": "slices"})
