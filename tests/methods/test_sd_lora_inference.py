"""SD-LoRA evaluates a folded copy: same outputs as the unfolded model (1e-5), no LoRA left, cached."""

from __future__ import annotations

import torch

from clmerge.adapters import lora_layers
from clmerge.adapters.folded import folded_copy, has_lora
from clmerge.adapters.lora import LoRALinear

from _lora_cl_helpers import context, tiny_setup


def _two_tasks(method, scenario) -> None:
    g = torch.Generator().manual_seed(3)
    for t in range(2):
        ctx = context(scenario, t)
        method.begin_task(scenario.tasks[t], ctx)
        with torch.no_grad():
            for layer in lora_layers(method.model.backbone).values():
                c = layer.components[f"task{t}"]
                c.lora_up.copy_(0.05 * torch.randn(c.lora_up.shape, generator=g))
            for p in method.model.lora_magnitudes.values():
                p.mul_(1.0 + 0.3 * torch.rand((), generator=g))
        method.end_task(scenario.tasks[t], ctx)


def _batch(scenario) -> torch.Tensor:
    x, _ = next(iter(scenario.tasks[0].test.batches(8, shuffle=False)))
    return x


def test_folded_inference_equals_unfolded_and_has_no_lora() -> None:
    scenario, model, method = tiny_setup({"name": "sd_lora"})
    _two_tasks(method, scenario)
    inf = method.inference_model()
    assert inf is not model
    assert not has_lora(inf) and not any(isinstance(m, LoRALinear) for m in inf.modules())
    assert not any("components" in n or "lora_" in n for n, _ in inf.named_parameters())
    assert len(lora_layers(model.backbone)) > 0 and all(len(l.components) == 2 for l in lora_layers(model.backbone).values())
    model.eval()
    x = _batch(scenario)
    with torch.no_grad():
        torch.testing.assert_close(inf(x), model(x), atol=1e-5, rtol=1e-5)
    plain = sum(p.numel() for n, p in inf.named_parameters())
    base = sum(p.numel() for n, p in model.named_parameters() if "components" not in n and "lora_magnitudes" not in n)
    assert plain == base  # the plain backbone's parameter count: no extra inference cost


def test_folded_copy_is_cached_and_refreshed() -> None:
    scenario, model, method = tiny_setup({"name": "sd_lora"})
    _two_tasks(method, scenario)
    a = method.inference_model()
    assert method.inference_model() is a
    with torch.no_grad():
        next(iter(model.lora_magnitudes.values())).add_(0.5)  # an in-place update, as an optimizer step
    b = method.inference_model()
    assert b is not a
    model.eval()
    x = _batch(scenario)
    with torch.no_grad():
        torch.testing.assert_close(b(x), model(x), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(a(x), b(x))


def test_fold_inference_off_returns_live_model() -> None:
    scenario, model, method = tiny_setup({"name": "sd_lora", "fold_inference": False})
    assert method.inference_model() is model
    assert has_lora(folded_copy(model)) is False
