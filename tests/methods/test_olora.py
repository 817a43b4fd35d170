"""``olora``: a new LoRA per task, the orthogonality loss Σ|A_old A_t^T| and the L2 term on the new LoRA,
transcribed from the official code (cmnfriend/O-LoRA at 07117e1fc4a5f5ad9308a815a42cee8f46502dc8)."""

from __future__ import annotations


import pytest
import torch

from clmerge.adapters import lora_layers
from clmerge.config import load_config, parse_config
from clmerge.engine.run import prepare, run_experiment
from clmerge.methods import method_options_model
from _lora_cl_helpers import assert_same_checkpoint, context, resume_killed_copy
from conftest import tiny_config


def _cfg(n_tasks: int = 3, **method):
    return tiny_config(**{"method": {"name": "olora", "rank": 2, **method}, "scenario.n_tasks": n_tasks,
                          "scenario.classes_per_task": [2] * n_tasks, "run.keep_checkpoints": n_tasks})


def _official_regularizer(named_params: list[tuple[str, torch.Tensor]], lamda_1: float, lamda_2: float):
    """src/uie_trainer_lora.py lines 91-109 (``training_step``), with peft's names: ``lora_A`` is the old tasks'
    A stacked (r_sum, d), ``loranew_A`` / ``loranew_B`` the current task's LoRA."""
    orthogonal_loss = 0.
    for name, param in named_params:
        if "lora_A" in name:
            for name_, param_ in named_params:
                if "loranew_A" in name_ and name.split("lora_A")[0] == name_.split("loranew_A")[0]:
                    orthogonal_loss += torch.abs(torch.mm(param, param_.T)).sum()  # line 96
                    break
    l2_loss = 0.
    for name, param in named_params:
        if "loranew_" in name:
            l2_loss += torch.norm(param, p=2)  # line 103
    return orthogonal_loss * lamda_1 + l2_loss * lamda_2  # line 109


def _method_after(n_tasks: int, **opts):
    """An O-LoRA method on the tiny model, ``n_tasks`` tasks begun (the last one current), LoRAs random."""
    scenario, model, m, _ = prepare(parse_config(_cfg(n_tasks, **opts)))
    gen = torch.Generator().manual_seed(0)
    for t in range(n_tasks):
        ctx = context(scenario, t)
        m.begin_task(scenario.tasks[t], ctx)
        with torch.no_grad():  # a trained B (the official B starts at zero as here)
            for layer in lora_layers(model.backbone).values():
                layer.components[f"task{t}"].lora_up.normal_(0, 0.1, generator=gen)
        if t < n_tasks - 1:
            m.end_task(scenario.tasks[t], ctx)
    return m, model


def _official_names(m, model, t: int):
    """The official parameter list of the current task ``t``: per layer, lora_A (old rows) and loranew_A/B."""
    out = []
    for name, layer in lora_layers(model.backbone).items():
        olds = [layer.components[f"task{k}"].lora_down for k in range(t)]
        if olds:
            out.append((f"{name}.lora_A.default.weight", torch.cat(olds)))
        new = layer.components[f"task{t}"]
        out += [(f"{name}.loranew_A.default.weight", new.lora_down), (f"{name}.loranew_B.default.weight", new.lora_up)]
    return out


@pytest.mark.parametrize("lambdas", [(0.5, 0.0), (0.5, 0.1), (0.0, 0.3), (2.0, 1.0)])
def test_the_regularizer_is_the_official_training_steps(lambdas):
    m, model = _method_after(3, lambda_orth=lambdas[0], lambda_l2=lambdas[1])
    ours = m.regularizer()
    official = _official_regularizer(_official_names(m, model, 2), *lambdas)
    assert torch.allclose(torch.as_tensor(ours, dtype=torch.float32), torch.as_tensor(official), rtol=1e-5, atol=1e-6)
    if lambdas[0] and not lambdas[1]:  # and its gradient w.r.t. the new A
        new = [c for layer in lora_layers(model.backbone).values() for n, c in layer.components.items() if n == "task2"]
        g1 = torch.autograd.grad(ours, [c.lora_down for c in new])
        g2 = torch.autograd.grad(_official_regularizer(_official_names(m, model, 2), *lambdas),
                                 [c.lora_down for c in new])
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g1, g2))


def test_the_first_task_has_no_orthogonality_term_and_old_loras_are_frozen():
    m, model = _method_after(1)
    assert float(m.regularizer()) == 0.0  # lambda_l2 = 0 by default, no old rows yet (official lora_A zeros)
    m, model = _method_after(3)
    for name, layer in lora_layers(model.backbone).items():
        assert set(layer.components) == {"task0", "task1", "task2"}  # kept, not folded (fold=false)
        assert not any(p.requires_grad for k in ("task0", "task1") for p in layer.components[k].parameters())
        assert all(p.requires_grad for p in layer.components["task2"].parameters())
        rows = torch.cat([layer.components[k].lora_down for k in ("task0", "task1")])
        assert torch.equal(m.old_downs[name], rows)  # the official lora_A: old rows stacked in task order


def test_the_orthogonality_loss_drives_the_new_rows_out_of_the_old_span():
    m, model = _method_after(2, lambda_orth=1.0)
    new = [c.lora_down for layer in lora_layers(model.backbone).values()
           for n, c in layer.components.items() if n == "task1"]
    opt = torch.optim.SGD(new, lr=1e-2)
    first = float(m.regularizer().detach())
    for _ in range(100):
        opt.zero_grad()
        m.regularizer().backward()
        opt.step()
    assert float(m.regularizer().detach()) < 0.2 * first


def test_fold_keeps_the_function_and_the_old_rows():
    m, model = _method_after(2, fold=True)
    assert all(set(layer.components) == {"task1"} for layer in lora_layers(model.backbone).values())
    assert all(v.shape[0] == 2 for v in m.old_downs.values())  # rank 2 of task 0 kept for the loss


def test_defaults_are_the_official_scripts():
    o = load_config(None, ["method.name=olora"]).method_options()
    assert (o.rank, o.lora_alpha, o.scale(), o.lambda_orth, o.lambda_l2, o.fold, o.targets) == \
        (8, 32.0, 4.0, 0.5, 0.0, False, ["query", "value"])
    assert load_config(None, ["method.name=olora"]).optim.lr == 1e-3
    with pytest.raises(Exception, match="lambda_orth"):
        load_config(None, ["method.name=olora", "method.lambda_orth=-1"])
    assert method_options_model("olora")().rank == 8


@pytest.mark.parametrize("fold", [False, True])
def test_a_resumed_olora_run_gives_the_same_numbers(tmp_path, fold):
    data = _cfg(3, fold=fold, lambda_l2=0.1)
    full = run_experiment(parse_config(data), tmp_path / "full")
    resumed = resume_killed_copy(parse_config(data), tmp_path / "full", "task_002.safetensors")  # killed after the second task
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    a, b = assert_same_checkpoint(tmp_path / "full", tmp_path / "resumed", "task_002.safetensors")  # the model (LoRA components) and the old rows
    assert any(k.startswith("old_down/") for k in a[1]) and all(v.shape[0] == 6 for k, v in a[1].items()
                                                             if k.startswith("old_down/"))
