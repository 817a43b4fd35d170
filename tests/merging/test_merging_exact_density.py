"""Exact density: a magnitude trim keeps exactly ``round(density * n)`` entries, ties broken by key order then
flat index, for TIES (global and per-tensor), DARE+TIES and Breadcrumbs; the old threshold rule stays selectable."""

from __future__ import annotations

import math

import pytest
import torch

from clmerge import merging
from clmerge.merging.methods.sources import ModelSet
from clmerge.merging.methods.ties import global_trim, plain_task_vectors
from clmerge.merging.methods.trim import TIE_ALL, add_ties, keep_count, top_magnitude_mask

SHAPES = {"a.weight": (40, 30), "a.bias": (30,), "b.weight": (17, 13), "c.scale": (5,)}


def tie_heavy(n_experts: int, seed: int, dtype=torch.bfloat16, shapes=SHAPES):
    """A zero base and experts whose entries are ``j/64``, ``j`` in ``{-4..4} \\ {0}``: thousands of exact ties,
    no zero delta (so a kept entry is always visible in the output), every value exact in bf16."""
    g = torch.Generator().manual_seed(seed)
    base = {k: torch.zeros(s, dtype=dtype) for k, s in shapes.items()}
    ex = []
    for _ in range(n_experts):
        e = {}
        for k, s in shapes.items():
            j = torch.randint(1, 5, s, generator=g) * (2 * torch.randint(0, 2, s, generator=g) - 1)
            e[k] = (j.float() / 64).to(dtype)
        ex.append(e)
    return base, ex


def reference_mask(values: torch.Tensor, density: float) -> torch.Tensor:
    """Transcription of the rule: sort by (-|x|, position), keep the first ``floor(density*n + 0.5)``."""
    n = values.numel()
    k = math.floor(density * n + 0.5)
    order = sorted(range(n), key=lambda i: (-abs(float(values[i])), i))[:k]
    mask = torch.zeros(n, dtype=torch.bool)
    mask[order] = True
    return mask


def cat(sd):
    return torch.cat([sd[k].reshape(-1).float() for k in SHAPES])


@pytest.mark.parametrize("density", [0.1, 0.2, 0.35, 0.5])
def test_global_exact_density_keeps_round_density_n_on_bf16_ties(density):
    base, ex = tie_heavy(1, seed=0)
    out = merging.ties(base=base, experts=ex, density=density, scaling=1.0)  # one expert: tau_m = trimmed tau
    kept = cat(out) != 0
    total = kept.numel()
    assert int(kept.sum()) == math.floor(density * total + 0.5)
    assert torch.equal(kept, reference_mask(cat(ex[0]), density))  # key order, then flat index
    old = cat(merging.ties(base=base, experts=ex, density=density, scaling=1.0, trim_rule="threshold")) != 0
    mags = cat(ex[0]).abs()
    thr = mags.kthvalue(total - int(density * total)).values
    assert int(old.sum()) == int((mags >= thr).sum())  # the threshold rule keeps every tie at the threshold
    if density < 0.5:
        assert int(old.sum()) > int(kept.sum()) + 50


@pytest.mark.parametrize("density", [0.1, 0.2, 0.35])
def test_per_tensor_exact_density_keeps_round_density_n_per_key(density):
    base, ex = tie_heavy(1, seed=1)
    out = merging.ties(base=base, experts=ex, density=density, scaling=1.0, trim_scope="per_tensor")
    for k in SHAPES:
        kept = out[k].reshape(-1) != 0
        assert int(kept.sum()) == math.floor(density * kept.numel() + 0.5), k
        assert torch.equal(kept, reference_mask(ex[0][k].reshape(-1).float(), density)), k


@pytest.mark.parametrize("scope", ["global", "per_tensor"])
def test_exact_trim_is_deterministic_and_independent_of_the_other_experts(scope):
    base, ex = tie_heavy(3, seed=2)
    first = merging.ties(base=base, experts=ex, density=0.2, trim_scope=scope, merge_fn="sum")
    again = merging.ties(base=base, experts=ex, density=0.2, trim_scope=scope, merge_fn="sum")
    for k in SHAPES:
        assert torch.equal(first[k], again[k])
    # expert 0's trim alone equals its trim inside the 3-expert merge: masks of a 3-expert merge via global_trim
    if scope == "global":
        thr, quotas = global_trim(ModelSet(base, ex), 0.2, plain_task_vectors)
        for t, e in enumerate(ex):
            masks = [add_ties(e[k].float().abs() > thr[t], e[k].float().abs(), thr[t], quotas[k][t]) for k in SHAPES]
            kept = torch.cat([m.reshape(-1) for m in masks])
            assert torch.equal(kept, reference_mask(cat(e), 0.2)), t


@pytest.mark.parametrize("density", [0.05, 0.2, 0.5])
def test_global_exact_quotas_on_a_model_larger_than_the_sample(density):
    """Above the sampling size the threshold comes from the streamed bracket pass; the tie quotas it hands to
    the keys still give exactly ``round(density * n)`` entries, the first ties in key order."""
    shapes = {"m.weight": (600, 500), "m.bias": (500,), "n.weight": (300, 7)}
    base, ex = tie_heavy(2, seed=3, dtype=torch.float32, shapes=shapes)
    thr, quotas = global_trim(ModelSet(base, ex), density, plain_task_vectors)
    for t, e in enumerate(ex):
        mags = torch.cat([e[k].reshape(-1).abs() for k in shapes])
        k_keep = math.floor(density * mags.numel() + 0.5)
        want = torch.zeros(mags.numel(), dtype=torch.bool)
        want[torch.sort(-mags, stable=True).indices[:k_keep]] = True  # stable: ties keep their position order
        got = torch.cat([add_ties(e[k].abs() > thr[t], e[k].abs(), thr[t], quotas[k][t]).reshape(-1)
                         for k in shapes])
        assert int(got.sum()) == k_keep
        assert torch.equal(got, want)
        assert sum(q > 0 for q in (quotas[k][t] for k in shapes)) <= 1  # one partly kept key at most


def test_streamed_and_buffered_global_passes_agree():
    """DARE with no drop goes through the buffered (one-model) threshold pass; TIES through the streamed
    one: the same exact trim, hence the same merge."""
    base, ex = tie_heavy(3, seed=4, dtype=torch.float32)
    for density in (0.1, 0.3):
        a = merging.ties(base=base, experts=ex, density=density, scaling=1.0)
        b = merging.dare(base=base, experts=ex, drop_rate=0.0, combine="ties", density=density, scaling=1.0)
        for k in SHAPES:
            torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0, msg=k)


def test_tall_mask_ties_uses_the_exact_trim():
    base, ex = tie_heavy(2, seed=5, dtype=torch.float32)
    for scope in ("global", "per_tensor"):
        t = merging.ties(base=base, experts=ex, density=0.3, scaling=1.0, trim_scope=scope)
        m = merging.tall_mask_ties(base=base, experts=ex, task=0, density=0.3, scaling=1.0, tall_lambda=0.0,
                                   trim_scope=scope)  # lambda 0: the mask keeps every nonzero tau_0 entry
        for k in SHAPES:
            keep = ex[0][k] != 0
            torch.testing.assert_close(m[k].float(), torch.where(keep, t[k], base[k]).float(), msg=k)


def test_keep_count_and_top_mask_edges():
    assert [keep_count(d, 10) for d in (0.0, 0.04, 0.05, 0.25, 0.35, 1.0)] == [0, 0, 1, 3, 4, 10]
    assert keep_count(0.2, 8) == 2  # mergekit's int(0.2 * 8) would keep 1
    x = torch.tensor([1.0, 3.0, 1.0, 3.0, 2.0, 1.0])
    assert top_magnitude_mask(x, 3).tolist() == [False, True, False, True, True, False]
    assert top_magnitude_mask(x, 4).tolist() == [True, True, False, True, True, False]
    assert not top_magnitude_mask(x, 0).any() and top_magnitude_mask(x, 6).all()


def test_bad_trim_rule_is_one_line_error():
    base, ex = tie_heavy(2, seed=6)
    with pytest.raises(ValueError, match="trim_rule must be 'exact' or 'threshold', got 'topk'"):
        merging.ties(base=base, experts=ex, trim_rule="topk")


@pytest.mark.parametrize("majority", [1.0, -1.0, 0.0])
@pytest.mark.parametrize("merge_fn", ["mean", "sum", "max"])
def test_zero_sums_take_the_model_majority_without_a_second_read(majority, merge_fn, monkeypatch):
    """An entry whose trimmed values cancel (+0.5, -0.5) gets the model-wide majority sign, on the streamed
    (global) and the per-tensor path alike, from one read of each key."""
    base = {"a.w": torch.zeros(3), "b.w": torch.zeros(4)}
    b_vals = {1.0: [1.0, 1.0, 1.0, 0.0], -1.0: [-1.0, -1.0, -1.0, 0.0], 0.0: [1.0, -1.0, 0.0, 0.0]}[majority]
    ex = [{"a.w": torch.tensor([0.5, -0.5, 0.25]), "b.w": torch.tensor(b_vals)},
          {"a.w": torch.tensor([-0.5, 0.5, 0.25]), "b.w": torch.tensor(b_vals)}]
    if majority == 0.0:  # a.w's own net sign is 0 too
        ex[1]["a.w"][2] = -0.25
    reads = []
    load = ModelSet.load
    monkeypatch.setattr(ModelSet, "load", lambda self, key, check=None: reads.append(key) or load(self, key, check))
    chosen = {1.0: 0.5, -1.0: -0.5, 0.0: -0.5 if merge_fn != "max" else 0.0}[majority]
    for scope in ("global", "per_tensor"):
        reads.clear()
        out = merging.ties(base=base, experts=ex, density=1.0, trim_scope=scope, merge_fn=merge_fn)
        assert sorted(reads) == ["a.w", "b.w"], scope
        assert out["a.w"][:2].tolist() == [chosen, chosen], scope  # both entries cancel


@pytest.mark.parametrize("density", [1.0, 0.4])
def test_generic_ties_election_in_column_blocks_equals_one_block(density, monkeypatch):
    """DARE+TIES runs the election in column blocks of a large key; the blocks give the same output,
    including entries whose trimmed values cancel (settled by the model-wide majority sign)."""
    import importlib

    ties_mod = importlib.import_module("clmerge.merging.methods.ties")
    g = torch.Generator().manual_seed(3)
    base = {"a.w": torch.randn(9, 11, generator=g), "b.w": torch.randn(37, generator=g)}
    ex = []
    for _ in range(3):
        e = {k: v + torch.randn(v.shape, generator=g).round() * 0.5 for k, v in base.items()}
        ex.append(e)
    kw = dict(drop_rate=0.3, combine="ties", density=density, scaling=0.7, seed=5)
    want = merging.dare(base=base, experts=ex, **kw)
    monkeypatch.setattr(ties_mod, "_BLOCK", 7)
    got = merging.dare(base=base, experts=ex, **kw)
    for k in want:
        assert torch.equal(got[k], want[k]), k


# --- float64 inputs: counts and thresholds on the numbers they are applied to, float64 precision out ---------

def fine_float64(n_experts: int, seed: int, shapes=SHAPES):
    """float64 base near 1 and experts that differ from it by ~1e-9: below float32's resolution at 1 (6e-8),
    so ``x.float() - b.float()`` is mostly 0 or one ulp, while ``x - b`` in float64 is all distinct values."""
    g = torch.Generator().manual_seed(seed)
    base = {k: 1.0 + torch.rand(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}
    ex = [{k: v + 1e-9 * torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in base.items()}
          for _ in range(n_experts)]
    return base, ex


def float64_ties_reference(base, experts, density, scope):
    """TIES (mean, majority sign over the model) computed entirely in float64 with the exact trim."""
    keys = list(base)
    tvs = {k: torch.stack([e[k] - base[k] for e in experts]) for k in keys}
    if scope == "per_tensor":
        trimmed = {k: torch.stack([v * top_magnitude_mask(v.abs(), keep_count(density, v.numel())) for v in t])
                   for k, t in tvs.items()}
    else:
        flat = torch.cat([t.reshape(len(experts), -1) for t in tvs.values()], 1)
        masks = torch.stack([top_magnitude_mask(r.abs(), keep_count(density, r.numel())) for r in flat])
        trimmed, pos = {}, 0
        for k, t in tvs.items():
            n = t[0].numel()
            trimmed[k] = t * masks[:, pos:pos + n].reshape(t.shape)
            pos += n
    out = {}
    for k, t in trimmed.items():
        sign = torch.sign(t.sum(0))
        sign[sign == 0] = 1.0
        agree = (t * sign).clamp(min=0)
        out[k] = base[k] + sign * agree.sum(0) / agree.sign().sum(0).clamp(min=1)
    return out, trimmed


@pytest.mark.parametrize("scope", ["per_tensor", "global"])
def test_ties_on_float64_keeps_round_density_n_found_in_float64(scope):
    base, ex = fine_float64(1, 3)
    out = merging.ties(base=base, experts=ex, density=0.2, trim_scope=scope)
    ref, trimmed = float64_ties_reference(base, ex, 0.2, scope)
    kept = sum(int((v != 0).sum()) for v in trimmed.values())
    if scope == "per_tensor":
        for k, v in base.items():
            assert int((out[k] != v).sum()) == keep_count(0.2, v.numel()), k
    else:
        assert sum(int((out[k] != v).sum()) for k, v in base.items()) == kept == keep_count(0.2, 1200 + 30 + 221 + 5)
    for k in base:
        assert out[k].dtype == torch.float64
        assert torch.equal(out[k] != base[k], trimmed[k][0] != 0), k  # the very entries float64 ranks on top


@pytest.mark.parametrize("scope", ["per_tensor", "global"])
def test_ties_float64_in_float64_out_at_float64_precision(scope):
    base, ex = fine_float64(3, 4)
    out = merging.ties(base=base, experts=ex, density=0.5, trim_scope=scope)
    ref, _ = float64_ties_reference(base, ex, 0.5, scope)
    for k in base:
        assert out[k].dtype == torch.float64
        # float32 arithmetic is ~1e-7 off on values near 1; float64 agrees to a few ulps
        assert torch.allclose(out[k], ref[k], rtol=0, atol=1e-15), (k, float((out[k] - ref[k]).abs().max()))


@pytest.mark.parametrize("combine", ["task_arithmetic", "ties"])
def test_dare_on_float64_computes_in_float64(combine):
    base, ex = fine_float64(2, 5)
    out = merging.dare(base=base, experts=ex, drop_rate=0.0, combine=combine, scaling=1.0,
                       **({"density": 1.0} if combine == "ties" else {}))
    for k in base:
        tvs = torch.stack([e[k] - base[k] for e in ex])
        if combine == "task_arithmetic":
            ref = base[k] + tvs.sum(0)
        else:
            sign = torch.sign(tvs.sum(0))
            agree = (tvs * sign).clamp(min=0)
            ref = base[k] + sign * agree.sum(0) / agree.sign().sum(0).clamp(min=1)
        assert out[k].dtype == torch.float64
        assert torch.allclose(out[k], ref, rtol=0, atol=1e-15), (k, float((out[k] - ref).abs().max()))


def test_della_on_float64_computes_in_float64():
    base, ex = fine_float64(1, 6)
    out = merging.della(base=base, experts=ex, density=1.0, epsilon=0.0, scaling=1.0)
    for k in base:
        assert torch.allclose(out[k], ex[0][k], rtol=0, atol=1e-15), k


def test_global_trim_on_a_model_mixing_float64_and_float32_keys_compares_exactly():
    """Model-wide thresholds found in float64 (one float64 key) are compared with a float32 key's task vector
    in float64 (DARE+TIES, the generic path): the threshold here lies just above 1.0, and rounded to float32
    (1.0) it kept the float32 key's entries equal to 1.0, which are below it."""
    g = torch.Generator().manual_seed(7)
    base = {"a": torch.zeros(400, dtype=torch.float64), "b": torch.zeros(100, dtype=torch.float32)}
    ex = [{"a": 1.0 + 1e-9 * (1.0 + torch.rand(400, generator=g, dtype=torch.float64)), "b": torch.ones(100)}]
    out = merging.dare(base=base, experts=ex, drop_rate=0.0, combine="ties", density=0.5, scaling=1.0)
    assert int((out["b"] != 0).sum()) == 0  # every entry of "a" is above 1.0: the top 250 are all there
    assert sum(int((out[k] != base[k]).sum()) for k in base) == keep_count(0.5, 500)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1000, 4097, 65536])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_sums_are_torch_sum_for_few_experts(rows, n, dtype):
    """The TIES kernel adds expert rows one by one (20x faster than a dim-0 reduction on the CPU); up to
    ROW_SUM_MAX rows that must be the very numbers of torch.sum(x, 0), or outputs would move by rounding."""
    from clmerge.merging.methods.ties_kernels import ROW_SUM_MAX, sum_rows

    assert rows <= ROW_SUM_MAX
    g = torch.Generator().manual_seed(rows * n)
    x = (torch.randn(rows, n, generator=g, dtype=torch.float64)
         * torch.logspace(-8, 8, n, dtype=torch.float64)).to(dtype)
    assert torch.equal(sum_rows(x, torch.empty(n, dtype=dtype)), torch.sum(x, 0))
