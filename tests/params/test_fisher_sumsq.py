"""``squared_sum`` (the chunked sum of squared per-sample gradients in ``diagonal_fisher``) equals the direct
``g.double().pow(2).sum(0)`` bit for bit, and so does the Fisher of a small conv net (EWC's end-of-task step)."""

from __future__ import annotations

import pytest
import torch

from clmerge.models import build_backbone
from clmerge.params import fisher as fisher_mod
from clmerge.params.fisher import diagonal_fisher, squared_sum


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference reduction itself splits columns across threads
    yield
    torch.set_num_threads(n)


SHAPES = [(1, 37), (5, 3), (32, 20), (7, 129, 3), (17, 50, 80), (32, 50, 20, 5, 5), (3, 4097), (64, 1000),
          (32, 199, 801)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk", [7, 1000, 1 << 12, 1 << 18])
def test_squared_sum_is_the_reference_bit_for_bit(one_thread, shape, chunk):
    g = torch.Generator().manual_seed(len(shape) * 1000 + shape[-1])
    x = torch.randn(shape, generator=g) * torch.rand(shape[1:], generator=g) * 1e-2
    assert torch.equal(squared_sum(x, chunk=chunk), x.double().pow(2).sum(0))


def test_squared_sum_non_contiguous_and_1d(one_thread):
    x = torch.randn(80, 32, 30).transpose(0, 1)  # (32, 80, 30), not contiguous
    assert torch.equal(squared_sum(x, chunk=64), x.double().pow(2).sum(0))
    v = torch.randn(11)
    assert torch.equal(squared_sum(v), v.double().pow(2).sum(0))


def test_diagonal_fisher_unchanged_on_a_conv_net(one_thread, monkeypatch):
    torch.manual_seed(0)
    net = build_backbone("lenet", pretrained=False, config={"image_size": 16, "channels": [4, 8], "fc": [200, 16]})
    model = torch.nn.Sequential(net, torch.nn.Linear(16, 5))
    names = [n for n, _ in model.named_parameters()]
    g = torch.Generator().manual_seed(1)
    batches = [(torch.rand(13, 3, 16, 16, generator=g), torch.randint(0, 5, (13,), generator=g)) for _ in range(3)]
    new = diagonal_fisher(model, names, batches, max_samples=30)
    monkeypatch.setattr(fisher_mod, "squared_sum", lambda t: t.double().pow(2).sum(0))  # the old expression
    old = diagonal_fisher(model, names, batches, max_samples=30)
    assert new.keys() == old.keys() and all(torch.equal(new[n], old[n]) for n in names)
