"""Measured terms of the bound (Li, Tang et al., arXiv:2601.21690): L2 stability, heterogeneity,
sparsification, implicit weights; the study spec."""

from __future__ import annotations

import pytest
import torch

from clmerge.config import ConfigError
from clmerge.harness.merge_bench import BenchConfig, init_expert, load_task, parse_task, split_expert, train_expert
from clmerge.theory import quantities as q
from clmerge.theory.spec import expand_points, parse_study

TINY = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}


def _cfg(**kw) -> BenchConfig:
    base = dict(suite="custom", pretrained=False, arch=TINY, max_train=48, max_eval=16, batch_size=8, steps=6,
                optimizer="sgd", lr=0.05, seed=0)
    return BenchConfig(**(base | kw))


def _expert(cfg: BenchConfig) -> dict[str, torch.Tensor]:
    task = parse_task("digits:identity")
    return split_expert(train_expert(cfg, load_task(task, cfg)))[0]


def test_stability_is_zero_for_identical_datasets_and_positive_for_a_perturbed_one():
    a, b = _expert(_cfg()), _expert(_cfg())
    assert q.squared_distance(a, b) == 0.0
    twin = _expert(_cfg(perturb=0))
    assert q.squared_distance(a, twin) > 0.0


def test_perturbation_replaces_exactly_one_training_sample():
    task = parse_task("digits:identity")
    x0, _ = load_task(task, _cfg())["train"]
    x1, _ = load_task(task, _cfg(perturb=3))["train"]
    changed = (x0 != x1).flatten(1).any(1)
    assert changed.tolist() == [i == 3 for i in range(len(x0))]


def test_new_bench_options_keep_old_cache_keys():
    old = BenchConfig(suite="tiny", epochs=1)
    assert set(old.expert_key(parse_task("digits")).keys()) == {
        "task", "backbone", "pretrained", "arch", "epochs", "lr", "batch_size", "max_train", "val_fraction", "seed"}
    assert "data_ratio" in BenchConfig(data_ratio=0.5).expert_key(parse_task("digits"))


def test_data_ratio_and_steps():
    task = parse_task("digits:identity")
    assert len(load_task(task, _cfg(data_ratio=0.25))["train"][1]) == 12
    cfg = _cfg(steps=7, batch_size=100)  # 7 steps over a 48-sample set: 7 batches across several epochs
    from clmerge.harness.merge_bench import index_batches

    assert len(list(index_batches(48, cfg, torch.Generator().manual_seed(0)))) == 7


def test_gradient_noise_and_heterogeneity():
    cfg = _cfg()
    data = load_task(parse_task("digits:identity"), cfg)
    backbone, head = init_expert(cfg, 10)
    x, y = data["train"]
    mean, s2 = q.gradient_stats(backbone, head, x[:12], y[:12], chunk=5)
    assert s2 > 0
    same, s2_same = q.gradient_stats(backbone, head, x[:1].repeat(4, 1, 1, 1), y[:1].repeat(4))
    assert s2_same == pytest.approx(0.0, abs=1e-6 * s2)
    assert q.heterogeneity([mean, mean]) == [0.0, 0.0]
    z = q.heterogeneity([mean, same])
    assert z[0] == pytest.approx(z[1]) and z[0] > 0


def _tvs() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"w": torch.randn(40, 30, generator=g, dtype=torch.float64), "b": torch.randn(30, generator=g,
                                                                                         dtype=torch.float64)}
            for _ in range(3)]


def test_dispersion_and_sparsification_operators():
    tvs = _tvs()
    assert q.dispersion([tvs[0]] * 3) == pytest.approx(0.0, abs=1e-20)
    manual = sum(((tvs[i]["w"] - sum(t["w"] for t in tvs) / 3) ** 2).sum() + ((tvs[i]["b"] - sum(t["b"] for t in tvs) / 3)
                 ** 2).sum() for i in range(3)) / 3
    assert q.dispersion(tvs) == pytest.approx(float(manual))
    ties = q.ties_operator(tvs, density=0.2)
    kept = sum(int((t["w"] != 0).sum() + (t["b"] != 0).sum()) for t in ties)
    assert 0 < kept <= 3 * int(0.2 * 1230) + 3
    assert q.dispersion(ties) < q.dispersion(tvs)
    dense = q.ties_operator(tvs, density=1.0)  # sign election only: disagreeing entries are zeroed
    assert all(((d["w"] == 0) | (d["w"] == t["w"])).all() for d, t in zip(dense, tvs))
    dare = q.dare_operator(tvs, 0.5, rescale=False, seed=1)  # float32 masks, as merging.dare
    assert all(((d["w"] == 0) | (d["w"] == t["w"].float().double())).all() for d, t in zip(dare, tvs))
    assert 0.3 < float((dare[0]["w"] == 0).double().mean()) < 0.7


def test_implicit_weights_recover_a_known_combination():
    tvs = _tvs()
    avg = {k: (1 * tvs[0][k] + 2 * tvs[1][k] + 5 * tvs[2][k]) / 3 for k in tvs[0]}
    assert q.implicit_weights(avg, tvs) == pytest.approx([1 / 8, 2 / 8, 5 / 8])
    assert q.predicted_weights([10, 30]) == [0.25, 0.75]


def test_spec_errors_name_the_nearest_key():
    with pytest.raises(ConfigError, match="did you mean 'defaults'"):
        parse_study({"defualts": {}})
    with pytest.raises(ConfigError, match="did you mean 'batch_size'"):
        parse_study({"grid": {"batchsize": [1]}})
    with pytest.raises(ConfigError, match="unknown option 'densty'"):
        parse_study({"methods": [{"name": "ties", "densty": 0.1}]})
    with pytest.raises(ConfigError, match="exceeds"):
        expand_points(parse_study({"suite": "tiny", "grid": {"n_experts": [5]}}))


def test_one_at_a_time_expansion_and_shared_groups():
    spec = parse_study({"suite": "8", "grid": {"lr": [0.01, 0.1], "n_experts": [2, 3]}, "seeds": [0, 1], "groups": 2,
                        "methods": [{"name": "averaging"}, {"name": "ties"}]})
    pts = expand_points(spec)
    # settings: defaults (lr 0.01, N 3), lr=0.1, N=2 -> 3 settings x 2 seeds x 2 groups x 2 methods
    assert len(pts) == 24 and len({p.id for p in pts}) == 24
    assert {p.varied for p in pts} == {None, "lr", "n_experts"}
    by = {(p.varied, p.seed, p.group): p.tasks for p in pts}
    assert by[(None, 0, 1)] == by[("lr", 1, 1)]  # same groups across settings and seeds (paired)
    assert len(by[("n_experts", 0, 0)]) == 2
