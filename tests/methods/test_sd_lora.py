"""SD-LoRA (Eq. 4), its Table 4 ablations, RR (Eq. 6) and KD (Eq. 7-8)."""

from __future__ import annotations

import pytest
import torch

from clmerge.adapters import lora_layers
from clmerge.adapters.lora import LoRALinear
from clmerge.methods.sd_lora import direction_gram, least_squares_fit

from _lora_cl_helpers import assert_same_run, context, run_and_resume, tiny_setup


def _randomise(model, gen: torch.Generator) -> None:
    with torch.no_grad():
        for layer in lora_layers(model.backbone).values():
            for c in layer.components.values():
                c.lora_up.normal_(0, 0.3, generator=gen)
                c.lora_down.normal_(0, 0.3, generator=gen)
        for p in model.lora_magnitudes.values():
            p.uniform_(0.5, 1.5, generator=gen)


def _dense_direction(comp, norm: str) -> torch.Tensor:
    prod = comp.lora_up.double() @ comp.lora_down.double()
    if norm == "fro":
        return prod / torch.linalg.matrix_norm(prod)
    return prod / (comp.lora_up.double().norm() * comp.lora_down.double().norm())


@pytest.mark.parametrize("norm", ["fro", "factor"])
@pytest.mark.parametrize("normalize_current", [False, True])
def test_eq4_forward_equals_dense(norm: str, normalize_current: bool) -> None:
    scenario, model, method = tiny_setup({"name": "sd_lora", "rank": 3, "norm": norm,
                                          "normalize_current": normalize_current})
    for t in range(2):
        method.begin_task(scenario.tasks[t], context(scenario, t))
    _randomise(model, torch.Generator().manual_seed(1))
    mags = model.lora_magnitudes
    x = torch.randn(4, 5, 32)
    for layer in lora_layers(model.backbone).values():
        w = layer.base_layer.weight.double().clone()
        old, cur = layer.components["task0"], layer.components["task1"]
        w += mags["task0"].double() * _dense_direction(old, norm)  # frozen: always normalised
        cur_dir = _dense_direction(cur, norm) if normalize_current else cur.lora_up.double() @ cur.lora_down.double()
        w += mags["task1"].double() * cur_dir
        want = x.double() @ w.t() + layer.base_layer.bias.double()
        torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)


def test_shared_magnitudes_and_trainability() -> None:
    scenario, model, method = tiny_setup({"name": "sd_lora", "rank": 2})
    for t in range(2):
        method.begin_task(scenario.tasks[t], context(scenario, t))
    assert set(model.lora_magnitudes) == {"task0", "task1"}
    assert all(p.requires_grad for p in model.lora_magnitudes.values())
    assert all(float(p.detach()) == 1.0 for p in model.lora_magnitudes.values())  # paper: initialised to ones
    for layer in lora_layers(model.backbone).values():
        assert layer.components["task0"].magnitude == "task0"
        assert not any(p.requires_grad for p in layer.components["task0"].parameters())
        assert all(p.requires_grad for p in layer.components["task1"].parameters())
        assert layer.components["task0"].normalize == "fro" and layer.components["task1"].normalize == "none"
    assert not any(p.requires_grad for n, p in model.backbone.named_parameters() if "components" not in n)


def test_code_magnitude_reinit() -> None:
    scenario, model, method = tiny_setup({"name": "sd_lora", "rank": 2, "magnitude_init": 0.8,
                                          "magnitude_reinit": True})
    method.begin_task(scenario.tasks[0], context(scenario, 0))
    with torch.no_grad():
        model.lora_magnitudes["task0"].fill_(2.0)
    method.begin_task(scenario.tasks[1], context(scenario, 1))
    assert [float(p.detach()) for p in model.lora_magnitudes.values()] == pytest.approx([0.8, 0.8])


def test_table4_variants() -> None:
    scenario, model, method = tiny_setup({"name": "sd_lora", "rank": 2, "variant": "fixed_first_direction"})
    for t in range(2):
        method.begin_task(scenario.tasks[t], context(scenario, t))
    layer = next(iter(lora_layers(model.backbone).values()))
    assert list(layer.components) == ["task0"] and list(model.lora_magnitudes) == ["task0"]
    assert not any(p.requires_grad for p in layer.components.parameters()) and model.lora_magnitudes["task0"].requires_grad

    scenario, model, method = tiny_setup({"name": "sd_lora", "rank": 2, "variant": "single_component"})
    for t in range(2):
        method.begin_task(scenario.tasks[t], context(scenario, t))
    layer = next(iter(lora_layers(model.backbone).values()))
    assert list(layer.components) == ["task0"] and layer.components["task0"].normalize == "fro"
    assert all(p.requires_grad for p in layer.components.parameters())

    scenario, model, method = tiny_setup({"name": "sd_lora", "rank": 2, "variant": "no_rescale"})
    method.begin_task(scenario.tasks[0], context(scenario, 0))
    with torch.no_grad():
        model.lora_magnitudes["task0"].fill_(3.0)
    method.begin_task(scenario.tasks[1], context(scenario, 1))
    m0, m1 = model.lora_magnitudes["task0"], model.lora_magnitudes["task1"]
    assert float(m0.detach()) == 1.0 and not m0.requires_grad and m1.requires_grad


@pytest.mark.parametrize("indexing,expected", [("paper", [10, 10, 10, 8, 8, 8, 8, 6, 6]),
                                               ("code", [10, 10, 10, 10, 8, 8, 8, 8, 6])])
def test_rr_schedule(indexing: str, expected: list[int]) -> None:
    _, _, method = tiny_setup({"name": "sd_lora_rr", "rr_indexing": indexing})
    assert [method.rank_for_task(t) for t in range(9)] == expected


def _layers_with(components: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> LoRALinear:
    layer = LoRALinear(torch.nn.Linear(6, 5))
    for name, (up, down) in components.items():
        c = layer.add_component(name, up.shape[1], init="zeros")
        with torch.no_grad():
            c.lora_up.copy_(up)
            c.lora_down.copy_(down)
    return layer


def _orthogonal_pair(gen: torch.Generator) -> dict:
    """Two rank-2 components with disjoint output rows: orthogonal unit directions in each layer."""
    u1, u2 = torch.zeros(5, 2), torch.zeros(5, 2)
    u1[:2] = torch.randn(2, 2, generator=gen)
    u2[2:4] = torch.randn(2, 2, generator=gen)
    return {"task0": (u1, torch.randn(2, 6, generator=gen)), "task1": (u2, torch.randn(2, 6, generator=gen))}


def test_direction_gram_matches_dense() -> None:
    gen = torch.Generator().manual_seed(0)
    comps = {f"task{k}": (torch.randn(5, 2, generator=gen), torch.randn(2, 6, generator=gen)) for k in range(3)}
    layers = [_layers_with(comps), _layers_with({k: (u * 2, d) for k, (u, d) in comps.items()})]
    for norm in ("fro", "factor"):
        gram = direction_gram(layers, list(comps), norm)
        vecs = [torch.cat([_dense_direction(layer.components[k], norm).flatten() for layer in layers]) for k in comps]
        dense = torch.stack([torch.stack([a @ b for b in vecs]) for a in vecs])
        torch.testing.assert_close(gram, dense)


def test_kd_fit_absorbs_combination_keeps_other() -> None:
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(2):
        pair = _orthogonal_pair(gen)
        (u1, d1), (u2, d2) = pair["task0"], pair["task1"]
        n1, n2 = torch.linalg.matrix_norm(u1 @ d1), torch.linalg.matrix_norm(u2 @ d2)
        # new = 0.6 d_1 + 0.8 d_2 (unit norm in every layer, so one shared coefficient per task fits exactly)
        pair["task2"] = (torch.cat([0.6 * u1 / n1, 0.8 * u2 / n2], 1) * 3.0, torch.cat([d1, d2], 0))
        layers.append(_layers_with(pair))
    coef, res = least_squares_fit(direction_gram(layers, ["task0", "task1", "task2"], "fro"))
    assert res < 1e-6
    torch.testing.assert_close(coef, torch.tensor([0.6, 0.8], dtype=torch.float64))
    for layer in layers:  # a new direction outside the old span is kept
        with torch.no_grad():
            layer.components["task2"].lora_up.normal_(generator=gen)
    _, res = least_squares_fit(direction_gram(layers, ["task0", "task1", "task2"], "fro"))
    assert res > 0.1


@pytest.mark.parametrize("merge", ["paper", "function_preserving"])
def test_kd_method_absorbs_copy_of_old_direction(merge: str) -> None:
    scenario, model, method = tiny_setup({"name": "sd_lora_kd", "rank": 2, "kd_merge": merge})
    events = []
    for t in range(2):
        ctx = context(scenario, t)
        ctx.log = events.append
        method.begin_task(scenario.tasks[t], ctx)
        if t == 1:  # the new direction is exactly the old one (scaled): fit coefficient 1, residual 0
            with torch.no_grad():
                for layer in lora_layers(model.backbone).values():
                    old, new = layer.components["task0"], layer.components["task1"]
                    new.lora_up.copy_(2 * old.lora_up)
                    new.lora_down.copy_(old.lora_down)
                model.lora_magnitudes["task1"].fill_(0.5)
        else:
            _randomise(model, torch.Generator().manual_seed(3))
            with torch.no_grad():
                model.lora_magnitudes["task0"].fill_(1.25)
        method.end_task(scenario.tasks[t], ctx)
    assert list(model.lora_magnitudes) == ["task0"]
    assert all(list(layer.components) == ["task0"] for layer in lora_layers(model.backbone).values())
    expected = 1.25 + (0.5 if merge == "function_preserving" else 1.0)
    assert float(model.lora_magnitudes["task0"].detach()) == pytest.approx(expected)
    kd = [e for e in events if e["event"] == "sd_lora_kd"]
    assert kd[1]["absorbed"] and kd[1]["residual"] < 1e-6 and method.metrics()["kd"][1]["absorbed"]


def test_kd_method_keeps_new_direction() -> None:
    scenario, model, method = tiny_setup({"name": "sd_lora_kd", "rank": 2})
    for t in range(2):
        method.begin_task(scenario.tasks[t], context(scenario, t))
        _randomise(model, torch.Generator().manual_seed(10 + t))
        method.end_task(scenario.tasks[t], context(scenario, t))
    assert list(model.lora_magnitudes) == ["task0", "task1"]
    assert method.metrics()["kd"][1]["absorbed"] is False and method.metrics()["kd"][1]["residual"] > 0.1


@pytest.mark.parametrize("method", [{"name": "sd_lora", "rank": 2},
                                    {"name": "sd_lora_rr", "rank": 3, "rank_mu": 2, "rank_nu": 1, "mu": 2, "nu": 3},
                                    {"name": "sd_lora_kd", "rank": 2, "tau": 2.0}])
def test_end_to_end_and_resume(method: dict, tmp_path) -> None:
    full, resumed = run_and_resume(method, tmp_path)
    assert_same_run(full, resumed)
    assert len(full["method_metrics"]["magnitudes"]) == 2
