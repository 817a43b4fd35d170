"""The Fisher from Linear inputs x output gradients ("hooks") equals torch.func's and the per-sample loop's."""

from __future__ import annotations

import pytest
import torch
from _lora_cl_helpers import context, tiny_setup
from torch import nn

from clmerge.adapters import lora_layers
from clmerge.params.fisher import (
    diagonal_fisher,
    per_sample_grads,
    per_sample_grads_linear,
    per_sample_loop_fisher,
    resolve_fisher_method,
)


def _pm_model(compute: str = "lowrank"):
    torch.manual_seed(0)
    scenario, model, method = tiny_setup({"name": "pm"})
    method.begin_task(scenario.tasks[0], context(scenario, 0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a non-zero LoRA, as after training
        for layer in lora_layers(model.backbone).values():
            c = layer.components["task0"]
            c.lora_up.copy_(0.1 * torch.randn(c.lora_up.shape, generator=g))
            layer.compute = compute
    names = [f"backbone.{n}.base_layer.weight" for n in lora_layers(model.backbone)]
    # value biases too (a key bias has a zero gradient: softmax ignores a constant shift of the scores)
    names += [f"backbone.{n}.base_layer.bias" for n in lora_layers(model.backbone) if "v_proj" in n]
    x, y = next(iter(scenario.tasks[0].train.batches(12, shuffle=False)))
    return model, names, [(x[:7], y[:7]), (x[7:], y[7:])]


def _max_rel(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max()) for n in b)


@pytest.mark.parametrize("compute", ["lowrank", "dense"])
def test_hooks_fisher_equals_func_and_loop(compute: str) -> None:
    model, names, batches = _pm_model(compute)
    logits_fn = lambda m, x: m(x)[:, :5]
    assert resolve_fisher_method(model, names) == "hooks"
    fh = diagonal_fisher(model, names, batches, method="hooks", logits_fn=logits_fn)
    ff = diagonal_fisher(model, names, batches, method="func", logits_fn=logits_fn)
    named = dict(model.named_parameters())
    for n in names:  # the loop reads .grad of the (frozen) base weights
        named[n].requires_grad_(True)
    fl = per_sample_loop_fisher(model, names, batches, logits_fn=logits_fn)
    for n in names:
        named[n].requires_grad_(False)
    assert all(float(fl[n].abs().max()) > 0 for n in names)
    assert _max_rel(fh, fl) < 1e-5 and _max_rel(ff, fl) < 1e-5 and _max_rel(fh, ff) < 1e-5
    # per-sample, not batch-mean: the squared mean gradient is a different (smaller) quantity
    mean_sq = diagonal_fisher(model, names, [(x, y) for b in batches for x, y in [b]], method="hooks",
                              logits_fn=logits_fn)
    assert _max_rel(mean_sq, fl) < 1e-5
    assert all(layer.compute == compute for layer in lora_layers(model.backbone).values())  # restored


def test_hooks_per_sample_grads_equal_func_per_sample_grads() -> None:
    model, names, batches = _pm_model()
    model.eval()
    x, y = batches[0]
    a = per_sample_grads_linear(model, names, x, y)
    b = per_sample_grads(model, names, x, y)
    for n in names:
        assert a[n].shape == (len(x), *dict(model.named_parameters())[n].shape)
        torch.testing.assert_close(a[n], b[n], rtol=1e-4, atol=1e-6)
        assert not dict(model.named_parameters())[n].requires_grad  # flags untouched


def test_linear_called_twice_and_fallback() -> None:
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.ln = nn.Linear(6, 6), nn.Linear(6, 3), nn.LayerNorm(6)

        def forward(self, x):
            return self.b(torch.tanh(self.a(torch.tanh(self.a(self.ln(x))))).mean(1))

    net = Net().double()
    x, y = torch.randn(5, 4, 6, dtype=torch.float64), torch.tensor([0, 1, 2, 1, 0])
    names = ["a.weight", "a.bias", "b.weight"]
    fh = diagonal_fisher(net, names, [(x, y)], method="hooks")
    ff = diagonal_fisher(net, names, [(x, y)], method="func")
    fl = per_sample_loop_fisher(net, names, [(x, y)])
    for n in names:
        torch.testing.assert_close(fh[n].double(), fl[n].double(), rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(ff[n].double(), fl[n].double(), rtol=1e-6, atol=1e-9)
    assert resolve_fisher_method(net, names + ["ln.weight"]) == "func"
    with pytest.raises(ValueError):
        diagonal_fisher(net, ["ln.weight"], [(x, y)], method="hooks")
