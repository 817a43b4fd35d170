"""Property tests generated from the registry: every registered merge method gets them for free."""

from __future__ import annotations

import copy

import pytest
import torch

from clmerge import merging

from merging_helpers import float_keys, make_models

MATS = ("blk.fc1.weight", "blk.fc2.weight")


def extra_kwargs(name: str, experts: list[dict]) -> dict:
    """Data-dependent inputs some methods need (Fisher dicts, Gram matrices)."""
    if name == "fisher_merging":
        return {"fishers": [{k: torch.ones_like(e[k]) for k in MATS} for e in experts]}
    if name == "regmean":
        return {"grams": [{"blk.fc1.weight": torch.eye(5) + 0.1} for _ in experts]}
    return {}


ALL = sorted(merging.available())
# Methods that return an expert exactly when given one expert and the natural "identity" hyperparameters.
IDENTITY_HP = {
    "task_arithmetic": {"scaling": 1.0}, "ties": {"density": 1.0, "scaling": 1.0}, "dare": {"drop_rate": 0.0, "scaling": 1.0},
    "consensus": {"k": 0, "scaling": 1.0}, "low_rank_task_arithmetic": {"rank_ratio": 1.0, "scaling": 1.0},
    "tall_mask_ties": {"density": 1.0, "scaling": 1.0, "tall_lambda": 0.0},
    "breadcrumbs": {"density": 1.0, "beta": 0.0, "scaling": 1.0}, "della": {"density": 1.0, "epsilon": 0.0},
    "slerp": {"t": 1.0}, "magmax": {"scaling": 1.0},
    "breadcrumbs_ties": {"density": 1.0, "beta": 0.0}, "della_linear": {"density": 1.0, "epsilon": 0.0},
    "nearswap": {"t": 1e9}, "knots": {"merge": "ta", "scaling": 1.0},
}
# Methods whose one-expert merge flattens the expert's spectrum (Iso-C, Iso-CTS): each weight matrix gets
# base + mean(sigma) U V^T of its task vector, the other tensors the expert's values (checked instead).
FLAT_SPECTRUM = {"iso_c", "iso_cts"}
# Methods defined only for a fixed number of models: slerp, nearswap and arcee_fusion take the base and one
# expert; nuslerp takes two experts (their task vectors, with a base).
TWO_MODELS = {"slerp", "nearswap", "arcee_fusion"}
TWO_EXPERTS = {"nuslerp"}
# Methods that pick entries from the base or the expert, with no hyperparameters that keep them all.
SELECTING = {"arcee_fusion"}


def experts_for(name: str, experts: list) -> list:
    return experts[:1] if name in TWO_MODELS else experts[:2] if name in TWO_EXPERTS else experts


def test_registry_is_complete_and_rejects_duplicates():
    expected = {"weight_average", "task_arithmetic", "low_rank_task_arithmetic", "ties", "dare", "consensus",
                "tall_mask_ties", "emr_merging", "fisher_merging", "regmean", "cart", "cart_indexing", "slerp",
                "model_stock", "breadcrumbs", "della", "tsv_m", "tsv_c", "iso_c", "iso_cts", "knots", "wudi"}
    assert expected <= set(ALL)
    assert all(isinstance(d, str) and d and "\n" not in d for d in merging.available().values())
    with pytest.raises(ValueError, match="already registered"):
        merging.register_merge("ties", "dup")(lambda **kw: {})


def test_unknown_method_and_hyperparameter_errors():
    base, ex = make_models(2)
    with pytest.raises(KeyError, match="did you mean 'ties'"):
        merging.merge("tis", base=base, experts=ex)
    with pytest.raises(TypeError, match="did you mean 'density'"):
        merging.merge("ties", base=base, experts=ex, densty=0.2)
    with pytest.raises(ValueError, match="needs base"):
        merging.merge("task_arithmetic", experts=ex)


@pytest.mark.parametrize("name", ALL)
def test_keys_shapes_dtypes_preserved_and_inputs_not_mutated(name):
    base, ex = make_models(3, seed=1)
    snap_b, snap_e = copy.deepcopy(base), copy.deepcopy(ex)
    out = merging.merge(name, base=base, experts=experts_for(name, ex), **extra_kwargs(name, ex))
    assert list(out) == list(base)
    for k in base:
        assert out[k].shape == base[k].shape and out[k].dtype == base[k].dtype, k
        assert torch.isfinite(out[k].double()).all()
    for k in base:
        assert torch.equal(base[k], snap_b[k])
        for e, s in zip(ex, snap_e):
            assert torch.equal(e[k], s[k])
    assert out["buf.index"] is not base["buf.index"]


@pytest.mark.parametrize("name", ALL)
def test_one_expert_is_sensible(name):
    base, ex = make_models(1, seed=2)
    hp = {**IDENTITY_HP.get(name, {}), **extra_kwargs(name, ex)}
    if name in ("model_stock", "nuslerp"):  # model_stock's ratio needs the angle between two task vectors
        with pytest.raises(ValueError, match="(at least|exactly) (2|two) experts"):
            merging.merge(name, base=base, experts=ex, **hp)
        return
    out = merging.merge(name, base=base, experts=ex, **hp)
    if name in SELECTING:  # every entry is the base's or the expert's
        for k in float_keys(base):
            assert ((out[k] == base[k]) | (out[k] == ex[0][k])).all(), f"{name}: {k}"
        return
    for k in float_keys(base):
        want = ex[0][k]
        if name in FLAT_SPECTRUM and k in MATS:
            u, s, vh = torch.linalg.svd(ex[0][k] - base[k], full_matrices=False)
            want = base[k] + s.mean() * u @ vh
        torch.testing.assert_close(out[k], want, atol=1e-5, rtol=1e-5, msg=f"{name}: {k}")


@pytest.mark.parametrize("name", ALL)
def test_identical_experts_float64_agrees_with_float32(name):
    base32, ex32 = make_models(2, seed=3)
    base64 = {k: v.double() if v.is_floating_point() else v for k, v in base32.items()}
    ex64 = [{k: v.double() if v.is_floating_point() else v for k, v in e.items()} for e in ex32]
    out32 = merging.merge(name, base=base32, experts=experts_for(name, ex32), **extra_kwargs(name, ex32))
    out64 = merging.merge(name, base=base64, experts=experts_for(name, ex64), **extra_kwargs(name, ex64))
    for k in float_keys(base32):
        assert out64[k].dtype == torch.float64
        torch.testing.assert_close(out64[k].float(), out32[k], atol=1e-4, rtol=1e-4, msg=f"{name}: {k}")


@pytest.mark.parametrize("name", ALL)
def test_lazy_safetensors_experts_equal_in_memory(name, tmp_path):
    from safetensors.torch import save_file

    base, ex = make_models(3, seed=4)
    paths = []
    for i, e in enumerate(ex):
        p = tmp_path / f"e{i}.safetensors"
        save_file(e, str(p))
        paths.append(p)
    save_file(base, str(tmp_path / "base.safetensors"))
    a = merging.merge(name, base=base, experts=experts_for(name, ex), **extra_kwargs(name, ex))
    b = merging.merge(name, base=tmp_path / "base.safetensors", experts=experts_for(name, paths),
                      **extra_kwargs(name, ex))
    for k in base:
        assert torch.equal(a[k], b[k]), f"{name}: {k}"
