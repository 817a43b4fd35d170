"""Edge cases a differential against FusionBench 0.2.33 found, each against a transcription of the reference
rule (file and line cited in each test).

- OPCM in bf16/fp16 rounds once: FusionBench's ``fusion_bench/method/opcm/opcm.py`` (0.2.33) rescales
  ``theta_0 + (merged - theta_0) * (avg_norm / norm)`` (lines 184-187) on the parameters in the model's dtype;
  the rule here is the float32 merge (the same arithmetic) rounded once to the output dtype.
- WUDI's loss (``fusion_bench/method/wudi/wudi.py`` lines 41-51) divides by squared norms, which overflow
  float32 for entries above about 1e19: NaN out of finite inputs, refused here with the key named.
- KnOTS's support (``gstoica27/KnOTS`` ``task_merger.py`` lines 305-307, ``s > 1e-5`` after a float64 SVD) is
  absolute: an update below it is dropped; the default support here is relative.
"""

from __future__ import annotations

import pytest
import torch

from clmerge import merging
from clmerge.merging.io.base import MergeInputError
from clmerge.merging.methods.knots import SUPPORT_EPS, knots_basis
from clmerge.merging.methods.opcm import opcm_fold, opcm_scale
from clmerge.merging.methods.sources import ModelSet


def _bf16_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    base = {"l.weight": torch.randn(64, 64, generator=g).bfloat16(), "l.bias": torch.randn(64, generator=g).bfloat16()}
    experts = [{k: (v.float() + 0.1 * torch.randn(v.shape, generator=g)).bfloat16() for k, v in base.items()}
               for _ in range(3)]
    return base, experts


def _f32(sd):
    return {k: v.float() for k, v in sd.items()}


def _opcm_rounded_twice(base, experts):
    """The old rule: ``S_T`` stored in bf16, then ``theta_0 + S_T / lambda_T`` rounded again."""
    sums, taus = {}, [0.0] * len(experts)
    for key in base:
        run = None
        for i, e in enumerate(experts):
            tau = e[key].float() - base[key].float()
            taus[i] += float(tau.double().pow(2).sum())
            run = opcm_fold(key, run, tau)
        sums[key] = run
    scale = opcm_scale(sum(float(s.double().pow(2).sum()) for s in sums.values()), taus)
    return {k: (base[k].float() + scale * s.bfloat16().float()).bfloat16() for k, s in sums.items()}


def test_opcm_bf16_is_the_float32_merge_rounded_once():
    base, experts = _bf16_case()
    got = merging.merge("opcm", base=base, experts=experts)
    want = merging.merge("opcm", base=_f32(base), experts=[_f32(e) for e in experts])
    old = _opcm_rounded_twice(base, experts)
    w = want["l.weight"].bfloat16()
    assert int((old["l.weight"] != w).sum()) > 100  # a case where rounding twice differed (292 of 4096)
    for key in base:
        assert got[key].dtype == torch.bfloat16
        assert torch.equal(got[key], want[key].bfloat16()), key


class _NarrowSink:
    """A sink that stores what it is given in ``dtype``, as the CLI's writer casts to the output dtype."""

    def __init__(self, dtype):
        self.dtype, self.data = dtype, {}

    def write(self, key, t):
        self.data[key] = t.to(self.dtype).clone()

    def read(self, key):
        return self.data[key].clone()


@pytest.mark.parametrize("inputs", ["bf16", "f32"])
def test_opcm_streamed_into_a_bf16_sink_rounds_once(inputs):
    """With a sink (the CLI), a key stored narrower than its running sum is recomputed in a second pass."""
    base, experts = _bf16_case(1)
    if inputs == "f32":  # float32 compute, bf16 output (--out-dtype)
        base, experts = _f32(base), [_f32(e) for e in experts]
    sink = _NarrowSink(torch.bfloat16)
    models = ModelSet(base, experts, sink=sink)
    res = merging.merge("opcm", base=models.base, experts=models)
    if hasattr(res, "flush"):
        res.flush()
    want = merging.merge("opcm", base=_f32(base), experts=[_f32(e) for e in experts])
    for key in base:
        assert torch.equal(sink.data[key], want[key].bfloat16()), key


def test_opcm_float32_rescale_unchanged():
    """float32 inputs: the one-pass rescale as before (no held sums, no second pass)."""
    base, experts = _bf16_case(2)
    base, experts = _f32(base), [_f32(e) for e in experts]
    got = merging.merge("opcm", base=base, experts=experts)
    sums, taus = {}, [0.0] * 3
    for key in base:
        run = None
        for i, e in enumerate(experts):
            tau = e[key] - base[key]
            taus[i] += float(tau.double().pow(2).sum())
            run = opcm_fold(key, run, tau)
        sums[key] = run
    scale = opcm_scale(sum(float(s.double().pow(2).sum()) for s in sums.values()), taus)
    for key in base:
        assert torch.equal(got[key], base[key] + scale * sums[key])


def _wudi_overflow():
    g = torch.Generator().manual_seed(0)
    base = {"l.weight": torch.zeros(8, 6), "l.bias": torch.zeros(8)}
    experts = [{"l.weight": 1e20 * torch.randn(8, 6, generator=g), "l.bias": torch.ones(8)} for _ in range(2)]
    return base, experts


def test_wudi_overflow_is_refused_on_the_python_api_naming_the_key():
    base, experts = _wudi_overflow()
    # the reference loss (FusionBench wudi.py lines 41-51): squared norms of 1e20-sized entries are Inf in float32
    tvs = torch.stack([e["l.weight"] for e in experts])
    l2 = torch.square(torch.norm(tvs.reshape(2, -1), p=2, dim=-1))
    assert not torch.isfinite(l2).all()
    with pytest.raises(MergeInputError, match=r"wudi: key 'l\.weight' came out NaN or Inf"):
        merging.merge("wudi", base=base, experts=experts, steps=3)
    with pytest.raises(ValueError):  # a MergeInputError is a ValueError
        merging.wudi(base=base, experts=experts, steps=3)


def test_every_merge_on_the_api_refuses_non_finite_output():
    """The registry's merge checks what a method returns: float16 task arithmetic beyond 65504."""
    base = {"w": torch.zeros(4, dtype=torch.float16)}
    experts = [{"w": torch.full((4,), 60000.0, dtype=torch.float16)} for _ in range(2)]
    with pytest.raises(MergeInputError, match=r"task_arithmetic: 1 merged tensor came out NaN or Inf \('w'\)"):
        merging.merge("task_arithmetic", base=base, experts=experts, scaling=1.0)
    # finite output passes untouched
    out = merging.merge("task_arithmetic", base=base, experts=experts, scaling=0.25)
    assert torch.isfinite(out["w"]).all()


def _official_support(taus: torch.Tensor) -> torch.Tensor:
    """``task_merger.py`` lines 304-305: float64 SVD of the concatenation, ``U[:, s > 1e-5]``."""
    cat = torch.cat(list(taus), dim=1).double()
    u, s, _ = torch.linalg.svd(cat, full_matrices=False)
    return u[:, s > 1e-5]


def test_knots_small_update_is_kept_under_the_default_and_dropped_as_officially():
    g = torch.Generator().manual_seed(0)
    # a zero base: a float32 base's rounding would make a tiny update full-rank noise
    base = {"l.weight": torch.zeros(16, 12)}
    delta = 1e-7 * torch.randn(16, 2, generator=g) @ torch.randn(2, 12, generator=g)  # all s < 1e-5
    experts = [{"l.weight": base["l.weight"] + delta}, {"l.weight": base["l.weight"] + 0.5 * delta}]
    taus = torch.stack([e["l.weight"] - base["l.weight"] for e in experts])
    assert _official_support(taus).shape[1] == 0  # the official rule keeps nothing
    assert knots_basis(taus, support="absolute")[0].shape[1] == 0
    assert knots_basis(taus)[0].shape[1] == 2  # relative: the update's own rank
    absolute = merging.merge("knots", base=base, experts=experts, merge="ta", support="absolute")
    assert torch.equal(absolute["l.weight"], base["l.weight"])  # silently the base, as the official code
    got = merging.merge("knots", base=base, experts=experts, merge="ta")
    assert not torch.equal(got["l.weight"], base["l.weight"])
    want = base["l.weight"].double() + taus.double().sum(0)  # ta at scaling 1 in the full support
    torch.testing.assert_close(got["l.weight"].double(), want, rtol=1e-5, atol=1e-12)


def test_knots_absolute_support_is_the_official_rule_on_a_mixed_spectrum():
    """Singular values on both sides of 1e-5: ``support="absolute"`` keeps what the official code keeps."""
    g = torch.Generator().manual_seed(1)
    q1, _ = torch.linalg.qr(torch.randn(10, 10, generator=g, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(8, 8, generator=g, dtype=torch.float64))
    s = torch.tensor([1.0, 1e-3, 1e-4, 3e-6, 1e-6], dtype=torch.float64)
    taus = torch.stack([q1[:, :5] @ torch.diag(s) @ q2[:, :5].T, torch.zeros(10, 8, dtype=torch.float64)])
    official = _official_support(taus)
    u_abs, _ = knots_basis(taus, support="absolute")
    assert u_abs.shape[1] == official.shape[1] == 3
    torch.testing.assert_close((u_abs @ u_abs.T), official @ official.T)  # the same subspace
    assert knots_basis(taus, eps=SUPPORT_EPS, support="absolute")[0].shape[1] == 3
    assert knots_basis(taus)[0].shape[1] == 3  # relative 1e-5 of s_max = 1: the same cut here
    with pytest.raises(ValueError, match="support"):
        merging.merge("knots", base={"w": torch.zeros(2, 2)}, experts=[{"w": torch.ones(2, 2)}], support="rel")
