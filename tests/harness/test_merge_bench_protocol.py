"""The merging benchmark's frozen-head protocol, grid extension and seed summary (tiny random-init ViT)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from clmerge.harness import merge_bench as bench
from clmerge.harness import merge_bench_experts as ex
from clmerge.harness.merge_bench_run import parse_seeds, run_merge_bench
from clmerge.harness.merge_bench_grid import next_value, search
from clmerge.harness.merge_bench_seeds import mean_se

TINY_ARCH = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}


def _cfg(**kw) -> bench.BenchConfig:
    return bench.BenchConfig(suite="tiny", pretrained=False, arch=TINY_ARCH, epochs=1, max_train=64, max_eval=48,
                             batch_size=32, heads="frozen", **kw)


@pytest.fixture(scope="module")
def digits():
    return bench.load_task(bench.parse_task("digits:rot90"), _cfg())


def _pretrained_features(cfg, x):
    return ex.features(bench.build_base(cfg), x)


@pytest.mark.parametrize("init", ["probe", "prototypes"])
def test_frozen_head_is_fitted_on_the_pretrained_backbone_and_not_trained(digits, init):
    cfg = _cfg(head_init=init)
    backbone, head = bench.split_expert(bench.train_expert(cfg, digits))
    x, y = digits["train"]
    feats = _pretrained_features(cfg, x)
    if init == "prototypes":  # direct transcription: W = class means, b = -||mu||^2 / 2
        mu = torch.stack([feats[y == c].mean(0) for c in range(10)])
        want = {"weight": mu, "bias": -0.5 * (mu * mu).sum(-1)}
    else:
        want = ex.fit_probe(feats, y, 10)
    for k in ("weight", "bias"):
        torch.testing.assert_close(head[k], want[k], rtol=1e-5, atol=1e-5)
    base = bench.build_base(cfg).state_dict()
    assert any(not torch.equal(backbone[k], base[k]) for k in base if base[k].is_floating_point())  # it trained


def test_probe_is_the_minimiser_of_its_objective(digits):
    """Stationarity of mean CE + (wd/2)||W||^2 at the returned probe (the gradient vanishes)."""
    x, y = digits["train"]
    feats = _pretrained_features(_cfg(), x)
    p = ex.fit_probe(feats, y, 10)
    w = p["weight"].double().requires_grad_()
    b = p["bias"].double().requires_grad_()
    loss = F.cross_entropy(feats.double() @ w.T + b, y) + 0.5 * ex.PROBE_WEIGHT_DECAY * (w * w).sum()
    gw, gb = torch.autograd.grad(loss, (w, b))
    assert float(gw.abs().max()) < 1e-3 and float(gb.abs().max()) < 1e-3
    assert float(p["weight"].abs().max()) > 0.1  # not the zero start (the objective is strictly convex)


def test_cache_keys_include_the_protocol():
    task = bench.parse_task("digits:rot90")
    frozen, probe = _cfg(head_init="prototypes"), _cfg()
    co = bench.BenchConfig(suite="tiny", pretrained=False, arch=TINY_ARCH, epochs=1, max_train=64, batch_size=32)
    digests = {bench.expert_digest(task, c) for c in (frozen, probe, co)}
    assert len(digests) == 3
    assert "heads" not in co.expert_key(task) and "head_init" not in co.expert_key(task)  # old names kept
    assert bench.expert_digest(task, _cfg(train_seed=0)) == bench.expert_digest(task, probe)  # same expert
    assert bench.expert_digest(task, _cfg(train_seed=1)) != bench.expert_digest(task, probe)
    with pytest.raises(ValueError, match="heads"):
        bench.BenchConfig(heads="joint")


@pytest.fixture(scope="module")
def frozen_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("frozen")
    cfg = _cfg()
    grids = {"weight_average": {}, "task_arithmetic": {"scaling": [0.3, 1.0]}}
    return out, cfg, bench.run_benchmark(cfg, out, grids=grids, log=lambda *_: None, analysis=False)


def test_reference_row_is_the_pretrained_backbone_with_the_task_heads(frozen_run):
    out, cfg, res = frozen_run
    want = []
    for t in bench.SUITES["tiny"]:
        d = bench.load_task(t, cfg)
        model = bench.build_base(cfg)
        head = ex.make_head(ex.fit_head(cfg, model, *d["train"], 10))
        want.append(bench.head_accuracy(model, head, *d["test"]))
    assert res["rows"]["pretrained"]["test"] == pytest.approx(want)
    r = res["rows"]["weight_average"]
    ind = res["rows"]["individual"]["test"]
    assert r["normalized"] == pytest.approx(100 * sum(a / i for a, i in zip(r["test"], ind)) / len(ind))
    md = (out / "results.md").read_text()
    assert "**frozen**" in md and "| pretrained backbone + task heads |" in md
    assert json.loads((out / "results.json").read_text())["grids"]["task_arithmetic"]["start"] == {"scaling": [0.3, 1.0]}


def test_grid_extension_makes_the_chosen_value_interior():
    calls = []

    def val(hp):  # a constructed validation curve peaked at scaling 2.2, flat in density
        calls.append(hp)
        return -(hp["scaling"] - 2.2) ** 2

    found = search({"scaling": [0.5, 1.0, 1.5], "density": [0.2]}, val)
    assert found["best"] == {"scaling": 2.0, "density": 0.2}
    assert found["grid"]["scaling"] == [0.5, 1.0, 1.5, 2.0, 2.5]  # arithmetic grid, step 0.5, one past the peak
    assert found["edges"] == {"scaling": "interior", "density": "fixed"}
    assert len(calls) == len({json.dumps(c, sort_keys=True) for c in calls}) == 5  # every point once
    # geometric grid extended downward by its ratio; a rank ratio stops at the domain's edge 1.0
    low = search({"rank_ratio": [0.04, 0.08, 0.16]}, lambda hp: -abs(math.log(hp["rank_ratio"] / 0.011)))
    assert low["grid"]["rank_ratio"] == [0.005, 0.01, 0.02, 0.04, 0.08, 0.16] and low["best"]["rank_ratio"] == 0.01
    top = search({"rank_ratio": [0.25, 0.5, 0.75]}, lambda hp: hp["rank_ratio"])
    assert top["grid"]["rank_ratio"] == [0.25, 0.5, 0.75, 1.0] and top["edges"]["rank_ratio"] == "domain-high"
    capped = search({"scaling": [1.0, 2.0]}, lambda hp: hp["scaling"], max_extensions=2)
    assert capped["grid"]["scaling"] == [1.0, 2.0, 3.0, 4.0] and capped["edges"]["scaling"] == "high"
    # an irregular grid uses its edge spacing; a step below an open bound halves the distance to it
    assert next_value([0.5, 1.0, 1.5, 2.0, 3.0], True, (0.0, math.inf, False, False)) == 4.0
    assert next_value([0.5, 1.0, 1.5, 2.0, 3.0], False, (0.0, math.inf, False, False)) == 0.25
    # an open upper bound (DARE's drop rate < 1) is approached, never reached, even when a step lands on it
    assert next_value([0.5, 0.9], True, (0.0, 1.0, True, False)) == 0.95
    assert next_value([0.5, 0.9, 0.95], True, (0.0, 1.0, True, False)) == 0.975


def test_seeds_summary_and_cotrained_protocol(tmp_path):
    res = run_merge_bench(tmp_path, suite="tiny", epochs=1, max_train=48, max_eval=32, random_init=True,
                          methods=["weight_average"], heads="cotrained", seeds=[0, 1], log=lambda *_: None)
    per = [json.loads((tmp_path / f"seed{s}" / "results.json").read_text()) for s in (0, 1)]
    assert [p["config"]["heads"] for p in per] == ["cotrained", "cotrained"]
    avgs = [p["rows"]["weight_average"]["avg"] for p in per]
    assert res["rows"]["weight_average"]["avg"] == pytest.approx(mean_se(avgs))
    assert res["rows"]["weight_average"]["seeds"] == [0, 1]
    assert "co-trained" in (tmp_path / "results.md").read_text()
    m, se = mean_se([1.0, 2.0, 4.0])  # sample sd sqrt(7/3), n = 3
    assert m == pytest.approx(7 / 3) and se == pytest.approx(math.sqrt(7 / 3) / math.sqrt(3))
    assert parse_seeds("0,1,2") == [0, 1, 2]
    for bad in ("0,x", "1,1", ""):
        with pytest.raises(ValueError, match="--seeds"):
            parse_seeds(bad)


def test_summary_claims_are_paired_differences_over_seeds(tmp_path):
    from clmerge.harness.merge_bench_seeds import summarise

    cart, wa, ta = [50.0, 52.0, 51.0], [48.0, 49.0, 50.0], [51.0, 50.0, 52.0]
    curves = [[48.0, 47.0, 53.0, 50.0, 48.0], [49.0, 50.0, 54.0, 52.0, 49.0], [50.0, 49.0, 52.0, 51.0, 50.0]]
    for s in range(3):
        rows = {"weight_average": {"avg": wa[s], "normalized": 90.0, "hp": {}},
                "task_arithmetic": {"avg": ta[s], "normalized": 91.0, "hp": {"scaling": 0.3}},
                "cart": {"avg": cart[s], "normalized": 92.0, "hp": {"scaling": 2.0}}}
        if s == 2:
            del rows["task_arithmetic"]  # a seed without a row: summarised over the seeds that have it
        run = {"config": {"seed": 0, "heads": "frozen", "head_init": "probe"}, "tasks": ["a"], "rows": rows,
               "analysis": {"rank_ratio": {"ratios": [0.0, 0.04, 0.08, 0.16, 1.0], "cart": curves[s]}}}
        (tmp_path / f"seed{s}").mkdir()
        (tmp_path / f"seed{s}" / "results.json").write_text(json.dumps(run))
    out = summarise(tmp_path, [0, 1, 2])
    c = out["claims"]
    assert c["cart_minus_weight_average"]["mean_se"] == pytest.approx(mean_se([2.0, 3.0, 1.0]))
    assert c["cart_minus_task_arithmetic"]["seeds"] == [0, 1]
    assert c["cart_minus_task_arithmetic"]["mean_se"] == pytest.approx(mean_se([-1.0, 2.0]))
    assert c["bell"]["peak_ratio"] == 0.08  # mean interior curve 48.7, 53.0, 51.0
    assert c["bell"]["per_seed"] == pytest.approx([53 - 48, 54 - 49, 52 - 50])
    assert out["rows"]["task_arithmetic"]["seeds"] == [0, 1]
    md = (tmp_path / "results.md").read_text()
    assert "CART − weight averaging: +2.0 ± 0.6" in md and "holds" in md


def test_a_seed_whose_grid_stopped_at_an_older_cap_is_rerun(tmp_path):
    from dataclasses import asdict

    from clmerge.harness.merge_bench import BenchConfig
    from clmerge.harness.merge_bench_run import _done

    cfg, grids = BenchConfig(suite="tiny"), {"cart": {"scaling": [1.0, 2.0]}}

    def write(chosen_at, cap=None):
        g = {"start": grids["cart"], "final": [1.0, 2.0], "chosen_at": chosen_at}
        if cap is not None:
            g["max_extensions"] = cap
        (tmp_path / "results.json").write_text(json.dumps({"config": asdict(cfg), "grids": {"cart": g}}))

    write({"scaling": "interior"})  # settled: the cap does not matter, whatever it was
    assert _done(tmp_path, cfg, grids, 12)
    write({"scaling": "high"})  # stopped at the old default cap of 4 (no cap recorded)
    assert not _done(tmp_path, cfg, grids, 12) and _done(tmp_path, cfg, grids, 4)
    write({"scaling": "high"}, cap=12)
    assert _done(tmp_path, cfg, grids, 12)
    assert not _done(tmp_path, cfg, {"cart": {"scaling": [1.0, 3.0]}}, 12)  # other start grid


def test_svd_family_claims_are_paired_and_equivalence_needs_a_narrow_interval(tmp_path):
    from clmerge.harness.merge_bench_seeds import summarise

    ta, tsv, cart, iso = [50.0, 51.0, 52.0], [55.0, 57.0, 56.0], [55.2, 56.9, 56.1], [49.0, 52.0, 50.0]
    for s in range(3):
        rows = {"task_arithmetic": {"avg": ta[s], "normalized": 90.0, "hp": {}},
                "tsv_m": {"avg": tsv[s], "normalized": 95.0, "hp": {}},
                "iso_cts": {"avg": iso[s], "normalized": 89.0, "hp": {}},
                "cart": {"avg": cart[s], "normalized": 95.0, "hp": {}}}
        (tmp_path / f"seed{s}").mkdir()
        (tmp_path / f"seed{s}" / "results.json").write_text(json.dumps(
            {"config": {"seed": 0, "heads": "frozen", "head_init": "probe"}, "tasks": ["a"], "rows": rows}))
    c = summarise(tmp_path, [0, 1, 2])["claims"]
    assert c["tsv_m_minus_task_arithmetic"]["per_seed"] == pytest.approx([5.0, 6.0, 4.0])
    assert c["cart_minus_tsv_m"]["mean_se"] == pytest.approx(mean_se([0.2, -0.1, 0.1]))
    assert "iso_c_minus_task_arithmetic" not in c  # no iso_c row in any seed
    md = (tmp_path / "results.md").read_text()
    assert "TSV-M > task arithmetic: TSV-M − task arithmetic = +5.0 ± 0.6" in md
    assert "Iso-CTS > task arithmetic: Iso-CTS − task arithmetic = -0.7 ± 0.9" in md and "not resolved" in md
    assert "CART ≈ TSV-M: CART − TSV-M = +0.1 ± 0.1 points" in md and "holds (the 2-standard-error interval" in md


def test_equivalence_verdicts():
    from clmerge.harness.merge_bench_seeds import _equivalence

    assert _equivalence((0.1, 0.2)).startswith("holds")
    assert _equivalence((0.5, 0.4)).startswith("not resolved")  # interval (-0.3, 1.3) includes 0, passes +1
    assert _equivalence((3.0, 0.5)).startswith("does not hold")
    assert _equivalence((0.0, float("nan"))).startswith("one seed")
