"""InfLoRA: designed down-projection outside old tasks' input subspace, DualGPM bookkeeping, end to end."""

from __future__ import annotations

import torch

from clmerge.adapters import lora_layers
from clmerge.methods.inflora import project_covariance, update_dual_gpm

from _lora_cl_helpers import assert_same_run, context, run_and_resume, tiny_setup


def _cov(rank: int, d: int = 12, seed: int = 0) -> torch.Tensor:
    x = torch.randn(200, rank, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    mix = torch.randn(rank, d, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return (x @ mix).t() @ (x @ mix) / 200


def test_dual_gpm_remove_then_retain() -> None:
    cov = _cov(3)
    basis, kind = update_dual_gpm(cov, None, None, threshold=0.999)
    s2 = torch.linalg.svdvals(cov).pow(2)
    r = int((torch.cumsum(s2 / s2.sum(), 0) < 0.999).sum())  # the official criterion (Eq. 5)
    assert kind == "remove" and basis.shape == (12, max(r, 1))
    torch.testing.assert_close(basis.t() @ basis, torch.eye(basis.shape[1], dtype=torch.float64))
    assert float((basis.t() @ project_covariance(cov, basis, kind)).abs().max()) < 1e-8
    basis, kind = update_dual_gpm(_cov(6, seed=5), basis, kind, threshold=0.999)
    assert kind == "retain" and basis.shape[1] <= 6  # 9 > d/2 directions used: keep the free complement
    torch.testing.assert_close(basis.t() @ basis, torch.eye(basis.shape[1], dtype=torch.float64))


def test_designed_down_projection_avoids_old_subspace() -> None:
    scenario, model, method = tiny_setup({"name": "inflora", "rank": 2, "lamb": 0.5})
    for t in range(2):
        ctx = context(scenario, t)
        method.begin_task(scenario.tasks[t], ctx)
        for name, layer in lora_layers(model.backbone).items():
            comp = layer.components[f"task{t}"]
            assert not comp.lora_down.requires_grad and comp.lora_up.requires_grad
            assert float(comp.lora_up.detach().abs().max()) == 0.0
            if t == 1:
                basis, kind = method.bases[name], method.kinds[name]
                down = comp.lora_down.double()
                if kind == "remove":  # rows orthogonal to the old input subspace
                    assert float((down @ basis).abs().max()) < 1e-5
                else:  # rows inside the free subspace
                    torch.testing.assert_close(down @ basis @ basis.t(), down, atol=1e-5, rtol=1e-5)
        method.end_task(scenario.tasks[t], ctx)
        assert all(not layer.components for layer in lora_layers(model.backbone).values())  # folded


def test_end_to_end_and_resume(tmp_path) -> None:
    full, resumed = run_and_resume({"name": "inflora", "rank": 2}, tmp_path)
    assert_same_run(full, resumed)
    assert len(full["method_metrics"]["gpm_dims"]) == 2
