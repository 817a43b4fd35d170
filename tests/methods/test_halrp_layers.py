"""HALRP layers (Eq. 2 / Eq. 7), per-task BN, task routing, and the small networks of HALRP's App. F.2."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from clmerge.methods.halrp.layers import HALRPConv2d, HALRPLinear, wrap_halrp_layers
from clmerge.adapters.task_modules import TaskBatchNorm, set_active_task, wrap_batchnorms
from clmerge.models import build_backbone


def _fill(f, g):
    with torch.no_grad():
        for p in f.parameters():
            p.copy_(torch.randn(p.shape, generator=g))


def test_linear_task_weight_is_elementwise_formula():
    g = torch.Generator().manual_seed(0)
    layer = HALRPLinear(nn.Linear(5, 4))
    f = layer.add_task(1, rank=2)
    _fill(f, g)
    w = layer.base_layer.weight
    expect = torch.empty(4, 5)
    for j in range(4):
        for i in range(5):  # (W_t)_ji = r_j w_ji s_i + b_ji   (Eq. 2)
            expect[j, i] = f.r[j] * w[j, i] * f.s[i] + (f.u[j] @ f.v[:, i])
    torch.testing.assert_close(layer.task_weight(1), expect)
    x = torch.randn(3, 5, generator=g)
    layer.active_task = 1
    code_form = f.r * F.linear(f.s * x, w) + f.bias + (x @ f.v.T) @ f.u.T  # Eq. 2 as the official code computes it
    torch.testing.assert_close(layer(x), code_form)
    layer.active_task = 0
    torch.testing.assert_close(layer(x), layer.base_layer(x))


def test_conv_broadcasts_b_over_kernel_positions():
    g = torch.Generator().manual_seed(1)
    base = nn.Conv2d(3, 4, 3, padding=1, stride=2)
    layer = HALRPConv2d(base)
    f = layer.add_task(1, rank=2)
    _fill(f, g)
    x = torch.randn(2, 3, 7, 7, generator=g)
    layer.active_task = 1
    scaled = f.r.view(1, -1, 1, 1) * F.conv2d(f.s.view(1, -1, 1, 1) * x, base.weight, None, 2, 1)
    b = (f.u @ f.v)[:, :, None, None].expand(-1, -1, 3, 3)  # Eq. 7, official code: sum pooling of V'x, then U'
    expect = scaled + F.conv2d(x, b, f.bias, 2, 1)
    torch.testing.assert_close(layer(x), expect, atol=1e-5, rtol=1e-5)
    assert layer.kernel_positions == 9


def test_structure_roundtrip_and_wrapping():
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(2 * 4 * 4, 3), nn.BatchNorm1d(3))
    names = wrap_halrp_layers(net)
    assert names == ["0", "3"]
    wrap_batchnorms(net)
    assert isinstance(net[1], TaskBatchNorm) and isinstance(net[4], TaskBatchNorm)
    net[0].add_task(1, 2), net[3].add_task(1, 3), net[1].add_task(), net[4].add_task()
    assert net[3].get_structure() == {"ranks": {"1": 3}}
    other = HALRPLinear(nn.Linear(32, 3))
    other.set_structure(net[3].get_structure())
    assert other.factors(1).u.shape == (3, 3)
    set_active_task(net, 1)
    assert net[0].active_task == net[1].active_task == 1
    assert net(torch.rand(4, 1, 6, 6)).shape == (4, 3)


@pytest.mark.parametrize("name,params,dim", [("mlp", 266_752, 256), ("lenet", 2_990_610, 500),
                                             ("alexnet", None, 2048), ("resnet18_reduced", None, 1024)])
def test_small_nets(name, params, dim):
    torch.manual_seed(0)
    b = build_backbone(name, pretrained=False, source=None, config={})
    out = b(torch.rand(2, 1, 28, 28))
    assert out.shape == (2, dim)
    if params is not None:  # LeNet: "about 3.0M parameters" (App. F.2); MLP 784-256-256
        assert b.info["parameters"] == params


def test_small_net_overrides_and_errors():
    b = build_backbone("lenet", pretrained=False, source=None, config={"channels": [64, 128], "fc": [2500, 1500]})
    assert b.feature_dim == 1500  # extended LeNet (Omniglot)
    with pytest.raises(ValueError, match="model.source"):
        build_backbone("mlp", pretrained=False, source="x", config={})
    with pytest.raises(ValueError, match="model.config"):
        build_backbone("mlp", pretrained=False, source=None, config={"widht": 3})
