"""TIES with one density and one weight per expert (a recipe's per-model ``density`` / ``weight``, mergekit's
per-model values): against a hand-written trim of each expert at its own density followed by TIES's sign
election and disjoint merge, against a transcription of mergekit's weighted consensus, and the translation of
mergekit's ``ties.yml`` (per-model gradients and filters) key by key."""

from __future__ import annotations

import pytest
import torch
import yaml

from clmerge import merging
from clmerge.merging.methods.hparams import method_hparams, per_model_params
from clmerge.merging.methods.registry import get_method
from clmerge.merging.recipes import key_groups, recipe_of

from bench_helpers import load_bench

SHAPES = {"a.weight": (12, 10), "a.bias": (12,), "b.weight": (7, 9)}


def _inputs(num: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    base = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    experts = [{k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(num)]
    return base, experts


def _top(tv: torch.Tensor, density: float) -> torch.Tensor:
    """``tv`` with all but its ``round(density * n)`` largest magnitudes zeroed (distinct magnitudes here)."""
    k = int(density * tv.numel() + 0.5)
    keep = torch.zeros(tv.numel(), dtype=torch.bool)
    keep[tv.reshape(-1).abs().argsort(descending=True)[:k]] = True
    return tv * keep.reshape(tv.shape)


def _elect_mean(trimmed: torch.Tensor) -> torch.Tensor:
    """TIES (Yadav et al. 2023, Alg. 1) on trimmed task vectors ``(T, ...)``: gamma = sgn(sum), the mean of the
    entries whose sign is gamma (no zero sums here)."""
    gamma = torch.sign(trimmed.sum(0))
    agree = torch.sign(trimmed) == gamma
    return (trimmed * agree).sum(0) / agree.sum(0).clamp(min=1)


def test_per_tensor_densities_are_each_experts_own_trim_then_ties():
    base, experts = _inputs()
    dens = [0.7, 0.3, 0.5]
    got = merging.merge("ties", base=base, experts=experts, densities=dens, trim_scope="per_tensor", scaling=0.8)
    for k in SHAPES:
        trimmed = torch.stack([_top(e[k] - base[k], d) for e, d in zip(experts, dens)])
        torch.testing.assert_close(got[k], base[k] + 0.8 * _elect_mean(trimmed), rtol=0, atol=1e-6)


def test_global_densities_trim_each_whole_task_vector_at_its_own_density():
    base, experts = _inputs(seed=1)
    dens = [0.2, 0.6, 0.2]
    got = merging.merge("ties", base=base, experts=experts, densities=dens, trim_scope="global")
    keys = list(SHAPES)
    flat = [torch.cat([(e[k] - base[k]).reshape(-1) for k in keys]) for e in experts]
    trimmed = torch.stack([_top(f, d) for f, d in zip(flat, dens)])
    want = _elect_mean(trimmed)
    pos = 0
    for k in keys:
        n = base[k].numel()
        torch.testing.assert_close(got[k], base[k] + want[pos:pos + n].reshape(base[k].shape), rtol=0, atol=1e-6)
        pos += n


@pytest.mark.parametrize("scope", ["per_tensor", "global"])
@pytest.mark.parametrize("rule", ["exact", "threshold"])
def test_equal_densities_and_unit_weights_are_the_single_density_merge_bit_for_bit(scope, rule):
    base, experts = _inputs(seed=2)
    one = merging.merge("ties", base=base, experts=experts, density=0.4, trim_scope=scope, trim_rule=rule)
    per = merging.merge("ties", base=base, experts=experts, densities=[0.4] * 3, trim_scope=scope, trim_rule=rule)
    unit = merging.merge("ties", base=base, experts=experts, density=0.4, trim_scope=scope, trim_rule=rule,
                         weights=[1.0, 1.0, 1.0])
    for k in SHAPES:
        assert torch.equal(per[k], one[k]) and torch.equal(unit[k], one[k]), k


@pytest.mark.parametrize("scope", ["per_tensor", "global"])
@pytest.mark.parametrize("rule", ["exact", "threshold"])
def test_the_streamed_kernel_and_the_weighted_path_agree_with_a_density_one_expert(scope, rule):
    base, experts = _inputs(seed=5)
    dens = [1.0, 0.5, 0.3]
    streamed = merging.merge("ties", base=base, experts=experts, densities=dens, trim_scope=scope, trim_rule=rule)
    weighted = merging.merge("ties", base=base, experts=experts, densities=dens, weights=[1.0] * 3,
                             trim_scope=scope, trim_rule=rule)
    for k in SHAPES:
        assert torch.equal(streamed[k], weighted[k]), k


def _mergekit_consensus(deltas: torch.Tensor, weights: list[float], normalize: bool) -> torch.Tensor:
    """mergekit 0.1.5's GeneralizedTaskArithmeticMerge.merge_group after sparsification, transcribed
    (mergekit/merge_methods/generalized_task_arithmetic.py, lines 117-144, and get_mask, lines 148-172,
    method "sum"): deltas times their weights, the majority sign of their sum (a zero sum: +), the agreeing
    entries summed, divided by the sum of the agreeing weights (a zero sum: 1) when normalize."""
    w = torch.tensor(weights, dtype=deltas.dtype).reshape(-1, *([1] * (deltas.dim() - 1)))
    deltas = deltas * w
    majority = (deltas.sum(0) >= 0).to(deltas.dtype) * 2 - 1
    mask = (deltas.sign() == majority).to(deltas.dtype)
    mixed = (deltas * mask).sum(0)
    divisor = (w * mask).sum(0)
    divisor[divisor == 0] = 1
    return mixed / divisor if normalize else mixed


@pytest.mark.parametrize("merge_fn,normalize", [("mean", True), ("sum", False)])
def test_weights_are_mergekits_weighted_consensus(merge_fn, normalize):
    base, experts = _inputs(seed=3)
    dens, weights = [1.0, 0.5, 0.33], [1.0, 0.3, 0.5]
    got = merging.merge("ties", base=base, experts=experts, densities=dens, weights=weights, merge_fn=merge_fn,
                        trim_scope="per_tensor", scaling=1.0)
    for k in SHAPES:
        trimmed = torch.stack([_top(e[k] - base[k], d) for e, d in zip(experts, dens)])
        want = base[k] + _mergekit_consensus(trimmed, weights, normalize)
        torch.testing.assert_close(got[k], want, rtol=0, atol=1e-6)


def test_a_zero_weight_leaves_its_expert_out():
    base, experts = _inputs(seed=4)
    got = merging.merge("ties", base=base, experts=experts, density=0.5, weights=[1.0, 0.0, 1.0],
                        trim_scope="per_tensor")
    two = merging.merge("ties", base=base, experts=[experts[0], experts[2]], density=0.5, trim_scope="per_tensor")
    for k in SHAPES:
        torch.testing.assert_close(got[k], two[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("hp,words", [({"densities": [0.5, 0.5]}, "one value per expert"),
                                      ({"densities": [0.5, 0.0, 0.3]}, r"in \(0, 1\]"),
                                      ({"weights": [1.0, float("nan"), 1.0]}, "finite")])
def test_bad_per_expert_values_are_refused_in_one_line(hp, words):
    base, experts = _inputs()
    with pytest.raises(ValueError, match=words):
        merging.merge("ties", base=base, experts=experts, **hp)


# -- mergekit's ties.yml --------------------------------------------------------------------------------------

LLAMA_KEYS = [f"model.layers.{i}.{m}" for i in range(5) for m in
              ("self_attn.q_proj.weight", "mlp.up_proj.weight", "input_layernorm.weight")]
KEYS = ["model.embed_tokens.weight", *LLAMA_KEYS, "model.norm.weight", "lm_head.weight"]


def _mergekit_setting(name: str, setting, t: float):
    """mergekit 0.1.5's evaluate_setting (mergekit/config.py): a number, a gradient at ``t``, or the first
    ``{filter, value}`` whose filter is a substring of the name."""
    if isinstance(setting, (int, float)):
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


def test_mergekits_ties_yml_gives_each_model_its_own_density_and_weight_on_every_key():
    examples = load_bench("merging", "mergekit_configs_vs_mergekit").EXAMPLES
    data = yaml.safe_load((examples / "ties.yml").read_text())
    r = recipe_of(data)
    assert r.method == "ties" and r.parameters["merge_fn"] == "mean" and r.parameters["trim_scope"] == "per_tensor"
    method = get_method("ties")
    hps = method_hparams(method)
    per_model = per_model_params(method, hps, r.models)
    got = {}
    for hp, keys in key_groups(KEYS, {**r.parameters, **per_model}, r.overrides, {"weights", "densities"}):
        got.update({k: (hp["densities"], hp["weights"]) for k in keys})
    for key in KEYS:
        t = int(key.split(".")[2]) / 4 if ".layers." in key else 0.0
        for i, m in enumerate(data["models"]):
            p = m["parameters"]
            assert got[key][0][i] == pytest.approx(_mergekit_setting(key, p["density"], t)), (key, i)
            assert got[key][1][i] == pytest.approx(_mergekit_setting(key, p["weight"], t)), (key, i)


def test_filters_of_several_models_combine_by_which_filters_match():
    models = [{"model": "X", "parameters": {"weight": [{"filter": "mlp", "value": 0.2}, {"filter": "layers.1",
                                                                                         "value": 0.4},
                                                       {"value": 1.0}], "density": 0.5}},
              {"model": "Y", "parameters": {"weight": [{"filter": "layers.1", "value": 3.0}, {"value": 2.0}],
                                           "density": 0.5}}]
    r = recipe_of({"merge_method": "ties", "base_model": "B", "models": models})
    method = get_method("ties")
    per_model = per_model_params(method, method_hparams(method), r.models)
    for hp, keys in key_groups(KEYS, {**r.parameters, **per_model}, r.overrides, {"weights", "densities"}):
        for key in keys:
            want = [_mergekit_setting(key, m["parameters"]["weight"], 0.0) for m in models]
            assert hp["weights"] == pytest.approx(want), key


# -- DARE with a drop rate and a weight per expert (mergekit's dare_linear / dare_ties per-model values) --------

def _dropped(base, experts, key, rates, seed=0):
    """Each expert's DARE task vector of ``key``: its own rate, the masks of (seed, key, expert index)."""
    from clmerge.merging.methods.dare import dare_generator, dare_tensor

    return torch.stack([dare_tensor(e[key] - base[key], p, rescale=True, generator=dare_generator(seed, key, t))
                        for t, (e, p) in enumerate(zip(experts, rates))])


def test_dare_linear_per_expert_rates_and_weights_are_the_weighted_sum_of_each_experts_drop():
    base, experts = _inputs(seed=6)
    rates, weights = [0.2, 0.5, 0.7], [1.0, 0.4, -0.3]
    got = merging.merge("dare", base=base, experts=experts, drop_rates=rates, weights=weights, scaling=0.9)
    for k in SHAPES:
        tv = _dropped(base, experts, k, rates)
        want = base[k] + 0.9 * sum(w * t for w, t in zip(weights, tv))
        torch.testing.assert_close(got[k], want, rtol=0, atol=1e-6)


def test_dare_ties_per_expert_weights_are_mergekits_weighted_consensus():
    base, experts = _inputs(seed=7)
    rates, weights = [0.3, 0.5, 0.1], [1.0, 0.3, 0.5]
    got = merging.merge("dare", base=base, experts=experts, drop_rates=rates, weights=weights, combine="ties",
                        density=1.0, merge_fn="sum", scaling=1.0)
    for k in SHAPES:
        want = base[k] + _mergekit_consensus(_dropped(base, experts, k, rates), weights, normalize=False)
        torch.testing.assert_close(got[k], want, rtol=0, atol=1e-6)


def test_a_dare_ties_config_with_per_model_density_and_weight_becomes_drop_rates_and_weights():
    models = [{"model": "X", "parameters": {"density": 0.6, "weight": 0.4}},
              {"model": "Y", "parameters": {"density": [0.3, 0.7], "weight": [{"filter": "mlp", "value": 0.2},
                                                                               {"value": 0.6}]}}]
    r = recipe_of({"merge_method": "dare_ties", "base_model": "B", "models": models})
    method = get_method(r.method)
    per_model = per_model_params(method, method_hparams(method), r.models)
    for hp, keys in key_groups(KEYS, {**r.parameters, **per_model}, r.overrides, {"weights", "drop_rates"}):
        for key in keys:
            t = int(key.split(".")[2]) / 4 if ".layers." in key else 0.0
            dens = [_mergekit_setting(key, m["parameters"]["density"], t) for m in models]
            assert hp["drop_rates"] == pytest.approx([1 - d for d in dens]), key
            assert hp["weights"] == pytest.approx([_mergekit_setting(key, m["parameters"]["weight"], t)
                                                   for m in models]), key
    with pytest.raises(Exception, match="normalize: true with per-model weights"):
        recipe_of({"merge_method": "dare_linear", "base_model": "B", "models": models,
                   "parameters": {"normalize": True}})
