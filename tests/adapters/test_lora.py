import copy

import pytest
import torch
from torch import nn

from clmerge.adapters import (
    LoRALinear,
    add_lora_component,
    fold_component,
    gram_frobenius_norm,
    inject_lora,
    lora_layers,
    model_structure,
    rebuild_structure,
)
from clmerge.models import ContinualClassifier, IncrementalHead, build_backbone
from conftest import TINY_VIT


def tiny_model():
    torch.manual_seed(0)
    bb = build_backbone("vit-tiny-fmnist", pretrained=False, config=dict(TINY_VIT, num_hidden_layers=2))
    head = IncrementalHead(bb.feature_dim)
    head.grow(3, generator=torch.Generator().manual_seed(0))
    return ContinualClassifier(bb, head)


def test_zero_init_lora_leaves_outputs_unchanged():
    m = tiny_model()
    x = torch.rand(4, 1, 28, 28)
    before = m(x)
    names = inject_lora(m.backbone, ["query", "value"], magnitudes=m.lora_magnitudes)
    assert len(names) == 4 and all(n.endswith(("q_proj", "v_proj")) for n in names)
    add_lora_component(m.backbone, "t0", 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(m(x), before)  # up-projection starts at zero


def test_fold_matches_unfolded_forward():
    m = tiny_model()
    inject_lora(m.backbone, ["query", "key", "value"], magnitudes=m.lora_magnitudes)
    g = torch.Generator().manual_seed(2)
    add_lora_component(m.backbone, "t0", 3, generator=g, init="small", init_std=0.2, scale=0.7)
    m.lora_magnitudes["a1"] = nn.Parameter(torch.tensor(1.3))
    add_lora_component(m.backbone, "t1", 2, generator=g, init="small", init_std=0.2, normalize="fro", magnitude="a1")
    x = torch.rand(5, 1, 28, 28)
    unfolded = m(x)
    assert not torch.allclose(unfolded, tiny_model()(x), atol=1e-3)  # the components do something
    fold_component(m.backbone, "t0")
    fold_component(m.backbone, "t1")
    assert all(len(layer.components) == 0 for layer in lora_layers(m).values())
    torch.testing.assert_close(m(x), unfolded, atol=1e-5, rtol=1e-5)


def test_component_coefficient_formula_against_dense():
    base = nn.Linear(6, 5)
    layer = LoRALinear(base)
    mags = nn.ParameterDict({"m": nn.Parameter(torch.tensor(0.5))})
    layer.attach_magnitudes(mags)
    c = layer.add_component("c", 2, init="small", init_std=0.5, scale=2.0, normalize="fro", magnitude="m",
                            generator=torch.Generator().manual_seed(0))
    c.multiplier = 1.1
    x = torch.randn(3, 6)
    ud = c.lora_up @ c.lora_down
    dense = base.weight + 2.0 * 0.5 * 1.1 * ud / torch.linalg.matrix_norm(ud)
    torch.testing.assert_close(layer(x), x @ dense.t() + base.bias, atol=1e-6, rtol=1e-5)
    c.normalize = "factor"
    dense = base.weight + 2.0 * 0.5 * 1.1 * ud / (c.lora_up.norm() * c.lora_down.norm())
    torch.testing.assert_close(layer(x), x @ dense.t() + base.bias, atol=1e-6, rtol=1e-5)


def test_gram_norm_equals_dense_norm():
    g = torch.Generator().manual_seed(3)
    up, down = torch.randn(40, 5, generator=g), torch.randn(5, 30, generator=g)
    assert gram_frobenius_norm(up, down) == pytest.approx(float(torch.linalg.matrix_norm(up @ down)), rel=1e-5)


def test_gradients_reach_magnitudes_and_factors():
    layer = LoRALinear(nn.Linear(4, 4))
    mags = nn.ParameterDict({"m": nn.Parameter(torch.tensor(1.0))})
    layer.attach_magnitudes(mags)
    layer.add_component("c", 2, init="small", init_std=0.3, normalize="fro", magnitude="m")
    layer(torch.randn(2, 4)).sum().backward()
    assert mags["m"].grad is not None and layer.components["c"].lora_up.grad is not None
    assert layer.base_layer.weight.grad is not None  # base not frozen by the wrapper itself (methods freeze)


def test_inject_errors_and_aliases():
    m = tiny_model()
    with pytest.raises(ValueError, match="matched no Linear layer"):
        inject_lora(m, ["nonexistent_proj"])
    names = inject_lora(m.backbone, ["re:.*layers\\.0\\.attention\\.o_proj"])
    assert names == ["inner.layers.0.attention.o_proj"]
    assert inject_lora(m.backbone, ["output"])  # second call keeps existing wrappers
    with pytest.raises(ValueError, match="already exists"):
        lay = next(iter(lora_layers(m).values()))
        lay.add_component("x", 1)
        lay.add_component("x", 1)


def test_structure_round_trip_loads_strictly():
    m = tiny_model()
    inject_lora(m.backbone, ["query", "value"], magnitudes=m.lora_magnitudes)
    m.lora_magnitudes["t0"] = nn.Parameter(torch.tensor(0.8))
    add_lora_component(m.backbone, "t0", 3, normalize="factor", magnitude="t0", init="small")
    for p in m.backbone.parameters():
        p.requires_grad_(False)
    m.head.grow(2)
    struct, state = model_structure(m), copy.deepcopy(m.state_dict())
    fresh = tiny_model()
    rebuild_structure(fresh, struct)
    fresh.load_state_dict(state, strict=True)
    x = torch.rand(3, 1, 28, 28)
    torch.testing.assert_close(fresh(x), m(x))
    assert [n for n, p in fresh.named_parameters() if p.requires_grad] == [
        n for n, p in m.named_parameters() if p.requires_grad]
