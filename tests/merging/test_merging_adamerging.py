"""AdaMerging on task arithmetic and on CART: the starting point is the static merge, and entropy goes down."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from clmerge import merging
from clmerge.merging.methods.adamerging import entropy


class TwoHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8))
        self.heads = nn.ModuleList([nn.Linear(8, 3), nn.Linear(8, 3)])


def setup(seed=0):
    torch.manual_seed(seed)
    m = TwoHead()
    base = {k: v.detach().clone() for k, v in m.body.state_dict().items()}
    base = {f"body.{k}": v for k, v in base.items()}
    experts = [{k: v + 0.3 * torch.randn_like(v) for k, v in base.items()} for _ in range(3)]
    data = [[torch.randn(16, 6)] for _ in range(3)]
    m.heads.append(nn.Linear(8, 3))
    return m, base, experts, data


def fwd3(model: nn.Module, task: int, x: torch.Tensor) -> torch.Tensor:
    return model.heads[task](model.body(x))


@pytest.mark.parametrize("on", ["task_arithmetic", "cart"])
def test_zero_steps_is_the_static_merge(on):
    m, base, ex, data = setup()
    out, lam = merging.adamerging(base=base, experts=ex, model=m, forward=fwd3, unlabeled=data, on=on,
                                  init=0.4, steps=0, rank_ratio=0.5)
    ref = (merging.task_arithmetic(base=base, experts=ex, scaling=0.4) if on == "task_arithmetic"
           else merging.cart(experts=ex, rank_ratio=0.5, scaling=0.4))
    for k in ref:
        torch.testing.assert_close(out[k], ref[k], atol=1e-5, rtol=1e-5)
    assert lam.shape == (3, len(base))


def test_entropy_decreases_and_taskwise_shape():
    m, base, ex, data = setup(1)

    def total_entropy(params):
        sd = {k: v for k, v in params.items()}
        with torch.no_grad():
            m.load_state_dict(sd, strict=False)
            return float(sum(entropy(fwd3(m, t, d[0])) for t, d in enumerate(data)))

    before, _ = merging.adamerging(base=base, experts=ex, model=m, forward=fwd3, unlabeled=data, steps=0)
    after, lam = merging.adamerging(base=base, experts=ex, model=m, forward=fwd3, unlabeled=data, steps=30,
                                    lr=0.05, granularity="task", clamp=None)
    assert lam.shape == (3,)
    assert total_entropy(after) < total_entropy(before)
    assert all(torch.equal(v, base[k]) for k, v in base.items())  # inputs untouched
