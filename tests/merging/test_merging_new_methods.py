"""SLERP, Model Stock, Breadcrumbs and DELLA against transcriptions of their papers' equations, plus the
identities the papers imply."""

from __future__ import annotations

import math

import pytest
import torch

from clmerge import merging
from clmerge.merging.methods.dare import dare_generator
from clmerge.merging.methods.sparse_family import magprune_drop_probabilities, magprune_tensor

from merging_helpers import float_keys, make_models


def close(a, b, atol=1e-6):
    for k in b:
        torch.testing.assert_close(a[k].double(), b[k].double(), atol=atol, rtol=1e-5, msg=k)


# ---------------------------------------------------------------- SLERP
def slerp_reference(t, v0, v1):
    """Shoemake's formula on the flattened tensors, written out with the normalised copies for the angle."""
    a, b = v0.double().reshape(-1), v1.double().reshape(-1)
    an, bn = a / a.norm(), b / b.norm()
    dot = float((an * bn).sum())
    if abs(dot) > 0.9995:
        out = (1 - t) * a + t * b
    else:
        om = math.acos(dot)
        out = math.sin((1 - t) * om) / math.sin(om) * a + math.sin(t * om) / math.sin(om) * b
    return out.reshape(v0.shape)


@pytest.mark.parametrize("t", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_slerp_matches_shoemake_and_endpoints(t):
    base, ex = make_models(1, seed=0, scale=1.0)
    out = merging.slerp(base=base, experts=ex, t=t)
    close(out, {k: slerp_reference(t, base[k], ex[0][k]) for k in float_keys(base)})
    assert torch.equal(out["buf.index"], base["buf.index"])
    if t in (0.0, 1.0):
        end = base if t == 0.0 else ex[0]
        for k in float_keys(base):
            assert torch.equal(out[k], end[k]), k
    # two experts and no base: the same, with experts[0] as t = 0
    close(merging.merge("slerp", experts=[base, ex[0]], t=t), out, atol=0)


def test_slerp_stays_on_the_great_circle():
    """Unit vectors at angle Omega: the result has norm 1 and makes the angle t*Omega with v0."""
    v0 = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    v1 = torch.tensor([math.cos(1.2), math.sin(1.2), 0.0], dtype=torch.float64)
    out = merging.slerp(experts=[{"w": v0}, {"w": v1}], t=0.3)["w"]
    assert abs(float(out.norm()) - 1.0) < 1e-12
    assert abs(math.acos(float(out @ v0)) - 0.36) < 1e-12


def test_slerp_falls_back_to_linear_for_colinear_and_zero_tensors():
    v0 = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
    for v1 in (2.0 * v0, -3.0 * v0, torch.zeros(2, 2)):
        out = merging.slerp(experts=[{"w": v0}, {"w": v1}], t=0.4)["w"]
        torch.testing.assert_close(out, 0.6 * v0 + 0.4 * v1)


def test_slerp_refuses_other_than_two_models_and_bad_t():
    base, ex = make_models(2)
    with pytest.raises(ValueError, match="exactly two models"):
        merging.slerp(base=base, experts=ex)
    with pytest.raises(ValueError, match=r"t must be in \[0, 1\], got 1.5"):
        merging.slerp(base=base, experts=ex[:1], t=1.5)


# ---------------------------------------------------------------- Model Stock
def model_stock_reference(base, ex, key):
    w0 = base[key].double().reshape(-1)
    ws = [e[key].double().reshape(-1) for e in ex]
    n = len(ws)
    cosines = [torch.nn.functional.cosine_similarity(ws[i] - w0, ws[j] - w0, dim=0)
               for i in range(n) for j in range(i + 1, n)]
    cos = float(sum(cosines) / len(cosines))
    t = n * cos / (1 + (n - 1) * cos)
    return (t * sum(ws) / n + (1 - t) * w0).reshape(base[key].shape)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_model_stock_eq3_per_layer(n):
    g = torch.Generator().manual_seed(n)
    base, ex = make_models(n, seed=n)
    shared = {k: torch.randn(v.shape, generator=g) for k, v in base.items() if v.is_floating_point()}
    for e in ex:  # a common direction, so the angles are well inside (0, 90) degrees
        for k in shared:
            e[k] = e[k] + 0.2 * shared[k]
    out = merging.model_stock(base=base, experts=ex)
    close(out, {k: model_stock_reference(base, ex, k) for k in float_keys(base)})


def test_model_stock_identities():
    base, ex = make_models(1, seed=4)
    same = [ex[0], {k: v.clone() for k, v in ex[0].items()}, ex[0]]
    close(merging.model_stock(base=base, experts=same), ex[0], atol=1e-6)  # cos = 1: t = 1
    w0 = {"w": torch.zeros(3)}
    orth = [{"w": torch.tensor([1.0, 0.0, 0.0])}, {"w": torch.tensor([0.0, 2.0, 0.0])}]
    assert torch.equal(merging.model_stock(base=w0, experts=orth)["w"], torch.zeros(3))  # cos = 0: t = 0
    opposed = [{"w": torch.tensor([1.0, 2.0, 0.0])}, {"w": torch.tensor([-1.0, -2.0, 0.0])}]
    assert torch.equal(merging.model_stock(base=w0, experts=opposed)["w"], torch.zeros(3))  # 1 + cos = 0: base
    with pytest.raises(ValueError, match="at least 2 experts"):
        merging.model_stock(base=base, experts=ex)


# ---------------------------------------------------------------- Breadcrumbs
def breadcrumbs_reference(base, ex, density, beta, scaling):
    out = {}
    for k in float_keys(base):
        acc = torch.zeros(base[k].numel(), dtype=torch.float64)
        for e in ex:
            tv = (e[k].double() - base[k].double()).reshape(-1)
            n = tv.numel()
            n_keep = math.floor(density * n + 0.5)
            n_top = min(math.floor(beta * n + 0.5), n - n_keep)
            order = sorted(range(n), key=lambda i: (-abs(float(tv[i])), i))
            mask = torch.zeros(n, dtype=torch.float64)
            mask[order[n_top:n_top + n_keep]] = 1.0
            acc += mask * tv
        out[k] = (base[k].double().reshape(-1) + scaling * acc).reshape(base[k].shape)
    return out


@pytest.mark.parametrize("density, beta", [(0.3, 0.1), (0.5, 0.05), (0.2, 0.0), (0.9, 0.3)])
def test_breadcrumbs_matches_transcription(density, beta):
    base, ex = make_models(3, seed=5)
    out = merging.breadcrumbs(base=base, experts=ex, density=density, beta=beta, scaling=0.7)
    close(out, breadcrumbs_reference(base, ex, density, beta, 0.7))


def test_breadcrumbs_identity_and_exact_counts_under_ties():
    base, ex = make_models(3, seed=6)
    close(merging.breadcrumbs(base=base, experts=ex, density=1.0, beta=0.0, scaling=0.4),
          merging.task_arithmetic(base=base, experts=ex, scaling=0.4), atol=1e-6)
    g = torch.Generator().manual_seed(0)
    zero = {"w": torch.zeros(50, 40, dtype=torch.bfloat16)}
    tied = {"w": ((torch.randint(1, 4, (50, 40), generator=g) * 2 - 5).float() / 32).to(torch.bfloat16)}
    out = merging.breadcrumbs(base=zero, experts=[tied], density=0.25, beta=0.02, scaling=1.0)["w"]
    assert int((out != 0).sum()) == 500  # round(0.25 * 2000), with thousands of equal magnitudes
    ref = breadcrumbs_reference(zero, [tied], 0.25, 0.02, 1.0)["w"]
    assert torch.equal(out.double(), ref)


# ---------------------------------------------------------------- DELLA
def test_magprune_probabilities_follow_the_rank_formula():
    tv = torch.tensor([[0.3, -0.1, 0.3, 0.0, -0.7], [1.0, 2.0, -3.0, 0.5, 0.25]])
    density, eps, n = 0.6, 0.3, 5
    p = magprune_drop_probabilities(tv, density, eps)
    p_min = (1 - density) - eps * (n - 1) / (2 * n)
    for i in range(2):
        order = sorted(range(n), key=lambda j: (-abs(float(tv[i, j])), j))  # rank 0: largest magnitude
        for r, j in enumerate(order):
            assert abs(float(p[i, j]) - (p_min + eps * r / n)) < 1e-12
        assert abs(float(p[i].mean()) - (1 - density)) < 1e-12
    one_d = magprune_drop_probabilities(tv.reshape(-1), density, eps)  # a 1-D tensor is one row of 10
    assert abs(float(one_d.max() - one_d.min()) - eps * 9 / 10) < 1e-12


def test_magprune_is_unbiased():
    """E[tau~] = tau: keep with probability 1 - p_i, rescale by 1 / (1 - p_i)."""
    tv = torch.tensor([[0.3, -0.1, 0.2, 0.05], [1.0, -2.0, 0.5, 0.25]])
    draws = torch.stack([magprune_tensor(tv, 0.4, 0.4, generator=torch.Generator().manual_seed(s))
                         for s in range(4000)])
    torch.testing.assert_close(draws.mean(0), tv, atol=0.06 * float(tv.abs().max()), rtol=0.0)


def test_della_with_zero_epsilon_is_dare_ties():
    base, ex = make_models(3, seed=7)
    for density in (0.3, 0.7):
        a = merging.della(base=base, experts=ex, density=density, epsilon=0.0, scaling=0.9, seed=3)
        b = merging.dare(base=base, experts=ex, drop_rate=1.0 - density, combine="ties", density=1.0,
                         scaling=0.9, seed=3)
        close(a, b, atol=1e-6)


def test_della_elect_and_fuse_transcription():
    base, ex = make_models(3, seed=8)
    out = merging.della(base=base, experts=ex, density=0.5, epsilon=0.4, scaling=0.8, seed=1)
    ref = {}
    for k in float_keys(base):
        pruned = torch.stack([magprune_tensor(e[k].float() - base[k].float(), 0.5, 0.4,
                                              generator=dare_generator(1, k, t)) for t, e in enumerate(ex)]).double()
        gamma = torch.sign(pruned.sum(0))
        agree = (torch.sign(pruned) == gamma) & (pruned != 0)
        fused = (pruned * agree).sum(0) / agree.sum(0).clamp(min=1)
        ref[k] = base[k].double() + 0.8 * fused
    close(out, ref, atol=1e-5)


def test_della_refuses_a_window_outside_0_1():
    base, ex = make_models(2)
    with pytest.raises(ValueError, match="epsilon must be in"):
        merging.della(base=base, experts=ex, density=0.9, epsilon=0.3)


@pytest.mark.parametrize("name, hp", [("ties", {"trim_scope": "per_tensor", "density": 0.6}), ("ties", {}),
                                      ("breadcrumbs", {}), ("della", {}), ("model_stock", {}), ("slerp", {})])
def test_scalar_empty_and_3d_tensors(name, hp):
    g = torch.Generator().manual_seed(9)
    base = {"s": torch.tensor(1.0), "e": torch.zeros(0, 3), "c": torch.randn(2, 3, 4, generator=g)}
    ex = [{k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(3)]
    out = merging.merge(name, base=base, experts=ex[:1] if name == "slerp" else ex, **hp)
    for k, v in base.items():
        assert out[k].shape == v.shape and torch.isfinite(out[k]).all(), k
