"""The SVD merges' two paths: ``svd="exact"`` (the reference, its numbers unchanged by the memory-lean key
kernels) and ``svd="randomized"`` (the fast path: randomized SVDs at the kept rank, one task matrix alive at
a time, Iso-CTS's left polar factor by blocks, CART's low-rank sum by row blocks).

Agreement with the exact path is held to 1e-3 relative on the merged update of a matrix whose task vectors
have decaying spectra; on spectra that are flat past the kept rank no randomized range finder gets there
(benchmarks/merging/llm_scale.md, "SVD merges: fast path")."""

from __future__ import annotations

import importlib

import pytest
import torch

from clmerge import merging
from clmerge.merging.methods.iso import iso_cts_matrix
from clmerge.merging.methods.lowrank import (TaskMatrices, low_rank_approx, mean64, polar_factor, task_matrices,
                                             thin_svd)
from clmerge.merging.methods.tsv import tsv_merge_matrix

W, B = "blk.fc.weight", "blk.fc.bias"
cart_mod = importlib.import_module("clmerge.merging.methods.cart")


def decaying(num_tasks=3, shape=(96, 72), seed=0, rate=0.7, dtype=torch.float64):
    """Task matrices with singular values ``rate^i`` (random singular vectors), as fine-tuning updates have."""
    g = torch.Generator().manual_seed(seed)
    r = min(shape)
    out = []
    for _ in range(num_tasks):
        u = torch.linalg.qr(torch.randn(shape[0], r, generator=g, dtype=torch.float64)).Q
        v = torch.linalg.qr(torch.randn(shape[1], r, generator=g, dtype=torch.float64)).Q
        out.append(((u * rate ** torch.arange(r, dtype=torch.float64)) @ v.T).to(dtype))
    return out


def merged_update(name, base, experts, **kw):
    out = merging.merge(name, base={W: base}, experts=[{W: x} for x in experts], **kw)[W].double()
    ref = torch.stack([x.double() for x in experts]).mean(0) if name == "cart" else base.double()
    return out - ref


@pytest.mark.parametrize("shape", [(96, 72), (72, 96)])
@pytest.mark.parametrize("name, kw", [("cart", {"rank_ratio": 0.1}), ("tsv_m", {}),
                                      ("iso_cts", {"common_space_fraction": 0.8})])
def test_fast_path_agrees_with_exact_within_1e_3_on_decaying_spectra(name, kw, shape):
    base = 0.1 * torch.randn(shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    ex = [base + d for d in decaying(shape=shape)]
    exact = merged_update(name, base, ex, **kw)
    fast = merged_update(name, base, ex, svd="randomized", **kw)
    rel = float((fast - exact).norm() / exact.norm())
    assert rel < 1e-3, rel


def test_task_matrices_formed_one_at_a_time_equal_the_stack():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(7, 5, generator=g).bfloat16()
    xs = [torch.randn(7, 5, generator=g).bfloat16() for _ in range(3)]
    lazy, stack = TaskMatrices(base, xs), task_matrices(base, xs)
    assert lazy.shape == tuple(stack.shape) and len(lazy) == 3
    for t in range(3):
        assert lazy[t].dtype == torch.float32 and torch.equal(lazy[t], stack[t])
    assert torch.equal(lazy.sum(), stack[0] + stack[1] + stack[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_exact_tsv_m_equals_the_stacked_assembly_bit_for_bit(dtype):
    """The lean key kernel (one task matrix at a time, the float64 sum formed in place) gives the numbers of
    ``b.double() + alpha * tsv_merge_matrix(stacked taus).double()``, the assembly it replaced."""
    g = torch.Generator().manual_seed(2)
    base = torch.randn(40, 30, generator=g, dtype=torch.float64).to(dtype)
    xs = [(base.double() + 0.1 * torch.randn(40, 30, generator=g, dtype=torch.float64)).to(dtype) for _ in range(3)]
    got = merging.merge("tsv_m", base={W: base}, experts=[{W: x} for x in xs], scaling=0.7)[W]
    want = (base.double() + 0.7 * tsv_merge_matrix(task_matrices(base, xs)).double()).to(dtype)
    assert torch.equal(got, want)


def test_left_polar_factor_by_blocks_when_the_blocks_are_orthogonal():
    """``polar([U_c, A]) = [U_c, polar(A)]`` when ``U_c`` has orthonormal columns and ``A``'s columns lie
    outside ``span(U_c)``: the identity Iso-CTS's fast path uses (its residuals are projected out of U_c)."""
    g = torch.Generator().manual_seed(3)
    q = torch.linalg.qr(torch.randn(50, 50, generator=g, dtype=torch.float64)).Q
    uc = q[:, :20]
    a = torch.randn(50, 12, generator=g, dtype=torch.float64)
    a = a - uc @ (uc.T @ a)
    whole = polar_factor(torch.cat([uc, a], dim=1))
    torch.testing.assert_close(whole, torch.cat([uc, polar_factor(a)], dim=1), atol=1e-12, rtol=0)


def test_iso_cts_fast_path_takes_a_stack_or_lazy_task_matrices_and_leaves_the_stack_alone():
    ds = decaying(shape=(60, 48))
    base = torch.zeros(60, 48, dtype=torch.float64)
    stack = task_matrices(base, ds)
    before = stack.clone()
    a = iso_cts_matrix(stack, 0.8, svd="randomized")
    b = iso_cts_matrix(TaskMatrices(base, ds), 0.8, svd="randomized")
    assert torch.equal(stack, before)
    torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("only", [None, 1])
def test_cart_row_blocks_equal_the_whole_matrix_sum(monkeypatch, only):
    """The fast path's low-rank sum by row blocks (here 3 rows a block) equals the sum of whole-matrix
    randomized ``SVD_k`` products to rounding."""
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(20, 16, generator=g, dtype=torch.float64) for _ in range(3)]
    avg = mean64(xs)
    tasks = range(3) if only is None else [only]
    want = sum(low_rank_approx((xs[t] - avg).float(), 3, method="randomized", seed=5 + t).double() for t in tasks)
    monkeypatch.setattr(cart_mod, "_ROWS", 3 * 16)
    got = cart_mod._low_rank_sum_lean(xs, avg, 3, 5, only)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    into = avg.clone()
    cart_mod._low_rank_sum_lean(xs, avg, 3, 5, only, into=into, alpha=0.5)
    torch.testing.assert_close(into, avg + 0.5 * want, atol=1e-6, rtol=1e-6)


def test_cart_fast_path_full_rank_and_zero_rank_are_weight_averaging():
    """As on the exact path (the centered deltas are float32, so full rank is the average to float32 rounding),
    and the inputs are not edited in place."""
    xs = decaying(shape=(12, 10))
    before = [x.clone() for x in xs]
    avg = mean64(xs)
    for ratio in (0.0, 1.0):
        out = merging.cart(experts=[{W: x} for x in xs], rank_ratio=ratio, svd="randomized")[W]
        ref = merging.cart(experts=[{W: x} for x in xs], rank_ratio=ratio)[W]
        torch.testing.assert_close(out, avg, atol=1e-6, rtol=0)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(xs, before))


def test_exact_svd_reference_is_still_the_thin_svd():
    """The exact path keeps ``torch.linalg.svd`` (with the float64 retry): the reference of the agreement."""
    m = torch.randn(9, 6, generator=torch.Generator().manual_seed(6))
    u, s, vh = thin_svd(m)
    torch.testing.assert_close((u * s) @ vh, m, atol=1e-5, rtol=1e-5)
