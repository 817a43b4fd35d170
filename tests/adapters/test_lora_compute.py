"""LoRALinear's ``dense`` compute (components added to the weight, one matmul) equals the ``lowrank`` paths and
Eq. 4 of SD-LoRA written out densely: outputs and gradients (magnitudes, current factors, input)."""

from __future__ import annotations

import copy

import pytest
import torch
from _lora_cl_helpers import context, tiny_setup
from torch import nn

from clmerge.adapters import dense_is_cheaper, lora_layers, set_lora_compute
from clmerge.adapters.lora import LoRALinear


def _sd_layer(dtype=torch.float32, n_old: int = 4, normalize_current: bool = False, seed: int = 0):
    """An SD-LoRA-like layer: n_old frozen normalised directions and one trainable current one, each with its
    own shared magnitude (trainable)."""
    g = torch.Generator().manual_seed(seed)
    base = nn.Linear(24, 20).to(dtype)
    with torch.no_grad():
        base.weight.copy_(torch.randn(base.weight.shape, generator=g, dtype=dtype) * 0.2)
        base.bias.copy_(torch.randn(base.bias.shape, generator=g, dtype=dtype) * 0.1)
    base.requires_grad_(False)
    layer = LoRALinear(base)
    mags = nn.ParameterDict({f"task{k}": nn.Parameter(torch.tensor(0.5 + 0.3 * k, dtype=dtype))
                             for k in range(n_old + 1)})
    layer.attach_magnitudes(mags)
    for k in range(n_old + 1):
        cur = k == n_old
        c = layer.add_component(f"task{k}", 3 + (k % 2), init="small", init_std=0.3, generator=g, magnitude=f"task{k}",
                                normalize="fro" if (not cur or normalize_current) else "none", scale=1.5)
        c.to(dtype)
        c.requires_grad_(cur)
    return layer, mags


def _eq4_dense(layer: LoRALinear, mags, x):
    """W = W_0 + sum_k scale alpha_k U_k D_k / ||U_k D_k||_F (norm from the dense product), written out."""
    w = layer.base_layer.weight
    for c in layer.components.values():
        ud = c.lora_up @ c.lora_down
        n = torch.linalg.matrix_norm(ud) + c.eps if c.normalize == "fro" else 1.0
        w = w + c.scale * mags[c.magnitude] * ud / n
    return nn.functional.linear(x, w, layer.base_layer.bias)


def _run(layer, mags, x, mode):
    trainable = [p for p in list(mags.values()) + list(layer.parameters()) if p.requires_grad]
    xx = x.clone().requires_grad_(True)
    if mode == "eq4":
        y = _eq4_dense(layer, mags, xx)
    else:
        layer.compute = mode
        y = layer(xx)
    w = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)
    grads = torch.autograd.grad((y * w).sum() + 0.1 * (y ** 2).sum(), trainable + [xx])
    return y.detach(), grads


@pytest.mark.parametrize("normalize_current", [False, True])
def test_dense_equals_lowrank_and_eq4_float64(normalize_current: bool) -> None:
    layer, mags = _sd_layer(torch.float64, normalize_current=normalize_current)
    x = torch.randn(3, 7, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    eq4_y, eq4_g = _run(layer, mags, x, "eq4")
    ref_y, ref_g = _run(layer, mags, x, "lowrank")
    assert len(ref_g) == 5 + 2 + 1  # 5 magnitudes, current U and D, input
    # the directions' norms are computed in fp32 (LoRAComponent.norm), hence ~1e-7 from the fp64 Eq. 4 here
    assert _rel(ref_y, eq4_y) < 1e-6 and max(_rel(a, b) for a, b in zip(ref_g, eq4_g)) < 1e-6
    for mode in ("dense", "auto"):
        y, g = _run(layer, mags, x, mode)
        torch.testing.assert_close(y, ref_y, rtol=1e-12, atol=1e-12)
        for a, b in zip(g, ref_g):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        assert _rel(y, eq4_y) < 1e-6 and max(_rel(a, b) for a, b in zip(g, eq4_g)) < 1e-6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _grouped(grads):
    """The 5 magnitude gradients as one vector (a scalar gradient can be a near-cancelling sum), then the rest."""
    return [torch.stack(list(grads[:5]))] + list(grads[5:])


def test_dense_equals_lowrank_float32_to_1e6() -> None:
    layer, mags = _sd_layer(torch.float32)
    l64, m64 = copy.deepcopy(layer).double(), copy.deepcopy(mags).double()
    l64.attach_magnitudes(m64)
    x = torch.randn(4, 9, 24, generator=torch.Generator().manual_seed(2))
    y64, g64 = _run(l64, m64, x.double(), "lowrank")  # fp64 truth
    y0, g0 = _run(layer, mags, x, "lowrank")
    y1, g1 = _run(layer, mags, x, "dense")
    assert _rel(y1, y0) < 2e-6
    assert max(_rel(a, b) for a, b in zip(_grouped(g1), _grouped(g0))) < 2e-6
    for y, g in ((y0, g0), (y1, g1)):  # both fp32 forms are as close to the fp64 values
        assert _rel(y.double(), y64) < 1e-6
        assert max(_rel(a.double(), b) for a, b in zip(_grouped(g), _grouped(g64))) < 1e-6
    # the comparison can fail: leaving out one old direction is far outside the tolerance
    del layer.components["task1"]
    with torch.no_grad():
        y2 = layer(x)
    assert _rel(y2, y0) > 1e-3


def test_no_grad_and_frozen_everything() -> None:
    layer, mags = _sd_layer(torch.float64)
    for p in list(mags.values()) + list(layer.parameters()):
        p.requires_grad_(False)
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    with torch.no_grad():
        layer.compute = "lowrank"
        a = layer(x)
        layer.compute = "dense"
        b = layer(x)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_frozen_norm_cache_follows_in_place_changes() -> None:
    layer, _mags = _sd_layer(torch.float64)
    c = layer.components["task0"]
    n1 = float(c.norm())
    assert float(c.norm()) == n1  # cached
    with torch.no_grad():
        c.lora_up.mul_(3.0)
    assert float(c.norm()) == pytest.approx(3.0 * n1, rel=1e-6)  # norms are computed in fp32
    c.normalize = "factor"
    assert float(c.norm()) == pytest.approx(float(c.lora_up.norm() * c.lora_down.norm()), rel=1e-6)


def test_auto_choice_by_flops() -> None:
    # ViT-tiny shapes: 128 -> 128, 2000 tokens, rank 10
    base = nn.Linear(128, 128).requires_grad_(False)
    layer = LoRALinear(base)
    mags = nn.ParameterDict()
    layer.attach_magnitudes(mags)
    x = torch.zeros(40, 50, 128)
    layer.add_component("task0", 10)  # one trainable component (seq_lora, P&M): low-rank paths are cheaper
    assert not dense_is_cheaper(layer, x)
    for k in range(1, 5):  # SD-LoRA after 4 tasks: 4 frozen directions with trainable magnitudes
        mags[f"task{k}"] = nn.Parameter(torch.tensor(1.0))
        layer.add_component(f"task{k}", 10, magnitude=f"task{k}", normalize="fro").requires_grad_(False)
    assert dense_is_cheaper(layer, x)
    with torch.no_grad():  # inference with several components: folding into the weight is cheaper
        assert dense_is_cheaper(layer, x)
    with pytest.raises(ValueError):
        set_lora_compute(nn.Sequential(layer), "fast")


def test_sd_lora_training_step_same_in_every_mode() -> None:
    """Whole tiny ViT, SD-LoRA at task 3 of 5 (2 frozen directions + current): loss and every gradient."""
    out = {}
    for mode in ("lowrank", "dense", "auto"):
        torch.manual_seed(0)
        scenario, model, method = tiny_setup({"name": "sd_lora", "lora_compute": mode}, n_tasks=5)
        g = torch.Generator().manual_seed(5)
        for t in range(3):
            ctx = context(scenario, t)
            method.begin_task(scenario.tasks[t], ctx)
            with torch.no_grad():
                for layer in lora_layers(model.backbone).values():
                    c = layer.components[f"task{t}"]
                    c.lora_up.copy_(0.05 * torch.randn(c.lora_up.shape, generator=g))
            if t < 2:
                method.end_task(scenario.tasks[t], ctx)
        assert all(l.compute == mode for l in lora_layers(model.backbone).values())
        model.train()
        x, y = next(iter(scenario.tasks[2].train.batches(8, shuffle=False)))
        loss = method.loss(model, x, y, ctx)
        named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        assert any("lora_magnitudes" in n for n in named) and any("lora_up" in n for n in named)
        grads = torch.autograd.grad(loss, list(named.values()))
        out[mode] = (loss.detach(), dict(zip(named, grads)))
    loss0, g0 = out["lowrank"]
    for mode in ("dense", "auto"):
        loss1, g1 = out[mode]
        assert abs(float(loss1 - loss0)) <= 1e-6 * abs(float(loss0))
        assert g1.keys() == g0.keys()
        for n in g0:
            scale = float(g0[n].abs().max())
            assert float((g1[n] - g0[n]).abs().max()) <= 1e-5 * scale + 1e-9, n
