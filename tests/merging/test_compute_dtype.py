"""``compute_dtype``: float32 by default (one rounding, when writing); bfloat16 / float16 / input compute the
task-vector methods in that dtype, as mergekit does (it casts every input to its ``dtype`` on loading and forms
task vectors, their sums and the result there: ``mergekit/merge_methods/generalized_task_arithmetic.py``,
``GTATask.execute``, 0.1.5)."""

from __future__ import annotations

import pytest
import torch
import yaml
from checkpoint_helpers import invoke
from safetensors.torch import load_file, save_file

from clmerge.merging.io.base import MergeInputError
from clmerge.merging.methods.sources import ModelSet
from clmerge.merging.methods.sparse_family import ties
from clmerge.merging.methods.task_arithmetic import task_arithmetic
from clmerge.merging.recipes import recipe_of

SHAPE = (48, 40)


def _inputs(dtype=torch.bfloat16, n=3, bias=0.01):
    """A base and ``n`` experts (base + noise; ``bias`` > 0 makes the model-wide TIES majority sign +1)."""
    g = torch.Generator().manual_seed(0)
    b = torch.randn(SHAPE, generator=g)
    xs = [b + 0.02 * torch.randn(SHAPE, generator=g) + bias for _ in range(n)]
    return {"w": b.to(dtype)}, [{"w": x.to(dtype)} for x in xs]


def _ta_by_hand(b, xs, scaling):
    """theta_0 + lambda * sum_t (theta_t - theta_0), every operation in the tensors' dtype (rounded each time)."""
    acc = xs[0] - b
    for x in xs[1:]:
        acc = acc + (x - b)
    return acc * scaling + b


def _ties_by_hand(b, xs, density, scaling):
    """TIES (exact trim, disjoint mean), every operation in the tensors' dtype: trim each task vector to its
    round(density * n) largest magnitudes (ties: first in flat order), elect the sign of the row-by-row sum
    (+1 on a zero sum: the model-wide majority here), average the entries that agree, theta_0 + lambda * it."""
    tvs = [x - b for x in xs]
    k = int(density * b.numel() + 0.5)
    trimmed = []
    for tv in tvs:
        flat = tv.reshape(-1)
        order = torch.sort(flat.abs(), descending=True, stable=True).indices[:k]
        keep = torch.zeros_like(flat)
        keep[order] = 1
        trimmed.append((flat * keep).reshape(tv.shape))
    total = trimmed[0]
    for t in trimmed[1:]:
        total = total + t
    pick = torch.where(total == 0, torch.ones_like(total), torch.sign(total))
    agreeing = [(t * pick).clamp(min=0) for t in trimmed]
    s, count = agreeing[0], torch.sign(agreeing[0])
    for a in agreeing[1:]:
        s, count = s + a, count + torch.sign(a)
    return (s * pick) / count.clamp(min=1) * scaling + b


@pytest.mark.parametrize("compute", [torch.bfloat16, "bfloat16", "input"])
def test_task_arithmetic_in_bf16_is_the_bf16_computation_bit_for_bit(compute):
    base, experts = _inputs()
    got = task_arithmetic(base=None, experts=ModelSet(base, experts, compute_dtype=compute), scaling=0.3)["w"]
    want = _ta_by_hand(base["w"], [e["w"] for e in experts], 0.3)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    default = task_arithmetic(base=base, experts=experts, scaling=0.3)["w"]  # float32, one rounding
    assert not torch.equal(default, got)
    b32, x32 = base["w"].float(), [e["w"].float() for e in experts]
    assert torch.equal(default, _ta_by_hand(b32, x32, 0.3).bfloat16())


@pytest.mark.parametrize("trim_scope", ["global", "per_tensor"])
def test_ties_in_bf16_is_the_bf16_computation_bit_for_bit(trim_scope):
    base, experts = _inputs()
    models = ModelSet(base, experts, compute_dtype=torch.bfloat16)
    got = ties(base=None, experts=models, density=0.2, scaling=0.7, trim_scope=trim_scope)["w"]
    want = _ties_by_hand(base["w"], [e["w"] for e in experts], 0.2, 0.7)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    default = ties(base=base, experts=experts, density=0.2, scaling=0.7, trim_scope=trim_scope)["w"]
    assert not torch.equal(default, got)
    b32, x32 = base["w"].float(), [e["w"].float() for e in experts]
    assert torch.equal(default, _ties_by_hand(b32, x32, 0.2, 0.7).bfloat16())


def test_narrow_compute_dtype_casts_float32_inputs_on_reading():
    # mergekit casts every input to its dtype on loading: float32 inputs with compute_dtype bfloat16 merge as
    # their bf16 copies do (the output keeps the inputs' dtype until the writer's out_dtype)
    base, experts = _inputs(torch.float32)
    got = task_arithmetic(base=None, experts=ModelSet(base, experts, compute_dtype="bfloat16"), scaling=0.3)["w"]
    want = _ta_by_hand(base["w"].bfloat16(), [e["w"].bfloat16() for e in experts], 0.3)
    assert torch.equal(got, want)
    # input: float32 inputs compute in float32, the default's numbers
    same = task_arithmetic(base=None, experts=ModelSet(base, experts, compute_dtype="input"), scaling=0.3)["w"]
    assert torch.equal(same, task_arithmetic(base=base, experts=experts, scaling=0.3)["w"])


def test_input_on_mixed_input_dtypes_is_refused_naming_the_key():
    base, experts = _inputs()
    experts[1] = {"w": experts[1]["w"].float()}
    with pytest.raises(MergeInputError, match=r"key 'w': compute_dtype: input needs one input dtype per key.*"
                                              r"bfloat16.*float32"):
        ModelSet(base, experts, compute_dtype="input")
    # an explicit dtype is defined on mixed inputs: every input cast to it
    models = ModelSet(base, experts, compute_dtype="bfloat16")
    assert models.mixed == {"w"} and all(x.dtype == torch.bfloat16 for x in models.load("w")[1])
    with pytest.raises(ValueError, match="compute_dtype: expected input or one of"):
        ModelSet(base, experts, compute_dtype="bf16")


def test_recipe_and_mergekit_config_take_compute_dtype(tmp_path):
    base, experts = _inputs()
    paths = []
    for name, sd in zip(["base", "a", "b", "c"], [base, *experts]):
        paths.append(str(tmp_path / f"{name}.safetensors"))
        save_file(sd, paths[-1])
    assert recipe_of({"method": "ties", "models": ["x"], "compute_dtype": "input"}).compute_dtype == "input"
    # a mergekit config keeps clmerge's float32 unless it (or --compute-dtype) sets compute_dtype
    mk = {"merge_method": "task_arithmetic", "base_model": paths[0], "dtype": "bfloat16",
          "models": [{"model": p, "parameters": {"weight": 1.0}} for p in paths[1:]],
          "parameters": {"lambda": 0.3}}
    assert recipe_of(mk).compute_dtype == "float32"
    cfg = tmp_path / "mk.yml"
    cfg.write_text(yaml.safe_dump(mk))
    for flags, name in (([], "f32"), (["--compute-dtype", "input"], "in"), ([], "bf16")):
        if name == "bf16":
            cfg.write_text(yaml.safe_dump({**mk, "compute_dtype": "bfloat16"}))
        r = invoke(cfg, *flags, "--out", tmp_path / f"{name}.safetensors")
        assert r.exit_code == 0, r.output
    got = {n: load_file(str(tmp_path / f"{n}.safetensors"))["w"] for n in ("f32", "in", "bf16")}
    want = _ta_by_hand(base["w"], [e["w"] for e in experts], 0.3)
    assert torch.equal(got["in"], want) and torch.equal(got["bf16"], want)
    assert torch.equal(got["f32"], _ta_by_hand(base["w"].float(), [e["w"].float() for e in experts],
                                               0.3).bfloat16())
