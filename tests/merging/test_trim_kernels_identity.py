"""The faster TIES and DARE kernels give exactly the numbers of a straightforward reference.

- :func:`kth_smallest_counts` (threshold and the counts above / equal to it) against ``kthvalue`` and two
  comparisons, on every one of its paths: the sample's tied quantile, a bracket that closes, a bracket with
  entries inside, the full fallback;
- the per-tensor trim spec with buffers reused across keys of different sizes against a transcription of the
  exact rule;
- the streamed global pass when the bracket closes on one value (no entries kept) against the whole-model sort;
- the streamed TIES kernel with a tie quota spread over many slices against the same kernel in one slice;
- DARE's blocked masked sum against one whole-tensor draw per expert.
"""

from __future__ import annotations

import sys

import pytest
import torch

from clmerge import merging
from clmerge.merging.methods.dare import dare_generator, dare_sum_blocks
from clmerge.merging.methods.sources import ModelSet
from clmerge.merging.methods.ties import global_trim, per_tensor_trim_spec, plain_task_vectors
from clmerge.merging.methods.ties_kernels import Work, ties_key_streamed
from clmerge.merging.methods.trim import TIE_ALL, Buffers, add_ties, keep_count, kth_smallest_counts

ties_mod = sys.modules["clmerge.merging.methods.ties"]  # the package's ``ties`` attribute is the function


def reference_counts(x: torch.Tensor, k: int) -> tuple[float, int, int]:
    v = x.kthvalue(k).values
    return float(v), int((x > v).sum()), int((x == v).sum())


def _datasets() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = 40_000
    bf16_like = ((torch.randn(n, generator=g) * 1e-3).to(torch.bfloat16).float()).abs()
    two = 0.1 * torch.randint(1, 3, (n,), generator=g).float()  # two values in about equal numbers
    spiky = torch.rand(n, generator=g)
    spiky[::n // 512] += 5.0  # the strided sample (``sample=512`` below) sees only the spikes
    five = torch.randint(0, 5, (n,), generator=g).float() * 2**-12  # 20 % of the entries on each value
    return {"distinct": torch.rand(n, generator=g), "bf16_ties": bf16_like, "two_values": two, "spiky": spiky,
            "five_values": five,
            "zeros": torch.cat([torch.zeros(n - 3000), torch.rand(3000, generator=g)])}


@pytest.mark.parametrize("name", ["distinct", "bf16_ties", "two_values", "five_values", "spiky", "zeros"])
@pytest.mark.parametrize("with_mask", [False, True])
def test_kth_smallest_counts_is_kthvalue_and_two_counts(name, with_mask):
    x = _datasets()[name]
    mask = torch.empty(x.numel(), dtype=torch.bool) if with_mask else None
    for k in (1, 17, x.numel() // 5, x.numel() // 2, x.numel() - round(0.2 * x.numel()) + 1, x.numel()):
        v, above, equal = kth_smallest_counts(x, k, sample=1 << 9, mask=mask)  # 40 000 > 8 * 512: sampled
        assert (float(v), above, equal) == reference_counts(x, k), (name, k)


def test_kth_smallest_counts_takes_each_path(monkeypatch):
    """The data above reach every branch: the tied sample quantile, a closed bracket, kthvalue inside a
    bracket, and the full kthvalue when the sample misleads (counted by the size kthvalue runs on)."""
    sizes = []
    kth = torch.Tensor.kthvalue
    monkeypatch.setattr(torch.Tensor, "kthvalue", lambda self, k: sizes.append(self.numel()) or kth(self, k))
    data = _datasets()
    x = data["two_values"]
    kth_smallest_counts(x, x.numel() // 2, sample=1 << 9)  # the quantile straddles 0.1 / 0.2: kthvalue inside
    assert any(512 < s < x.numel() for s in sizes)
    sizes.clear()
    kth_smallest_counts(data["spiky"], 20_000, sample=1 << 9)
    assert x.numel() in sizes  # the full fallback
    sizes.clear()
    kth_smallest_counts(data["five_values"], 28_001, sample=1 << 9)  # in the middle of the 4th value's band
    assert max(sizes) < 1000  # settled by the tied sample quantile: kthvalue only on the sample


def _reference_spec(b, x, density, rule):
    mag = (x.reshape(-1).to(torch.float32) - b.reshape(-1).to(torch.float32)).abs()
    n = mag.numel()
    if rule == "threshold":
        return float(mag.kthvalue(n - int(n * density)).values), TIE_ALL
    k = keep_count(density, n)
    v = mag.kthvalue(n - k + 1).values
    quota, ties = k - int((mag > v).sum()), int((mag == v).sum())
    return float(v), TIE_ALL if quota >= ties else quota


@pytest.mark.parametrize("rule", ["exact", "threshold"])
def test_per_tensor_spec_with_reused_buffers_matches_the_rule(rule):
    g = torch.Generator().manual_seed(1)
    bufs = Buffers()
    for shape in [(700, 800), (30, 20), (900, 700), (5,)]:  # grows, shrinks (a view), grows again
        b = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        xs = [(b.float() + torch.randint(-2, 3, shape, generator=g) * 1e-4).to(torch.bfloat16) for _ in range(3)]
        thr, quotas = per_tensor_trim_spec(b, xs, 0.2, rule, bufs, b.reshape(-1).float())
        for t, x in enumerate(xs):
            assert (float(thr[t]), quotas[t]) == _reference_spec(b, x, 0.2, rule), (shape, t)


def test_global_pass_with_a_closed_bracket_keeps_no_entries_and_is_exact(monkeypatch):
    """bf16 task vectors tie by the thousand at the threshold: the sampled bracket closes on one value, the
    streamed pass keeps nothing, and the thresholds and tie quotas are those of the whole-model sort."""
    kept = []
    monkeypatch.setattr(ties_mod, "_keep_inside", lambda *a: kept.append(1))
    g = torch.Generator().manual_seed(2)
    shapes = {"a.weight": (700, 600), "b.weight": (300, 500), "c.bias": (500,)}
    base = {k: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    ex = [{k: (v.float() + torch.randint(-2, 3, v.shape, generator=g) * 1e-4).to(torch.bfloat16)
           for k, v in base.items()} for _ in range(2)]
    for density in (0.2, 0.5):
        thr, quotas = global_trim(ModelSet(base, ex), density, plain_task_vectors)
        for t, e in enumerate(ex):
            mags = {k: (e[k].float() - base[k].float()).abs().reshape(-1) for k in shapes}
            flat = torch.cat(list(mags.values()))
            k_keep = keep_count(density, flat.numel())
            want = torch.zeros(flat.numel(), dtype=torch.bool)
            want[torch.sort(-flat, stable=True).indices[:k_keep]] = True  # ties in key, then flat, order
            got = torch.cat([add_ties(m > thr[t], m, thr[t], quotas[k][t]) for k, m in mags.items()])
            assert torch.equal(got, want)
    assert not kept


@pytest.mark.parametrize("merge_fn", ["mean", "sum", "max"])
def test_streamed_kernel_tie_quota_over_many_slices_equals_one_slice(merge_fn):
    """A partial tie quota spread over many slices (kept whole until the slice where it runs out) keeps the
    same entries as one slice with the quota applied by position."""
    g = torch.Generator().manual_seed(3)
    b = torch.zeros(5000)
    xs = [torch.randint(-3, 4, (5000,), generator=g).float() / 8 for _ in range(3)]
    mags = [x.abs() for x in xs]
    thr = torch.stack([m.kthvalue(3000).values for m in mags])
    quotas = [int((m == v).sum()) // 2 + t for t, (m, v) in enumerate(zip(mags, thr))]  # partial quotas
    assert all(0 < q < int((m == v).sum()) for q, m, v in zip(quotas, mags, thr))
    one = ties_key_streamed(b, xs, thr, quotas, 0.7, merge_fn, Work(3, 5000))
    for chunk in (64, 333):
        many = ties_key_streamed(b, xs, thr, quotas, 0.7, merge_fn, Work(3, chunk))
        assert torch.equal(many[0], one[0]) and many[1] == one[1]
        assert all(torch.equal(p, q) for p, q in zip(many[2], one[2]) if p is not None)


def _dare_reference(b, xs, seed, key, p, factor):
    acc = torch.zeros(b.shape)
    for t, x in enumerate(xs):
        keep = torch.rand(x.shape, generator=dare_generator(seed, key, t)) >= p
        acc += (x.float() - b.float()) * keep
    return (acc * factor + b.float()).to(xs[0].dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block", [7, 64, 1 << 16])
def test_dare_blocked_sum_is_one_whole_draw_per_expert(dtype, block):
    g = torch.Generator().manual_seed(4)
    b = torch.randn(37, 53, generator=g).to(dtype)
    xs = [(b.float() + 0.01 * torch.randn(b.shape, generator=g)).to(dtype) for _ in range(3)]
    gens = [dare_generator(5, "w", t) for t in range(3)]
    got = dare_sum_blocks(b, xs, gens, 0.4, 0.3 / 0.6, torch.float32, block)
    assert got.dtype == dtype
    assert torch.equal(got, _dare_reference(b, xs, 5, "w", 0.4, 0.3 / 0.6))


def test_dare_merge_is_the_whole_draw_reference():
    g = torch.Generator().manual_seed(6)
    base = {"a.weight": torch.randn(300, 200, generator=g).to(torch.bfloat16), "a.bias": torch.randn(7, generator=g)}
    ex = [{k: (v.float() + 0.01 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in base.items()}
          for _ in range(2)]
    out = merging.dare(base=base, experts=ex, drop_rate=0.5, scaling=0.3, seed=3)
    for k, b in base.items():
        assert torch.equal(out[k], _dare_reference(b, [e[k] for e in ex], 3, k, 0.5, 0.3 / 0.5)), k
    plain = merging.dare(base=base, experts=ex, drop_rate=0.5, scaling=0.3, seed=3, rescale=False)
    for k, b in base.items():
        assert torch.equal(plain[k], _dare_reference(b, [e[k] for e in ex], 3, k, 0.5, 0.3)), k
