"""LoRA-P&M: closed-form alpha (Eq. 8), running sums, perturbation sampler (Eq. 15-16), end to end."""

from __future__ import annotations

import pytest
import torch

from clmerge.adapters import lora_layers
from clmerge.methods.pm import (closed_form_alpha, closed_form_alpha_stored, eager_attention,
                                sample_perturbation)

from _lora_cl_helpers import assert_same_run, context, run_and_resume, tiny_setup

SHAPES = {"a": (4, 3), "b": (5,)}


def _rand(gen: torch.Generator, scale: float = 1.0, positive: bool = False) -> dict[str, torch.Tensor]:
    out = {n: torch.randn(s, generator=gen, dtype=torch.float64) * scale for n, s in SHAPES.items()}
    return {n: v.abs() for n, v in out.items()} if positive else out


def _sequence(n_tasks: int, seed: int = 0):
    """Random Fisher F_i and task vectors Delta_i for a sequence of tasks."""
    gen = torch.Generator().manual_seed(seed)
    return [(_rand(gen, positive=True), _rand(gen, 0.5)) for _ in range(n_tasks)]


def _alphas(seq, store: str) -> list[float]:
    merged = {n: torch.zeros(s, dtype=torch.float64) for n, s in SHAPES.items()}
    sum_f, sum_fu, fishers, optima, alphas = {}, {}, [], [], []
    for fisher, delta in seq:
        optimum = {n: merged[n] + delta[n] for n in SHAPES}
        if store == "stored":
            fishers.append(fisher)
            optima.append(optimum)
            num, den = closed_form_alpha_stored(delta, fishers, optima, merged)
        else:
            for n in SHAPES:
                sum_f[n] = sum_f.get(n, 0) + fisher[n]
                sum_fu[n] = sum_fu.get(n, 0) + fisher[n] * optimum[n]
            num, den = closed_form_alpha(delta, sum_f, sum_fu, merged)
        alpha = -num / den
        alphas.append(alpha)
        merged = {n: merged[n] + alpha * delta[n] for n in SHAPES}
    return alphas


def test_alpha_is_one_on_first_task() -> None:
    for seed in range(5):
        assert _alphas(_sequence(1, seed), "sums")[0] == pytest.approx(1.0, abs=1e-12)


def test_running_sums_equal_stored_form() -> None:
    seq = _sequence(6, seed=3)
    a, b = _alphas(seq, "sums"), _alphas(seq, "stored")
    assert a == pytest.approx(b, rel=1e-10, abs=1e-12)
    assert any(abs(x - 1.0) > 1e-3 for x in a[1:])


def test_eq8_is_minimiser_of_quadratic_surrogate() -> None:
    """Eq. 7: J(alpha) = sum_i 1/2 (M + alpha Delta - u_i)^T F_i (...); grid search agrees with Eq. 8."""
    gen = torch.Generator().manual_seed(7)
    fishers = [_rand(gen, positive=True) for _ in range(3)]
    optima = [_rand(gen) for _ in range(3)]
    merged, delta = _rand(gen), _rand(gen)
    optima[-1] = {n: merged[n] + delta[n] for n in SHAPES}  # u_t = theta^_{t-1} + Delta_t
    num, den = closed_form_alpha_stored(delta, fishers, optima, merged)
    grid = torch.linspace(-3, 3, 600001, dtype=torch.float64)
    j = torch.zeros_like(grid)
    for f, u in zip(fishers, optima):
        for n in SHAPES:
            d = (merged[n] - u[n]).flatten()
            dd, ff = delta[n].flatten(), f[n].flatten()
            j += 0.5 * ((d[None] + grid[:, None] * dd[None]).pow(2) * ff[None]).sum(1)
    assert float(grid[j.argmin()]) == pytest.approx(-num / den, abs=2e-5)


def test_sampler_frequencies_match_probabilities() -> None:
    gen = torch.Generator().manual_seed(0)
    draws = torch.tensor([sample_perturbation(0.5, 0.2, gen) for _ in range(40000)])
    for value, p in ((-0.5, 0.4), (0.0, 0.2), (0.5, 0.4)):
        assert float((draws == value).double().mean()) == pytest.approx(p, abs=0.01)


def _pm(perturbation: str = "task_vector"):
    scenario, model, method = tiny_setup({"name": "pm", "rank": 2, "perturbation": perturbation})
    ctx = context(scenario, 0)
    method.begin_task(scenario.tasks[0], ctx)
    with torch.no_grad():
        for layer in lora_layers(model.backbone).values():
            layer.components["task0"].lora_up.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    x, y = scenario.tasks[0].train.get_batch(torch.arange(8))
    return model, method, ctx, x, y


def test_perturbation_is_task_vector_scaling_and_unbiased() -> None:
    """(1+eps~) LoRA_t equals the dense theta + eps~ Delta_t; mean of the sampled loss equals Eq. 14."""
    model, method, ctx, x, y = _pm()
    layer = next(iter(lora_layers(model.backbone).values()))
    inp = torch.randn(3, 32)
    with method._scaled(1.5):
        got = layer(inp)
    want = inp @ (layer.base_layer.weight + 1.5 * layer.delta_weight("task0")).t() + layer.base_layer.bias
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        losses = {}
        for e in (-0.5, 0.0, 0.5):
            with method._scaled(1.0 + e):
                losses[e] = float(method._ce(model, x, y, ctx))
        method.options.perturbation = "exact"
        exact = float(method.loss(model, x, y, ctx))
        method.options.perturbation = "task_vector"
        for _ in range(30):  # each sampled loss is the loss at the drawn scale (the draw replayed on a clone)
            replay = torch.Generator().set_state(ctx.generator.get_state())
            e = sample_perturbation(0.5, 1 / 3, replay)
            assert float(method.loss(model, x, y, ctx)) == pytest.approx(losses[e], rel=1e-6)
    gen = torch.Generator().manual_seed(5)
    samples = torch.tensor([losses[sample_perturbation(0.5, 1 / 3, gen)] for _ in range(40000)], dtype=torch.float64)
    p0 = 1 / 3
    assert exact == pytest.approx(p0 * losses[0.0] + (1 - p0) / 2 * (losses[0.5] + losses[-0.5]), rel=1e-6)
    assert len(set(losses.values())) == 3
    assert float(samples.mean()) == pytest.approx(exact, abs=4 * float(samples.std()) / 40000**0.5 + 1e-9)


def test_gradient_flows_through_the_scale() -> None:
    model, method, ctx, x, y = _pm()
    up = next(iter(lora_layers(model.backbone).values())).components["task0"].lora_up
    grads = {}
    for e in (0.0, 0.5):
        up.grad = None
        with method._scaled(1.0 + e):
            method._ce(model, x, y, ctx).backward()
        grads[e] = up.grad.clone()
    assert not torch.allclose(grads[0.0], grads[0.5])


def test_gaussian_ablation_changes_output_with_equal_norm() -> None:
    model, method, ctx, x, y = _pm("gaussian")
    with torch.no_grad():
        base = model(x)
        with method._gaussian_noise(0.5, torch.Generator().manual_seed(0)):
            noisy = model(x)
    assert not torch.allclose(base, noisy)


def test_eager_attention_restores_setting() -> None:
    scenario, model, method = tiny_setup({"name": "pm", "rank": 2})
    cfgs = [m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")]
    before = [c._attn_implementation for c in cfgs]
    with eager_attention(model):
        assert all(c._attn_implementation == "eager" for c in cfgs)
    assert [c._attn_implementation for c in cfgs] == before


@pytest.mark.parametrize("options", [{}, {"alpha_store": "per_task", "perturbation": "exact"}])
def test_end_to_end_and_resume(options: dict, tmp_path) -> None:
    full, resumed = run_and_resume({"name": "pm", "rank": 2, **options}, tmp_path)
    assert_same_run(full, resumed)
    alphas = full["method_metrics"]["alpha"]
    assert alphas[0] == pytest.approx(1.0) and 0.0 <= alphas[1] <= 1.0


def test_running_sums_and_stored_runs_agree(tmp_path) -> None:
    from clmerge.engine.run import run_experiment
    from _lora_cl_helpers import tiny_config

    a = run_experiment(tiny_config({"name": "pm", "rank": 2}), tmp_path / "a")
    b = run_experiment(tiny_config({"name": "pm", "rank": 2, "alpha_store": "per_task"}), tmp_path / "b")
    assert a["method_metrics"]["alpha_raw"] == pytest.approx(b["method_metrics"]["alpha_raw"], rel=1e-9)


def test_fisher_of_adapted_weights_matches_per_sample_loop() -> None:
    """Eq. 10 from vectorised per-sample gradients (eager attention) equals one backward per sample."""
    from clmerge.params import per_sample_loop_fisher

    model, method, ctx, _, _ = _pm()
    task = ctx.task
    fisher = method._fisher(task, ctx)
    names = {n: f"backbone.{n}.base_layer.weight" for n in fisher}
    params = dict(model.named_parameters())
    for full in names.values():
        params[full].requires_grad_(True)
    lo, hi = task.class_range
    batches = ((x, y - lo) for x, y in task.train.batches(32, shuffle=False))
    ref = per_sample_loop_fisher(model, list(names.values()), batches, logits_fn=lambda m, x: m(x)[:, lo:hi])
    for n, full in names.items():
        torch.testing.assert_close(fisher[n], ref[full], rtol=1e-4, atol=1e-10)
