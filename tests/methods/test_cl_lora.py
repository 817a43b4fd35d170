"""``cl_lora``: CL-LoRA's rules transcribed from the official code (JiangpengHe/CL-LoRA at df4e74e:
``models/cllora.py``, ``backbone/vit_cllora.py``, ``utils/inc_net.py``), checked against the method's own."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from clmerge.adapters import lora_layers
from clmerge.config import load_config, parse_config
from clmerge.engine import training
from clmerge.engine.run import prepare, run_experiment
from clmerge.methods.cl_lora import (SHARED, block_weight_orthogonality, kd_loss, orthonormal_down,
                                     row_norm_weights)
from _lora_cl_helpers import assert_same_checkpoint, context, resume_killed_copy
from conftest import tiny_config

VIT4 = {"num_hidden_layers": 4, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}


def _cfg(n_tasks: int = 3, **method):
    return tiny_config(**{"method": {"name": "cl_lora", "rank": 2, **method}, "scenario.n_tasks": n_tasks,
                          "scenario.classes_per_task": [2] * n_tasks, "run.keep_checkpoints": n_tasks,
                          "model.config": VIT4})


# --- the official functions, transcribed -----------------------------------------------------------------
def _official_kd(pred, soft, T):  # models/cllora.py lines 17-20 (_KD_loss)
    pred = torch.log_softmax(pred / T, dim=1)
    soft = torch.softmax(soft / T, dim=1)
    return -1 * torch.mul(soft, pred).sum() / pred.shape[0]


def _official_orth(previous_weights_list, current_weights, epsilon=1e-8):  # lines 23-43
    total = 0.0
    current_normalized = current_weights.flatten() / (torch.norm(current_weights.flatten()) + epsilon)
    for prev in previous_weights_list:
        prev_normalized = prev.flatten() / (torch.norm(prev.flatten()) + epsilon)
        total += torch.abs(torch.sum(prev_normalized * current_normalized))
    if len(previous_weights_list) > 0:
        total /= len(previous_weights_list)
    return total


def _official_row_weights(old_lora_A_weight):  # lines 362-363 (_init_train: temp_weights)
    temp = 1. * torch.norm(old_lora_A_weight, dim=1)
    return 1. * len(temp) * temp / torch.sum(temp)


def test_kd_and_orthogonality_losses_are_the_official_functions():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(7, 5, generator=g), torch.randn(7, 5, generator=g)
    for T in (1.0, 2.0, 3.5):
        assert torch.allclose(kd_loss(s, t, T), _official_kd(s, t, T), atol=1e-6)
    cur = torch.rand(3, 4, generator=g) + 0.5
    olds = [torch.rand(3, 4, generator=g) + 0.5 for _ in range(3)]
    for k in range(4):
        ours, theirs = block_weight_orthogonality(olds[:k], cur), _official_orth(olds[:k], cur)
        assert torch.allclose(torch.as_tensor(ours, dtype=torch.float32), torch.as_tensor(theirs, dtype=torch.float32),
                              atol=1e-7)


def test_row_weights_and_the_orthonormal_down_projection_are_the_official_rules():
    g = torch.Generator().manual_seed(1)
    up = torch.randn(16, 4, generator=g)  # official lora_A (n_embd, r): our lora_up
    assert torch.allclose(row_norm_weights(up), _official_row_weights(up), atol=1e-6)
    assert row_norm_weights(torch.zeros(16, 4)) is None  # the official division gives NaN: skipped
    down = orthonormal_down(16, 4, torch.Generator().manual_seed(3))
    q, _ = torch.linalg.qr(torch.rand(16, 4, generator=torch.Generator().manual_seed(3)))  # Adapter_lora random_orth
    assert torch.equal(down, q.T.contiguous())
    assert torch.allclose(down @ down.T, torch.eye(4), atol=1e-5)


def _method_after(n_tasks: int, **opts):
    scenario, model, m, _ = prepare(parse_config(_cfg(n_tasks, **opts)))
    gen = torch.Generator().manual_seed(0)
    for t in range(n_tasks):
        ctx = context(scenario, t)
        m.begin_task(scenario.tasks[t], ctx)
        with torch.no_grad():  # trained up-projections
            for layer in lora_layers(model.backbone).values():
                for name, comp in layer.components.items():
                    if name in (SHARED, f"task{t}"):
                        comp.lora_up.add_(torch.randn(comp.lora_up.shape, generator=gen) * 0.1)
        if t < n_tasks - 1:
            m.end_task(scenario.tasks[t], ctx)
    return scenario, model, m


def test_shared_loras_on_the_first_half_task_specific_ones_on_the_rest():
    _, model, m = _method_after(3)
    layers = lora_layers(model.backbone)
    assert m.n_shared == 2 and len(layers) == 8  # q and v of 4 blocks
    for name, layer in layers.items():
        block = int(name.split("layers.")[1].split(".")[0])
        if block < 2:
            assert set(layer.components) == {SHARED}
            comp = layer.components[SHARED]
            assert not comp.lora_down.requires_grad and comp.lora_up.requires_grad  # official lora_B frozen
            assert torch.allclose(comp.lora_down @ comp.lora_down.T, torch.eye(2), atol=1e-5)
        else:
            assert set(layer.components) == {"task0", "task1", "task2"}
            assert all(p.requires_grad for p in layer.components["task2"].parameters())
            assert not any(p.requires_grad for k in ("task0", "task1") for p in layer.components[k].parameters())
    assert m.current_bw.shape == (3, 2) and m.current_bw.requires_grad
    bw = m.current_bw.detach()
    assert float(bw.min()) >= 0.5 and float(bw.max()) <= 1.5  # uniform_(0.5, 1.5)
    assert len(m.block_weights) == 2 and set(m.teacher) == set(m.shared_names) and len(m.shared_names) == 4


def test_the_teacher_is_the_shared_lora_at_the_end_of_the_previous_task():
    scenario, model, m = _method_after(2)
    # _method_after moved the shared up-projection after begin_task of task 1: the teacher holds the value before
    for n in m.shared_names:
        cur = m.layers[n].components[SHARED]
        assert not torch.equal(m.teacher[n].lora_up, cur.lora_up)
        assert torch.equal(m.teacher[n].lora_down, cur.lora_down)


def _official_batch(m, model, x, y, task):
    """What the official _init_train computes for a batch of task t > 0 (lines 340-372): the cross-entropy of the
    proxy head on the full forward with the current block weight, plus 1e-4 times the block weights'
    orthogonality; and the distillation loss on the shared blocks' CLS tokens with the current and the previous
    shared LoRA, through the same proxy head."""
    with m.subspace(task.index, m.current_bw):
        logits = m.proxy(model.forward_features(x))
    ce = F.cross_entropy(logits, y - task.offset) + 0.0001 * _official_orth(m.block_weights, m.current_bw)
    cur = {n: m.layers[n].components[SHARED] for n in m.shared_names}
    kd = 5. * _official_kd(m.proxy(m._shared_cls(x, cur)), m.proxy(m._shared_cls(x, m.teacher)), T=2)
    return ce, kd


def test_the_losses_of_a_batch_are_the_official_ones():
    scenario, model, m = _method_after(2)
    task = scenario.tasks[1]
    ctx = context(scenario, 1)
    x, y = next(iter(task.train.batches(8)))
    ce, kd = _official_batch(m, model, x, y, task)
    assert torch.allclose(m.loss(model, x, y, ctx), ce, atol=1e-6)
    assert torch.allclose(m.first_step_loss(model, x, y, ctx), kd, atol=1e-6)
    assert m.first_step_loss(model, x, y, context(scenario, 0)) is not None  # the teacher decides, not ctx
    _, _, m0 = _method_after(1)
    assert m0.first_step_loss(model, x, y, context(scenario, 0)) is None  # task 0: no distillation step


def test_two_optimizer_steps_per_batch_the_first_on_the_reweighted_distillation_gradient(monkeypatch):
    scenario, model, m = _method_after(2)
    task, ctx = scenario.tasks[1], context(scenario, 1)
    x, y = next(iter(task.train.batches(8)))
    shared = {n: m.layers[n].components[SHARED].lora_up for n in m.shared_names}
    before = {n: p.detach().clone() for n, p in shared.items()}
    ce, kd = _official_batch(m, model, x, y, task)
    g_kd = dict(zip(shared, torch.autograd.grad(kd, list(shared.values()), retain_graph=True)))
    g_ce = dict(zip(shared, torch.autograd.grad(ce, list(shared.values()))))
    lr = 0.1
    seen = []

    class Recorder(torch.optim.SGD):
        def step(self, closure=None):
            seen.append({n: p.grad.detach().clone() for n, p in shared.items()})
            return super().step(closure)

    monkeypatch.setattr(training, "build_optimizer", lambda groups, optim, lr=None: Recorder(groups, lr=0.1))

    class OneBatch:
        def num_batches(self, bs):
            return 1

        def batch_sizes(self, bs, steps):
            return [len(x)]

        def batches(self, bs, **kw):
            return iter([(x, y)])

    training.fit(model, OneBatch(), groups=m.parameter_groups(model), loss_fn=lambda mm, a, b: m.loss(mm, a, b, ctx),
                 optim=parse_config(_cfg(2)).optim, epochs=1, batch_size=8, generator=torch.Generator(),
                 device=torch.device("cpu"), first_loss_fn=lambda mm, a, b: m.first_step_loss(mm, a, b, ctx),
                 before_first_step=lambda mm: m.before_first_step(mm, ctx))
    assert len(seen) == 2  # the distillation step, then the cross-entropy's
    for n in shared:
        w = _official_row_weights(m.teacher[n].lora_up)
        assert torch.allclose(seen[0][n], w[:, None] * g_kd[n], atol=1e-6)  # the official grad rescale
        assert torch.allclose(seen[1][n], g_ce[n], atol=1e-6)  # taken before the first step
        assert torch.allclose(shared[n].detach(), before[n] - lr * (seen[0][n] + seen[1][n]), atol=1e-6)


def test_joint_step_sums_the_cross_entropy_and_the_reweighted_distillation_gradient():
    scenario, model, m = _method_after(2, kd_step="joint")
    task, ctx = scenario.tasks[1], context(scenario, 1)
    x, y = next(iter(task.train.batches(8)))
    shared = [m.layers[n].components[SHARED].lora_up for n in m.shared_names]
    ce, kd = _official_batch(m, model, x, y, task)
    g_kd = torch.autograd.grad(kd, shared, retain_graph=True)
    g_ce = torch.autograd.grad(ce, shared)
    loss = m.loss(model, x, y, ctx)
    assert torch.allclose(loss, ce + kd, atol=1e-6)  # the extra term has value 0
    g = torch.autograd.grad(loss, shared)
    for n, a, b, c in zip(m.shared_names, g, g_ce, g_kd):
        assert torch.allclose(a, b + _official_row_weights(m.teacher[n].lora_up)[:, None] * c, atol=1e-6)
    assert m.first_step_loss(model, x, y, ctx) is None


def test_inference_scores_each_class_on_its_own_tasks_subspace():
    scenario, model, m = _method_after(3)
    ctx = context(scenario, 2)
    m.end_task(scenario.tasks[2], ctx)
    clf = m.inference_model()
    x = next(iter(scenario.tasks[0].test.batches(5)))[0]
    logits = clf(x)
    assert logits.shape == (5, 6)
    for i, (lo, hi) in enumerate(m.ranges):  # official forward_diagonal: task i's feature block, its classes
        with m.subspace(i, m.block_weights[i]):
            f = model.backbone(x)
        expect = F.normalize(f, dim=1) @ F.normalize(m.protos[lo:hi, i], dim=1).T
        assert torch.allclose(logits[:, lo:hi], expect, atol=1e-5)
    assert float(m.protos[0:2, 1:].abs().sum()) == 0.0  # only the diagonal prototypes exist


def test_defaults_are_the_official_configs():
    o = load_config(None, ["method.name=cl_lora"]).method_options()
    assert (o.rank, o.targets, o.shared_blocks, o.kd_weight, o.kd_temperature, o.kd_step, o.grad_reweight,
            o.block_weight, o.orth_weight, o.down_init) == (8, ["query", "value"], None, 5.0, 2.0, "separate", True,
                                                           True, 1e-4, "orthogonal")
    with pytest.raises(Exception, match="shared_blocks"):
        run_experiment(parse_config(_cfg(2, shared_blocks=4)), "/nonexistent/never-written")


def test_a_text_backbone_is_refused_by_name():
    from clmerge.methods.cl_lora import _vit_parts
    with pytest.raises(Exception, match="HF ViT backbone"):
        _vit_parts(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("kd_step", ["separate", "joint"])
def test_a_resumed_cl_lora_run_gives_the_same_numbers(tmp_path, kd_step):
    data = _cfg(3, kd_step=kd_step)
    full = run_experiment(parse_config(data), tmp_path / "full")
    resumed = resume_killed_copy(parse_config(data), tmp_path / "full", "task_002.safetensors")
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    a, _ = assert_same_checkpoint(tmp_path / "full", tmp_path / "resumed", "task_002.safetensors")
    assert {"protos", "block_weight/0", "block_weight/1"} <= set(a[1])
    assert all(math.isfinite(v) for row in full["accuracy_matrix"] for v in row if v is not None)
