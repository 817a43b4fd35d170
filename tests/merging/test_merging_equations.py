"""Every merge method against a direct transcription of its equation, plus the identities the papers imply."""

from __future__ import annotations

import math

import pytest
import torch

from clmerge import merging
from clmerge.merging.methods.lowrank import target_rank

from merging_helpers import flat, float_keys, make_models

MATS = ("blk.fc1.weight", "blk.fc2.weight")


def close(a, b, atol=1e-6):
    for k in b:
        torch.testing.assert_close(a[k].double(), b[k].double(), atol=atol, rtol=1e-5, msg=k)


def svd_k(m: torch.Tensor, k: int) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(m.double(), full_matrices=False)
    return u[:, :k] @ torch.diag(s[:k]) @ vh[:k]


def test_weight_average_eq1():
    base, ex = make_models(3)
    out = merging.weight_average(experts=ex)
    close(out, {k: sum(e[k].double() for e in ex) / 3 for k in float_keys(base)})
    w = merging.weight_average(experts=ex, weights=[1, 2, 3])
    close(w, {k: sum(c * e[k].double() for c, e in zip([1, 2, 3], ex)) / 6 for k in float_keys(base)})
    assert torch.equal(out["buf.index"], base["buf.index"])


def test_task_arithmetic_eq2_and_identity_with_average():
    base, ex = make_models(4)
    out = merging.task_arithmetic(base=base, experts=ex, scaling=0.7)
    close(out, {k: base[k] + 0.7 * sum(e[k].double() - base[k] for e in ex) for k in float_keys(base)})
    close(merging.task_arithmetic(base=base, experts=ex, scaling=0.25), merging.weight_average(experts=ex))


def exact_top_mask(row, density):
    """The ``floor(density*d + 0.5)`` largest ``|row|``, ties to the lower index (plain Python sort)."""
    d = row.numel()
    k = math.floor(density * d + 0.5)
    keep = sorted(range(d), key=lambda i: (-abs(float(row[i])), i))[:k]
    mask = torch.zeros(d, dtype=torch.bool)
    mask[keep] = True
    return mask


def ties_reference(base, ex, density, scaling, rule="threshold"):
    """TIES on the flattened whole model (the original code's formulation; ``rule="exact"``: exactly
    ``round(density*d)`` entries kept, ties broken by flat index)."""
    keys = float_keys(base)
    tv = torch.stack([flat(e, keys) - flat(base, keys) for e in ex]).float()  # (T, d)
    d = tv.shape[1]
    if rule == "exact":
        trimmed = (tv * torch.stack([exact_top_mask(row, density) for row in tv])).double()
    else:
        kth = tv.abs().kthvalue(d - int(d * density), dim=1, keepdim=True).values if density < 1 \
            else torch.zeros(1, 1)
        trimmed = (tv * (tv.abs() >= kth)).double()
    sign = torch.sign(trimmed.sum(0))
    sign[sign == 0] = torch.sign(sign.sum())
    agree = torch.where(sign > 0, trimmed > 0, trimmed < 0)
    merged = (trimmed * agree).sum(0) / agree.sum(0).clamp(min=1)
    vec = flat(base, keys) + scaling * merged
    out, pos = {}, 0
    for k in keys:
        n = base[k].numel()
        out[k] = vec[pos:pos + n].reshape(base[k].shape)
        pos += n
    return out


@pytest.mark.parametrize("rule", ["exact", "threshold"])
@pytest.mark.parametrize("density", [0.1, 0.2, 0.5, 1.0])
def test_ties_matches_flattened_reference(density, rule):
    base, ex = make_models(4, seed=1)
    close(merging.ties(base=base, experts=ex, density=density, scaling=0.8, trim_rule=rule),
          ties_reference(base, ex, density, 0.8, rule))


@pytest.mark.parametrize("rule", ["exact", "threshold"])
def test_ties_per_tensor_scope_trims_each_tensor(rule):
    base, ex = make_models(3, seed=2)
    out = merging.ties(base=base, experts=ex, density=0.3, scaling=1.0, trim_scope="per_tensor", trim_rule=rule)
    for k in float_keys(base):
        ref = ties_reference({k: base[k]}, [{k: e[k]} for e in ex], 0.3, 1.0, rule)
        close({k: out[k]}, ref)


def test_dare_drop_zero_is_task_arithmetic_and_masks_follow_equation():
    base, ex = make_models(3)
    close(merging.dare(base=base, experts=ex, drop_rate=0.0, scaling=0.4),
          merging.task_arithmetic(base=base, experts=ex, scaling=0.4), atol=1e-5)
    p = 0.5
    out = merging.dare(base=base, experts=ex, drop_rate=p, scaling=1.0, seed=3)
    again = merging.dare(base=base, experts=ex, drop_rate=p, scaling=1.0, seed=3)
    close(out, again, atol=0)
    # each entry of the merged vector is sum_t m_t tau_t / (1 - p) for some 0/1 masks m_t
    k = "blk.fc1.weight"
    tv = torch.stack([e[k].double() - base[k] for e in ex])
    got = out[k].double() - base[k]
    combos = torch.stack([(tv * torch.tensor(bits, dtype=torch.float64).view(-1, 1, 1)).sum(0) / (1 - p)
                          for bits in [(a, b, c) for a in (0, 1) for b in (0, 1) for c in (0, 1)]])
    assert ((combos - got).abs().amin(0) < 1e-5).all()
    norescale = merging.dare(base=base, experts=ex, drop_rate=p, rescale=False, scaling=1.0, seed=3)
    torch.testing.assert_close(norescale[k].double() - base[k], got * (1 - p), atol=1e-5, rtol=1e-5)


def test_dare_ties_with_no_drop_is_ties_sign_election():
    base, ex = make_models(3, seed=4)
    close(merging.dare(base=base, experts=ex, drop_rate=0.0, combine="ties", density=0.3, scaling=1.0),
          merging.ties(base=base, experts=ex, density=0.3, scaling=1.0), atol=1e-5)


def test_consensus_eq7():
    base, ex = make_models(4, seed=5)
    lam, k = 0.4, 2
    out = merging.consensus(base=base, experts=ex, k=k, tall_lambda=lam, scaling=0.5)
    for key in float_keys(base):
        tv = [e[key].double() - base[key] for e in ex]
        multi = sum(tv)
        votes = sum((t.abs() > lam * (multi - t).abs()).long() for t in tv)
        ref = base[key] + 0.5 * multi * (votes >= k)
        torch.testing.assert_close(out[key].double(), ref, atol=1e-6, rtol=1e-5)
    close(merging.consensus(base=base, experts=ex, k=0, scaling=0.5),
          merging.task_arithmetic(base=base, experts=ex, scaling=0.5))


def test_tall_mask_ties_is_masked_ties_vector():
    base, ex = make_models(3, seed=6)
    t = merging.ties(base=base, experts=ex, density=0.4, scaling=0.9)
    out = merging.tall_mask_ties(base=base, experts=ex, task=1, density=0.4, scaling=0.9, tall_lambda=0.5)
    for k in float_keys(base):
        multi = t[k].double() - base[k]
        tau = ex[1][k].double() - base[k]
        ref = base[k] + multi * (tau.abs() > 0.5 * (multi - tau).abs())
        torch.testing.assert_close(out[k].double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["sum", "mean_per_tensor"])
def test_emr_eqs(mode):
    base, ex = make_models(3, seed=7)
    keys = float_keys(base)
    tvs = {k: torch.stack([e[k].double() - base[k] for e in ex]) for k in keys}
    uni = {}
    for k, tv in tvs.items():
        sign = torch.sign(tv.sum(0))
        uni[k] = sign * torch.stack([torch.where(t * sign > 0, t.abs(), 0.0) for t in tv]).amax(0)
    red = torch.sum if mode == "sum" else torch.mean
    for task in range(3):
        num = sum(red(tvs[k][task].abs()) for k in keys)
        den = sum(red((uni[k] * (tvs[k][task] * uni[k] > 0)).abs()) for k in keys)
        out = merging.emr_merging(base=base, experts=ex, task=task, rescale_mode=mode)
        for k in keys:
            ref = base[k] + num / den * uni[k] * (tvs[k][task] * uni[k] > 0)
            torch.testing.assert_close(out[k].double(), ref, atol=1e-6, rtol=1e-5)


def test_fisher_merging_eq4():
    base, ex = make_models(3, seed=8)
    g = torch.Generator().manual_seed(0)
    fishers = [{k: torch.rand(base[k].shape, generator=g) for k in MATS} for _ in ex]
    out = merging.fisher_merging(experts=ex, fishers=fishers, min_fisher=0.0)
    for k in MATS:
        num = sum(f[k].double() * e[k] for f, e in zip(fishers, ex))
        torch.testing.assert_close(out[k].double(), num / sum(f[k].double() for f in fishers), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out["blk.fc1.bias"].double(), sum(e["blk.fc1.bias"].double() for e in ex) / 3)
    uniform = [{k: torch.ones(base[k].shape) for k in MATS} for _ in ex]
    close(merging.fisher_merging(experts=ex, fishers=uniform), merging.weight_average(experts=ex))


def test_regmean_is_least_squares():
    base, ex = make_models(3, seed=9)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(20, 5, generator=g, dtype=torch.float64) for _ in ex]
    grams = [{"blk.fc1.weight": x.T @ x} for x in xs]
    out = merging.regmean(experts=ex, grams=grams, alpha=1.0)
    # argmin_W sum_t ||X_t W^T - X_t W_t^T||^2 by lstsq on the stacked system
    a = torch.cat(xs)
    b = torch.cat([x @ e["blk.fc1.weight"].double().T for x, e in zip(xs, ex)])
    ref = torch.linalg.lstsq(a, b).solution.T
    torch.testing.assert_close(out["blk.fc1.weight"].double(), ref, atol=1e-5, rtol=1e-5)
    # alpha = 0 keeps only the diagonal: a per-input-column weighted average
    out0 = merging.regmean(experts=ex, grams=grams, alpha=0.0)
    d = [torch.diagonal(x.T @ x) for x in xs]
    ref0 = sum(dd * e["blk.fc1.weight"].double() for dd, e in zip(d, ex)) / sum(d)
    torch.testing.assert_close(out0["blk.fc1.weight"].double(), ref0, atol=1e-5, rtol=1e-5)


def test_gram_matrices_hook():
    lin = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    x = torch.randn(7, 5)
    grams = merging.gram_matrices(lin, [(x, None)])
    torch.testing.assert_close(grams["0.weight"], (x.T @ x).double(), atol=1e-5, rtol=1e-5)
    h = torch.relu(lin[0](x)).detach()
    torch.testing.assert_close(grams["2.weight"], (h.T @ h).double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ratio", [0.2, 0.5])
def test_cart_eq4(ratio):
    base, ex = make_models(3, seed=10)
    out = merging.cart(experts=ex, rank_ratio=ratio, scaling=1.7)
    for k in float_keys(base):
        avg = sum(e[k].double() for e in ex) / 3
        if k in MATS:
            r = min(base[k].shape)
            kk = math.ceil(ratio * r)
            ref = avg + 1.7 * sum(svd_k(e[k].double() - avg, kk) for e in ex)
        else:
            ref = avg
        torch.testing.assert_close(out[k].double(), ref, atol=1e-5, rtol=1e-5, msg=k)


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_cart_rank_zero_and_full_is_average(ratio):
    base, ex = make_models(4, seed=11)
    close(merging.cart(experts=ex, rank_ratio=ratio, scaling=2.5), merging.weight_average(experts=ex), atol=1e-5)


def test_cart_ranks_and_rounding():
    assert target_rank((768, 3072), 0.08) == 62
    assert target_rank((768, 3072), 0.08, "floor") == 61
    assert target_rank((10, 10), 0.0, "floor") == 0 and target_rank((10, 10), 0.01, "floor") == 1
    assert target_rank((10, 10), 1.0) == 10 == target_rank((10, 10), 1.0, "floor")


def test_cart_randomized_close_to_exact_on_low_rank_vectors():
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(40, 30, generator=g)
    ex = [{"w.weight": mean + torch.randn(40, 3, generator=g) @ torch.randn(3, 30, generator=g)} for _ in range(4)]
    exact = merging.cart(experts=ex, rank_ratio=0.1, svd="exact")
    rnd = merging.cart(experts=ex, rank_ratio=0.1, svd="randomized", seed=1)
    torch.testing.assert_close(rnd["w.weight"], exact["w.weight"], atol=1e-4, rtol=1e-4)


def test_cart_indexing_formula():
    base, ex = make_models(3, seed=12)
    out = merging.cart_indexing(experts=ex, task=2, rank_ratio=0.4)
    k = "blk.fc1.weight"
    avg = sum(e[k].double() for e in ex) / 3
    ref = avg + svd_k(ex[2][k].double() - avg, math.ceil(0.4 * 5))
    torch.testing.assert_close(out[k].double(), ref, atol=1e-5, rtol=1e-5)
    close(merging.cart_indexing(experts=ex, task=2, rank_ratio=1.0), {kk: ex[2][kk] for kk in MATS}, atol=1e-5)


def test_low_rank_ta():
    base, ex = make_models(3, seed=13)
    out = merging.low_rank_task_arithmetic(base=base, experts=ex, rank_ratio=0.4, scaling=0.5)
    k = "blk.fc2.weight"
    ref = base[k] + 0.5 * sum(svd_k(e[k].double() - base[k], 2) for e in ex)
    torch.testing.assert_close(out[k].double(), ref, atol=1e-5, rtol=1e-5)
    zero = merging.low_rank_task_arithmetic(base=base, experts=ex, rank_ratio=0.0, non_matrix="base")
    close(zero, base)
    full = merging.low_rank_task_arithmetic(base=base, experts=ex, rank_ratio=1.0, scaling=0.5)
    close(full, merging.task_arithmetic(base=base, experts=ex, scaling=0.5), atol=1e-5)
