"""Analysis tools: spectra, the row-space interference measure (spec §2.6), R(k), straight-line paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clmerge import merging
from clmerge.merging.methods import analysis

from merging_helpers import make_models


def ik_reference(vecs, k):
    """The k x k reading of CART Eq. (5), written out with plain loops (I_kxk)."""
    tot = 0.0
    S = []
    for t in vecs:
        _, s, vt = np.linalg.svd(t, full_matrices=False)
        S.append((s / np.linalg.norm(s), vt))
    for i in range(len(S)):
        for j in range(len(S)):
            if i != j:
                A = S[i][0][:k, None] * S[i][1][:k]
                B = S[j][0][:k, None] * S[j][1][:k]
                tot += np.linalg.norm(A @ B.T)
    return tot


def shared_task_vectors(shared, T=6, m=24, n=20, r=3, seed=0):
    rng = np.random.default_rng(seed)
    c = rng.normal(size=(m, r)) @ rng.normal(size=(r, n)) / np.sqrt(r)
    return [shared * c + rng.normal(size=(m, r)) @ rng.normal(size=(r, n)) / np.sqrt(r) + 0.05 * rng.normal(size=(m, n))
            for _ in range(T)]


@pytest.mark.parametrize("k", [1, 3, 8])
def test_interference_matches_spec_reference(k):
    vecs = shared_task_vectors(1.0)
    got = analysis.row_space_interference([torch.tensor(v) for v in vecs], k)
    assert got == pytest.approx(ik_reference(vecs, k), rel=1e-9)


def test_centering_lowers_interference_with_a_shared_component():
    vecs = shared_task_vectors(3.0)
    mu = sum(vecs) / len(vecs)
    orig = analysis.row_space_interference([torch.tensor(v) for v in vecs], 3)
    cent = analysis.row_space_interference([torch.tensor(v - mu) for v in vecs], 3)
    assert cent < 0.6 * orig


def test_reconstruction_error_and_spectra():
    base, ex = make_models(3, seed=1)
    k = "blk.fc1.weight"
    tv = [e[k].double() - base[k].double() for e in ex]
    s = torch.linalg.svdvals(torch.stack(tv))
    assert analysis.reconstruction_error(tv, 2) == pytest.approx(float(s[:, 2:].pow(2).sum()))
    assert analysis.reconstruction_error(tv, 5) == pytest.approx(0.0, abs=1e-20)
    spec = analysis.task_vector_spectra(base=base, experts=ex)
    assert set(spec) == {"blk.fc1.weight", "blk.fc2.weight"}
    torch.testing.assert_close(spec[k], s)
    cspec = analysis.task_vector_spectra(experts=ex, centered=True)
    avg = sum(e[k].double() for e in ex) / 3
    torch.testing.assert_close(cspec[k], torch.linalg.svdvals(torch.stack([e[k].double() - avg for e in ex])))
    curves = analysis.interference_curves(base=base, experts=ex, ks=[1, 2, 100])
    assert set(curves[k]) == {"I_centered", "I_original", "R_centered", "R_original"}
    assert curves[k]["R_original"][-1] == pytest.approx(0.0, abs=1e-20)


def test_loss_along_line_and_rank_curve():
    base, ex = make_models(2, seed=2)
    pts = analysis.loss_along_line(ex[0], ex[1], lambda p: float(p["norm.weight"].double().sum()), [0.0, 0.5, 1.0])
    assert pts[0][1] == pytest.approx(float(ex[0]["norm.weight"].double().sum()), rel=1e-6)
    assert pts[2][1] == pytest.approx(float(ex[1]["norm.weight"].double().sum()), rel=1e-6)
    mid = merging.weight_average(experts=ex)
    assert pts[1][1] == pytest.approx(float(mid["norm.weight"].double().sum()), rel=1e-6)
    dist = lambda p: float(sum((p[k].double() - mid[k].double()).norm() for k in mid if p[k].is_floating_point()))
    # two experts: the centered vectors are d and -d and SVD_k(-d) = -SVD_k(d), so CART is averaging at every rank
    curve = analysis.rank_ratio_curve(experts=ex, evaluate=dist, ratios=[0.0, 0.4, 1.0], scaling=2.0)
    assert all(v == pytest.approx(0.0, abs=1e-5) for _, v in curve)
    base3, ex3 = make_models(3, seed=2)
    mid = merging.weight_average(experts=ex3)
    curve = analysis.rank_ratio_curve(experts=ex3, evaluate=dist, ratios=[0.0, 0.4, 1.0], scaling=2.0)
    assert curve[0][1] == pytest.approx(0.0, abs=1e-5) and curve[2][1] == pytest.approx(0.0, abs=1e-5)
    assert curve[1][1] > 1e-3
