"""clmerge's TIES, task arithmetic and averaging against an independent transcription of FusionBench's semantics.

The ``fb_*`` functions below are written from reading FusionBench's ``ties_merging_utils.py`` (``topk_values_mask``,
``resolve_sign`` / ``resolve_zero_signs``, ``disjoint_merge``) and ``state_dict_arithmetic.py``; no FusionBench
code is imported or copied. Their behaviour, in words:

- every model is flattened into one vector (keys sorted by name); task vectors ``tv = ft - ptm`` in float32;
- trim: ``k = d - int(d * density)``; the row's ``k``-th smallest magnitude is the threshold; ``|tv| >= thr`` kept;
- elect: ``sign(sum_t trimmed)``; zeros get the majority sign ``sign(sum of all elected signs)`` of the whole
  vector (which can itself be 0); selection is ``trimmed > 0`` where the sign is > 0, else ``trimmed < 0``;
- merge: mean = sum of selected / max(1, number of nonzero selected); sum; max = max |selected| * sign;
- merged = ptm + scaling * merged task vector.
"""

from __future__ import annotations

import sys

import pytest
import torch

from clmerge import merging
from clmerge.merging.methods.sources import ModelSet
from clmerge.merging.methods.ties import global_magnitude_thresholds, kth_smallest, plain_task_vectors, ties_tensor

from merging_helpers import make_models


def _flatten(sd: dict[str, torch.Tensor], keys: list[str]) -> torch.Tensor:
    return torch.cat([sd[k].reshape(-1).float() for k in keys])


def _unflatten(vec: torch.Tensor, like: dict[str, torch.Tensor], keys: list[str]) -> dict[str, torch.Tensor]:
    out, pos = {}, 0
    for k in keys:
        n = like[k].numel()
        out[k] = vec[pos:pos + n].reshape(like[k].shape)
        pos += n
    return out


def fb_ties(base, experts, density=0.2, scaling=1.0, merge_fn="mean"):
    """FusionBench's TIES, transcribed: flatten, trim per row, elect with a global zero-sign rule, merge."""
    keys = sorted(k for k, v in base.items() if v.is_floating_point())
    ptm = _flatten(base, keys)
    tv = torch.stack([_flatten(e, keys) for e in experts]) - ptm
    d = tv.shape[1]
    kth = tv.abs().kthvalue(d - int(d * density), dim=1, keepdim=True).values
    trimmed = tv * (tv.abs() >= kth)
    sign = torch.sign(trimmed.sum(0))
    sign[sign == 0] = torch.sign(sign.sum())
    selected = trimmed * torch.where(sign > 0, trimmed > 0, trimmed < 0)
    if merge_fn == "mean":
        merged = selected.sum(0) / (selected != 0).sum(0).float().clamp(min=1)
    elif merge_fn == "sum":
        merged = selected.sum(0)
    else:
        merged = selected.abs().max(0).values * sign
    return _unflatten(ptm + scaling * merged, base, keys)


def fb_task_arithmetic(base, experts, scaling):
    """``state_dict_sub`` / ``add`` running sum, ``mul``, ``add`` to the pretrained dict."""
    keys = [k for k, v in base.items() if v.is_floating_point()]
    tv = {k: experts[0][k] - base[k] for k in keys}
    for e in experts[1:]:
        tv = {k: tv[k] + (e[k] - base[k]) for k in keys}
    return {k: base[k] + scaling * tv[k] for k in keys}


def fb_average(experts):
    """``state_dict_add`` running sum over the models, then ``state_dict_div`` by their number."""
    keys = [k for k, v in experts[0].items() if v.is_floating_point()]
    acc = {k: experts[0][k].clone() for k in keys}
    for e in experts[1:]:
        acc = {k: acc[k] + e[k] for k in keys}
    return {k: acc[k] / len(experts) for k in keys}


def assert_same(ours, ref, atol=1e-5):
    for k, v in ref.items():
        torch.testing.assert_close(ours[k].float(), v.float(), atol=atol, rtol=0, msg=k)


@pytest.mark.parametrize("density", [0.1, 0.2, 0.5, 0.9, 0.99])  # FusionBench rejects 1.0 (k = 0)
@pytest.mark.parametrize("merge_fn", ["mean", "sum", "max"])
def test_ties_matches_fusionbench_on_random_models(density, merge_fn):
    base, ex = make_models(5, seed=3)
    ours = merging.ties(base=base, experts=ex, density=density, scaling=0.7, merge_fn=merge_fn,
                        trim_rule="threshold")
    assert_same(ours, fb_ties(base, ex, density, 0.7, merge_fn))


def _tie_models(majority: float):
    """Two experts whose task vectors cancel exactly in ``a.w`` (a zero elected sign over nonzero entries),
    while the other key ``b.w`` sets the global majority sign (``majority``: +1, -1 or 0)."""
    base = {"a.w": torch.zeros(2, 3), "b.w": torch.zeros(4)}
    ta = torch.tensor([[0.5, -0.5, 0.25], [0.0, 0.0, 0.125]])
    b_vals = {1.0: [1.0, 1.0, 1.0, 0.0], -1.0: [-1.0, -1.0, -1.0, 0.0], 0.0: [1.0, -1.0, 0.0, 0.0]}[majority]
    # a.w: +a[0,0] vs -a[0,0] cancel; a[0,1] likewise; a[0,2] and a[1,2] make the tensor's own majority +1
    e1 = {"a.w": ta.clone(), "b.w": torch.tensor(b_vals)}
    e2 = {"a.w": torch.tensor([[-0.5, 0.5, 0.25], [0.0, 0.0, 0.125]]), "b.w": torch.tensor(b_vals)}
    if majority == 0.0:  # keep a.w's own majority at 0 too: one positive and one negative net entry
        e1["a.w"][1, 2], e2["a.w"][1, 2] = -0.125, -0.125
    return base, [e1, e2]


@pytest.mark.parametrize("majority", [1.0, -1.0, 0.0])
def test_ties_zero_sign_uses_the_global_majority(majority):
    base, ex = _tie_models(majority)
    ref = fb_ties(base, ex, density=0.95)  # k = 1: every entry kept (zeros included)
    ours = merging.ties(base=base, experts=ex, density=0.95, trim_rule="threshold")
    assert_same(ours, ref, atol=0)
    # the cancelling entries take the mean of the side the global majority picks (negatives when it is 0)
    expect = 0.5 if majority > 0 else -0.5
    assert float(ours["a.w"][0, 0]) == expect


def test_tensor_level_majority_differs_from_the_global_one():
    """``ties_tensor`` alone (no model-wide view) breaks zero signs by its own tensor's majority (+1 here);
    ``ties`` over the model uses the model-wide majority (-1), as FusionBench does."""
    base, ex = _tie_models(-1.0)
    tvs = torch.stack([e["a.w"] - base["a.w"] for e in ex])
    own = ties_tensor(tvs, torch.zeros(2))
    assert float(own[0, 0]) == 0.5
    assert float(merging.ties(base=base, experts=ex, density=0.95, trim_rule="threshold")["a.w"][0, 0]) == -0.5


def test_task_arithmetic_and_average_match_fusionbench():
    base, ex = make_models(6, seed=5)
    assert_same(merging.task_arithmetic(base=base, experts=ex, scaling=0.3), fb_task_arithmetic(base, ex, 0.3))
    assert_same(merging.weight_average(experts=ex), fb_average(ex))


def _big_models(n: int, seed: int, spike: bool):
    g = torch.Generator().manual_seed(seed)
    base = {"m.weight": torch.randn(700, 500, generator=g), "m.bias": torch.randn(500, generator=g)}
    ex = []
    for _ in range(n):
        e = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in base.items()}
        if spike:  # every 8th entry moves a lot: a strided sample sees a biased picture of the magnitudes
            e["m.weight"].view(-1)[::8] += 5.0
        ex.append(e)
    return base, ex


@pytest.mark.parametrize("spike", [False, True])
def test_streamed_thresholds_are_exact(spike):
    base, ex = _big_models(3, seed=1, spike=spike)
    for density in (0.05, 0.2, 0.7):
        thr = global_magnitude_thresholds(ModelSet(base, ex), density, plain_task_vectors)
        for t, e in enumerate(ex):
            mags = torch.cat([(e[k] - base[k]).reshape(-1).abs() for k in base])
            d = mags.numel()
            assert float(thr[t]) == float(mags.kthvalue(d - int(d * density)).values)
    assert_same(merging.ties(base=base, experts=ex, density=0.2, trim_rule="threshold"), fb_ties(base, ex, 0.2))


def test_streamed_thresholds_exact_when_bracket_buffers_overflow(monkeypatch):
    """Magnitudes with many ties put far more entries inside the sampled bracket than the preallocated
    buffers hold: they are grown, and the thresholds stay exact. Two magnitudes, 0.1 and 0.2, in about equal
    numbers: at density 0.5 the bracket spans both (everything is inside); at 0.2 it closes on 0.2."""
    ties_mod = sys.modules["clmerge.merging.methods.ties"]  # the package's ``ties`` attribute is the function
    calls = []
    grown = ties_mod._grown
    monkeypatch.setattr(ties_mod, "_grown", lambda *a: calls.append(a[1:]) or grown(*a))
    g = torch.Generator().manual_seed(3)
    base = {"m.weight": torch.zeros(600, 500), "m.bias": torch.zeros(500)}
    def entries(shape):
        sign = 2 * torch.randint(0, 2, shape, generator=g) - 1
        return 0.1 * torch.randint(1, 3, shape, generator=g).float() * sign

    ex = [{k: entries(v.shape) for k, v in base.items()} for _ in range(3)]
    for density in (0.2, 0.5):
        thr = global_magnitude_thresholds(ModelSet(base, ex), density, plain_task_vectors)
        for t, e in enumerate(ex):
            mags = torch.cat([(e[k] - base[k]).reshape(-1).abs() for k in base])
            d = mags.numel()
            assert float(thr[t]) == float(mags.kthvalue(d - int(d * density)).values)
    assert calls
    assert_same(merging.ties(base=base, experts=ex, density=0.2, trim_rule="threshold"), fb_ties(base, ex, 0.2))


def test_kth_smallest_matches_kthvalue_with_duplicates_and_skew():
    g = torch.Generator().manual_seed(0)
    xs = [torch.rand(700_000, generator=g), torch.randint(0, 50, (700_000,), generator=g).float(),
          torch.cat([torch.zeros(650_000), torch.rand(50_000, generator=g)])]
    for x in xs:
        for k in (1, 1000, 350_000, 699_999, 700_000):
            assert float(kth_smallest(x, k)) == float(x.kthvalue(k).values)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("method, hp", [("weight_average", {}), ("weight_average", {"weights": [0.0, 1.0]}),
                                        ("task_arithmetic", {"scaling": 0.0}), ("task_arithmetic", {})])
def test_output_side_finite_check_still_names_the_key(method, hp, bad):
    """Averaging and TA check their output for NaN/Inf (one read saved); a bad input is still an error."""
    base, ex = make_models(2, seed=1)
    ex[0]["blk.fc2.weight"][1, 2] = bad
    with pytest.raises(merging.MergeInputError, match="blk.fc2.weight.*expert 0"):
        merging.merge(method, base=base, experts=ex, **hp)
