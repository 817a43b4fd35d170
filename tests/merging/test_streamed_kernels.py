"""The kernels of mergekit's newer methods (della / della_linear, breadcrumbs_ties, sce, karcher, multislerp,
nuslerp) stream each key in blocks: the same results as the whole-tensor formulas on tensors of many blocks
(a small block size forced), bf16 inputs included, and no temporary as large as a float64 copy of a key.

Exact equality where the arithmetic per entry is unchanged (della's row blocks draw the very random numbers
of one whole-tensor draw; breadcrumbs' thresholds feed TIES's streamed kernel). Where a whole-tensor
reduction is now summed block by block (sce's energies; the Gram matrix of the spherical merges), float64
outputs are compared to ``1e-12`` of their largest entry: two float64 sums of ``n`` terms in different orders
differ by at most about ``n * 2**-53`` of the sum of the terms' magnitudes (1.2e-13 for the 851 entries
here), and karcher's ten steps and the divisions by norms amplify that by a small factor. float32 and bf16
outputs round those float64 values and come out equal (fixed seeds; a flip would need a value within 1e-13
of a rounding boundary).
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from clmerge import merging
from clmerge.merging.methods import driver
from clmerge.merging.methods.sparse_family import breadcrumbs_mask
from clmerge.merging.methods.dare import dare_generator
from clmerge.merging.methods.sparse_family import magprune_drop_probabilities
from clmerge.merging.methods.sce import sce_tensor
from clmerge.merging.methods.sources import open_models
from clmerge.merging.methods.spherical import karcher_tensor, multislerp_tensor, nuslerp_tensor
from clmerge.merging.methods.ties import ties_from_task_vectors
from clmerge.merging.methods.trim import work_dtype

SHAPES = {"w": (37, 23), "b": (300,)}  # 851 and 300 entries: 14 and 5 blocks of 64 entries
DTYPES = [torch.float32, torch.bfloat16, torch.float64]


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(driver, "CHUNK", 64)


def models(dtype, n=3, seed=0, scale=0.05, ties_every=0):
    """``(base, experts)``; ``ties_every``: round the experts to multiples of 1/ties_every (equal magnitudes)."""
    g = torch.Generator().manual_seed(seed)
    base = {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in SHAPES.items()}
    ex = []
    for _ in range(n):
        e = {k: v + scale * torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in base.items()}
        if ties_every:
            e = {k: base[k] + torch.round((v - base[k]) * ties_every) / ties_every for k, v in e.items()}
        ex.append(e)
    cast = lambda sd: {k: v.to(dtype) for k, v in sd.items()}  # noqa: E731
    return cast(base), [cast(e) for e in ex]


def check(new, ref, dtype, exact):
    for k in SHAPES:
        assert new[k].dtype == dtype
        want = ref[k].to(dtype)
        if exact or dtype != torch.float64:
            assert torch.equal(new[k], want), k
        else:
            tol = 1e-12 * float(want.abs().max())
            torch.testing.assert_close(new[k], want, rtol=0.0, atol=tol)


def per_key(base, experts, fn):
    return {k: fn(None if base is None else base[k], [e[k] for e in experts], k) for k in SHAPES}


# ---- the whole-tensor formulas (the kernels before streaming) --------------------------------------------

def magprune_whole(tv, density, epsilon, gen):
    p = magprune_drop_probabilities(tv, density, epsilon).to(torch.float32)
    keep = torch.rand(tv.shape, generator=gen) >= p
    return (tv * keep / (1.0 - p)).to(tv.dtype)


def della_linear_whole(b, xs, key, density=0.5, epsilon=0.2, scaling=1.0, seed=0):
    dt = work_dtype(b.dtype, *(x.dtype for x in xs))
    acc, fb = torch.zeros(b.shape, dtype=dt), b.to(dt)
    for t, x in enumerate(xs):
        acc.add_(magprune_whole(x.to(dt) - fb, density, epsilon, dare_generator(seed, key, t)))
    return acc.mul_(scaling).add_(fb)


@pytest.mark.parametrize("dtype", DTYPES)
def test_della_linear_in_row_blocks_is_the_whole_tensor_result(small_blocks, dtype):
    base, ex = models(dtype)
    new = merging.merge("della_linear", base=base, experts=ex, density=0.4, epsilon=0.3, scaling=0.7, seed=2)
    ref = per_key(base, ex, lambda b, xs, k: della_linear_whole(b, xs, k, 0.4, 0.3, 0.7, 2))
    check(new, ref, dtype, exact=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_della_in_row_blocks_is_the_whole_tensor_result(small_blocks, dtype):
    base, ex = models(dtype)

    def pruned(key, b, xs, idx):
        dt = work_dtype(b.dtype, *(x.dtype for x in xs))
        return torch.stack([magprune_whole(x.to(dt) - b.to(dt), 0.5, 0.4, dare_generator(1, key, t))
                            for x, t in zip(xs, idx)])

    ref = ties_from_task_vectors(open_models(base, ex), pruned, density=1.0, scaling=0.9, trim_scope="per_tensor",
                                 merge_fn="mean")
    new = merging.merge("della", base=base, experts=ex, density=0.5, epsilon=0.4, scaling=0.9, seed=1)
    check(new, ref, dtype, exact=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("merge_fn,density,beta", [("sum", 0.1, 0.01), ("mean", 0.3, 0.05), ("max", 0.5, 0.2),
                                                   ("sum", 0.9, 0.2), ("mean", 0.0, 0.1), ("sum", 1.0, 0.0)])
def test_breadcrumbs_ties_streamed_is_the_masked_stack_result(small_blocks, dtype, merge_fn, density, beta):
    # magnitudes on a grid of 1/64: many equal ones, whose ties go to the lower flat index across blocks
    base, ex = models(dtype, ties_every=64)

    def masked(key, b, xs, idx):  # the kernel before streaming: each whole task vector masked
        dt = work_dtype(b.dtype, *(x.dtype for x in xs))
        tvs = torch.stack([x.to(dt) for x in xs]) - b.to(dt)
        for tv in tvs:
            tv.mul_(breadcrumbs_mask(tv, density, beta))
        return tvs

    ref = ties_from_task_vectors(open_models(base, ex), masked, density=1.0, scaling=0.8, trim_scope="per_tensor",
                                 merge_fn=merge_fn)
    new = merging.merge("breadcrumbs_ties", base=base, experts=ex, density=density, beta=beta, scaling=0.8,
                        merge_fn=merge_fn)
    check(new, ref, dtype, exact=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("topk", [1.0, 0.3])
def test_sce_streamed_is_the_whole_tensor_result(small_blocks, dtype, topk):
    base, ex = models(dtype)
    new = merging.merge("sce", base=base, experts=ex, select_topk=topk)
    ref = per_key(base, ex, lambda b, xs, k: b.double() + sce_tensor(torch.stack([x.double() for x in xs])
                                                                     - b.double(), topk))
    check(new, ref, dtype, exact=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_karcher_streamed_is_the_whole_tensor_result(small_blocks, dtype):
    _, ex = models(dtype, n=4, scale=0.5)
    w = [1.0, 2.0, 0.5, 1.5]
    new = merging.merge("karcher", experts=ex, weights=w)
    wt = torch.tensor(w, dtype=torch.float64) / sum(w)
    ref = per_key(None, ex, lambda b, xs, k: karcher_tensor(xs, wt))
    check(new, ref, dtype, exact=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_base", [False, True])
def test_multislerp_streamed_is_the_whole_tensor_result(small_blocks, dtype, with_base):
    base, ex = models(dtype, scale=0.5)
    w = [1.0, 2.0, 0.5]
    new = merging.merge("multislerp", base=base if with_base else None, experts=ex, weights=w)
    wt = torch.tensor(w, dtype=torch.float64) / sum(w)

    def whole(b, xs, k):
        if b is None:
            return multislerp_tensor(xs, wt)
        return b.double() + multislerp_tensor([x.double() - b.double() for x in xs], wt)

    check(new, per_key(base if with_base else None, ex, whole), dtype, exact=False)


def test_multislerp_streamed_two_opposite_inputs_are_combined_linearly(small_blocks):
    x = torch.randn(40, 30, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out = merging.merge("multislerp", experts=[{"w": x}, {"w": -x}])["w"]
    torch.testing.assert_close(out, multislerp_tensor([x, -x], torch.tensor([0.5, 0.5], dtype=torch.float64)))
    with pytest.raises(ValueError, match="weighted mean of the directions is zero"):
        merging.merge("multislerp", experts=[{"w": x}, {"w": -x}, {"w": x}], weights=[1.0, 2.0, 1.0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_base", [False, True])
def test_nuslerp_flat_streamed_is_the_whole_tensor_result(small_blocks, dtype, with_base):
    base, ex = models(dtype, n=2, scale=0.5)
    new = merging.merge("nuslerp", base=base if with_base else None, experts=ex, weights=[1.0, 3.0])

    def whole(b, xs, k):
        if b is None:
            return nuslerp_tensor(0.75, xs[0], xs[1])
        return b.double() + nuslerp_tensor(0.75, xs[0].double() - b.double(), xs[1].double() - b.double())

    check(new, per_key(base if with_base else None, ex, whole), dtype, exact=False)


# ---- memory: no temporary of a whole float64 stack -------------------------------------------------------

@pytest.mark.parametrize("name,with_base", [("della_linear", True), ("breadcrumbs_ties", True), ("sce", True),
                                            ("karcher", False), ("multislerp", True), ("nuslerp", True)])
def test_no_temporary_is_larger_than_a_float32_copy_of_the_key(name, with_base):
    # the whole-tensor kernels allocated float64 stacks of every expert (3 x 8 bytes an entry) or int64 sort
    # indices of the tensor; streamed, the largest allocation is one float32 magnitude vector (breadcrumbs'
    # thresholds) or the output
    shape = (768, 1024)  # above 8 x 65536 entries: kth_smallest brackets the threshold from a sample
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(shape, generator=g).bfloat16()}
    n = 2 if name == "nuslerp" else 3
    ex = [{"w": (base["w"].float() + 0.01 * torch.randn(shape, generator=g)).bfloat16()} for _ in range(n)]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        merging.merge(name, base=base if with_base else None, experts=ex)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest <= 4 * base["w"].numel(), f"{name}: an allocation of {largest} bytes"
