"""Merge-based baselines (P&M Table 3): each rule against a direct transcription, the end-task merge on a model,
a 2-task end-to-end run and an identical resume."""

from __future__ import annotations

import pytest
import torch

from clmerge.adapters import lora_layers
from clmerge.methods.merge_baselines import average_step, cofima_step, coma_step, dare_step

from _lora_cl_helpers import assert_same_run, context, run_and_resume, tiny_setup

METHODS = ["lora_avg", "lora_dare", "coma", "cofima"]


def _weights(seed: int, shapes=((4, 3), (5, 2))) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(*s, generator=g) for i, s in enumerate(shapes)}


@pytest.mark.parametrize("t", [1, 2, 5])
def test_average_is_running_mean(t: int) -> None:
    prev, star = _weights(0), _weights(1)
    out = average_step(prev, star, t)
    for k in prev:  # theta^_t = ((t-1) theta^_{t-1} + theta*_t) / t
        torch.testing.assert_close(out[k].float(), ((t - 1) * prev[k] + star[k]) / t)
    pair = average_step(prev, star, t, "pair")
    for k in prev:
        torch.testing.assert_close(pair[k].float(), star[k] if t == 1 else (prev[k] + star[k]) / 2)


def test_average_of_sequence_equals_uniform_mean() -> None:
    models = [_weights(s) for s in range(4)]
    run = models[0]
    for t, m in enumerate(models[1:], start=2):
        run = {k: v.float() for k, v in average_step(run, m, t).items()}
    for k in run:
        torch.testing.assert_close(run[k], torch.stack([m[k] for m in models]).mean(0), atol=1e-6, rtol=1e-6)


def test_coma_transcription() -> None:
    prev, star = _weights(2), _weights(3)
    out = coma_step(prev, star, 0.4)
    for k in prev:
        torch.testing.assert_close(out[k].float(), 0.6 * prev[k] + 0.4 * star[k])


def test_cofima_transcription() -> None:
    prev, star = _weights(4), _weights(5)
    fp = {k: v.abs() for k, v in _weights(6).items()}
    fs = {k: v.abs() for k, v in _weights(7).items()}
    a = 0.4
    out = cofima_step(prev, star, fp, fs, a, min_fisher=0.0)
    for k in prev:  # CoFiMA (official code: interpolate_weights with fisher=True)
        want = ((1 - a) * fp[k] * prev[k] + a * fs[k] * star[k]) / ((1 - a) * fp[k] + a * fs[k])
        torch.testing.assert_close(out[k].float(), want)
    same = cofima_step(prev, star, fp, fp, a, min_fisher=0.0)  # equal Fishers: plain CoMA
    for k in prev:
        torch.testing.assert_close(same[k].float(), 0.6 * prev[k] + 0.4 * star[k])


def test_dare_drop_and_rescale() -> None:
    prev, star = _weights(8, ((60, 50),)), _weights(9, ((60, 50),))
    tau = star["w0"] - prev["w0"]
    none = dare_step(prev, star, 0.5, 0.0, seed=0)
    torch.testing.assert_close(none["w0"].float(), prev["w0"] + 0.5 * tau)
    out = dare_step(prev, star, 0.5, 0.3, seed=0)["w0"].float() - prev["w0"]
    kept = out.abs() > 1e-7
    torch.testing.assert_close(out[kept], (0.5 * tau / 0.7)[kept])  # survivors rescaled by 1/(1-p)
    assert abs((~kept).float().mean().item() - 0.3) < 0.05
    again = dare_step(prev, star, 0.5, 0.3, seed=0)["w0"].float() - prev["w0"]
    assert torch.equal(out, again)
    other = dare_step(prev, star, 0.5, 0.3, seed=1)["w0"].float() - prev["w0"]
    assert not torch.equal(out, other)


def _train_like(method, scenario, t: int) -> dict[str, torch.Tensor]:
    """begin_task, then random LoRA values (as if trained); returns theta*_t on the adapted weights."""
    ctx = context(scenario, t)
    method.begin_task(scenario.tasks[t], ctx)
    g = torch.Generator().manual_seed(100 + t)
    layers = lora_layers(method.model.backbone)
    with torch.no_grad():
        for layer in layers.values():
            c = layer.components[f"task{t}"]
            c.lora_up.copy_(0.1 * torch.randn(c.lora_up.shape, generator=g))
    return {n: layer.merged_weight().detach().clone() for n, layer in layers.items()}


@pytest.mark.parametrize("name", METHODS)
def test_end_task_applies_the_rule(name: str) -> None:
    scenario, model, method = tiny_setup({"name": name})
    layers = lora_layers(model.backbone)
    assert sorted(n.rsplit(".", 1)[1] for n in layers) == ["k_proj", "v_proj"]
    prevs, stars = [], []
    for t in range(2):
        prevs.append({n: layer.base_layer.weight.detach().clone() for n, layer in layers.items()})
        stars.append(_train_like(method, scenario, t))
        method.end_task(scenario.tasks[t], context(scenario, t))
        assert all(not layer.components for layer in layers.values())
    got = {n: layer.base_layer.weight.detach() for n, layer in layers.items()}
    p, s = prevs[1], stars[1]
    for n in got:
        if name == "lora_avg":
            want = (p[n] + s[n]) / 2
        elif name == "coma":
            want = 0.6 * p[n] + 0.4 * s[n]
        elif name == "cofima":
            f0, f1 = ({k: v + 1e-12 for k, v in f.items()} for f in method.last_fishers)
            want = (0.6 * f0[n] * p[n] + 0.4 * f1[n] * s[n]) / (0.6 * f0[n] + 0.4 * f1[n])
        else:
            d = (got[n] - p[n]) / 0.5
            kept = d.abs() > 1e-7
            torch.testing.assert_close(d[kept], ((s[n] - p[n]) / 0.5)[kept], atol=1e-5, rtol=1e-4)
            continue
        torch.testing.assert_close(got[n], want.float(), atol=1e-5, rtol=1e-4)
    assert [m["task"] for m in method.metrics()["merge"]] == [0, 1]


@pytest.mark.parametrize("name", METHODS)
def test_two_task_run_and_identical_resume(name: str, tmp_path) -> None:
    full, resumed = run_and_resume({"name": name}, tmp_path)
    assert_same_run(full, resumed)
    R = full["accuracy_matrix"]
    assert len(R) == 2 and R[1][0] is not None and R[1][1] is not None
