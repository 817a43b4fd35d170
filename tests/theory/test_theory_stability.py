"""The L2-stability probe (Definition 2 of Li, Tang et al., arXiv:2601.21690): several replaced indices and
seeds, exact zeros reported."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clmerge.theory import analysis
from clmerge.theory.jobs import _stability_terms, encode, stability_configs
from clmerge.theory.spec import Point, parse_study

DEFAULTS = {"steps": 4, "lr": 0.02, "batch_size": 8, "data_ratio": 1.0, "optimizer": "sgd", "n_experts": 2}


def _spec(**measure):
    return parse_study({"base": {"pretrained": False}, "suite": "tiny", "defaults": DEFAULTS,
                        "measure": {"noise_samples": 4, **measure}})


def _point(seed: int = 3) -> Point:
    return Point(**DEFAULTS, seed=seed, group=0, tasks=["digits:identity", "digits:rot90"],
                 method={"name": "averaging"})


def test_stability_configs_cover_every_index_and_seed():
    spec, p = _spec(stability_indices=[0, 5, 9], stability_seeds=2), _point()
    draws = stability_configs(spec, p)
    assert len(draws) == 2
    assert draws[0][0] == p.expert_configs(spec)[0][1]  # draw 0's original is the point's own first expert
    assert [orig.seed for orig, _ in draws] == [3, 1003]
    for orig, twins in draws:
        assert [t.perturb for t in twins] == [0, 5, 9] and {t.seed for t in twins} == {orig.seed}
        assert all(t.steps == orig.steps and t.lr == orig.lr for t in twins)


def test_default_probe_uses_several_indices_and_seeds():
    m = _spec().measure
    assert len(m.stability_indices) >= 3 and m.stability_seeds >= 2


def _expert(v: float) -> dict:
    return {"params": encode({"backbone.w": torch.full((2, 3), v), "head.b": torch.zeros(2)})}


def test_stability_terms_keep_exact_zeros_in_the_mean():
    first = {"w": torch.zeros(2, 3)}
    originals = [_expert(1.0)]
    twins = [_expert(0.0), _expert(2.0), _expert(1.0), _expert(3.0)]  # draw 0: 0, 24; draw 1: 0, 24
    rec = _stability_terms(first, originals, twins)
    assert rec["stability_pairs"] == [0.0, 24.0, 0.0, 24.0]
    assert rec["stability_zero"] == 2
    assert rec["stability_sq"] == pytest.approx(12.0)  # the on-average value: zeros are part of the mean


def _row(lr: float, pairs: list[float]) -> dict:
    return {"kind": "grid", "method": "averaging", **DEFAULTS, "lr": lr, "n_train": [40, 40],
            "stability_sq": sum(pairs) / len(pairs), "stability_pairs": pairs}


def test_analysis_reports_zero_pairs_and_all_zero_rows():
    rows = [_row(0.01, [0.0, 1.0, 1.0]), _row(0.02, [4.0, 4.0, 0.0]), _row(0.04, [16.0, 16.0, 16.0]),
            _row(0.08, [0.0, 0.0, 0.0])]
    stab = analysis._stability(rows, DEFAULTS, n_boot=20)
    lr = stab["lr"]
    assert lr["pairs"] == 12 and lr["zero_pairs"] == 5
    assert lr["zero_rows"] == 1 and lr["zero_row_x"] == [0.08]  # cannot enter a log fit: counted, not hidden
    assert lr["n"] == 3 and lr["x"] == [0.01, 0.02, 0.04]
    assert stab["pairs"] == 12 and stab["zero_pairs"] == 5
    # the fit is on the means with zeros included (2/3, 8/3, 16), not on the non-zero pairs only
    ref = np.polyfit(np.log([0.01, 0.02, 0.04]), np.log([2 / 3, 8 / 3, 16.0]), 1)[0]
    assert lr["slope"] == pytest.approx(ref, rel=1e-9)


def test_analysis_reads_rows_written_before_several_indices():
    rows = [{k: v for k, v in _row(lr, [v]).items() if k != "stability_pairs"}
            for lr, v in ((0.01, 1.0), (0.02, 0.0), (0.04, 16.0))]
    lr = analysis._stability(rows, DEFAULTS, n_boot=20)["lr"]
    assert lr["pairs"] == 3 and lr["zero_pairs"] == 1 and lr["zero_rows"] == 1
