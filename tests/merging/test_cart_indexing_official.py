"""CART-Indexing against a transcription of the official pipeline (an audit fix).

The official code (JH-GEECS/CART, ``src/merging.py``) builds task vectors tau_t = theta_t - theta_0, the origin
theta_avg = theta_0 + (1/T) sum_t tau_t, and per task a vector that is SVD_k(tau_t + theta_0 - theta_avg) for
the truncated matrices and the full tau_t + theta_0 - theta_avg for every other tensor; ``apply_to`` then adds
``prior`` times that vector to theta_avg. Rank k = max(1, int(gamma * min(m, n))).
"""

from __future__ import annotations

import pytest
import torch

from clmerge import merging

from merging_helpers import float_keys, make_models

MATS = ("blk.fc1.weight", "blk.fc2.weight")


def _official_indexing(base, experts, task: int, gamma: float, prior: float) -> dict[str, torch.Tensor]:
    taus = [{k: e[k].double() - base[k].double() for k in float_keys(base)} for e in experts]
    origin = {k: base[k].double() + sum(t[k] for t in taus) / len(taus) for k in float_keys(base)}
    out = {}
    for k in float_keys(base):
        vec = taus[task][k] + base[k].double() - origin[k]
        if gamma == 0.0:  # the code zeroes U, s, V^T of matrices and the vector of every other tensor
            vec = torch.zeros_like(vec)
        elif k in MATS:
            u, s, vh = torch.linalg.svd(vec, full_matrices=False)
            dim = max(1, int(gamma * s.shape[0]))
            vec = (u[:, :dim] * s[:dim]) @ vh[:dim]
        out[k] = origin[k] + prior * vec
    return out


@pytest.mark.parametrize("gamma,prior", [(0.4, 1.0), (0.4, 1.7), (0.0, 1.3)])
def test_cart_indexing_matches_the_official_pipeline(gamma, prior):
    base, ex = make_models(4, seed=21)
    got = merging.cart_indexing(experts=ex, task=1, rank_ratio=gamma, scaling=prior, rounding="floor",
                                include=r"fc\d\.weight$")
    ref = _official_indexing(base, ex, 1, gamma, prior)
    for k in ref:
        torch.testing.assert_close(got[k].double(), ref[k], atol=1e-5, rtol=1e-5, msg=k)


def test_cart_indexing_average_option_keeps_the_plain_average():
    base, ex = make_models(3, seed=22)
    got = merging.cart_indexing(experts=ex, task=0, rank_ratio=0.4, scaling=1.5, non_matrix="average")
    for k in ("blk.fc1.bias", "norm.weight", "embeddings.position_embeddings"):
        avg = sum(e[k].double() for e in ex) / 3
        torch.testing.assert_close(got[k].double(), avg, atol=1e-6, rtol=1e-6, msg=k)
    # the default rebuilds the task's own non-matrix values at lambda = 1
    own = merging.cart_indexing(experts=ex, task=0, rank_ratio=0.4)
    torch.testing.assert_close(own["blk.fc1.bias"].double(), ex[0]["blk.fc1.bias"].double(), atol=1e-6, rtol=1e-6)


def test_cart_indexing_rejects_unknown_non_matrix_rule():
    _, ex = make_models(2)
    with pytest.raises(ValueError, match="non_matrix"):
        merging.cart_indexing(experts=ex, non_matrix="base")
