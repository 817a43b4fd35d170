"""MOS's adapter merge as the official code runs it (``method.merge_schedule: official``, the default).

The official rule, transcribed (sun-hailong/LAMDA-PILOT at 2647455; the MOS repository's files are identical):

- ``backbone/vit_mos.py`` lines 328-346, ``reweight_adapter(adapter, idx)``: for idx > 0 and every block,
  ``param.data = (1 - m) * param.data + m * prefix_sum[idx - 1] / idx``: in place, on values only, towards
  the mean of the adapters 0..idx-1 as ``adapter_update`` stored them (lines 310-326: a deepcopy into
  ``adapter_list`` and prefix sums of the trained values, taken when the task's training ends);
- ``backbone/vit_mos.py`` lines 360-365: a forward with ``train=True`` calls ``reweight_adapter`` on the
  current adapter before *every* block and runs block i with it, so block i sees i + 1 merges and a forward
  ends with L (the depth) merges applied;
- ``models/mos.py`` lines 162, 171 and 175: that forward, ``optimizer.step()``, then ``adapter_merge()`` (one
  more merge): L + 1 merges per step, 13 on ViT-B;
- ``models/mos.py`` lines 112-114 and 214: ``adapter_update()`` stores the adapter, then ``_compute_mean``
  extracts the class statistics with ``train=True``, which keeps merging the current adapter (the one the next
  task trains on) but not the stored copy;
- ``backbone/vit_mos.py`` lines 373-377 with ``models/mos.py`` line 373: evaluation (``train=False``) runs
  ``reweight_adapter`` on the *stored* ``adapter_list[t]`` before every block, so stored adapters move at test
  time, L merges per forward.

``merge_schedule: per_step`` is the rule clmerge had: ``merges_per_step`` merges after each step only.
"""

from __future__ import annotations

import pytest
import torch

from clmerge.adapters.bottleneck import adapter_sets
from clmerge.config import parse_config
from clmerge.engine.setup import prepare
from clmerge.methods import TaskContext
from clmerge.methods.mos import MOSOptions
from conftest import TINY_VIT, tiny_config

L, ALPHA = 3, 0.1


def _cfg(**method) -> dict:
    return tiny_config(**{"method": {"name": "mos", "align": False, "merge_momentum": ALPHA, **method},
                          "model.config": {**TINY_VIT, "num_hidden_layers": L},
                          "scenario.n_tasks": 3, "scenario.classes_per_task": [2, 2, 2]})


def _ctx(scenario, t: int) -> TaskContext:
    return TaskContext(task=scenario.tasks[t], seen_tasks=scenario.tasks[: t + 1], device=torch.device("cpu"),
                       generator=torch.Generator().manual_seed(t), batch_size=16, eval_batch_size=16)


def _params(model, t: int) -> dict[str, torch.Tensor]:
    s = adapter_sets(model.backbone)[f"task{t}"]
    return {k: v.detach().clone() for k, v in s.bank.sets[s.name].named_parameters()}


def _randomise(model, t: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_sets(model.backbone)[f"task{t}"].parameters():
            p.copy_(torch.randn(p.shape, generator=g))


def _merged(theta: torch.Tensor, target: torch.Tensor, n: int) -> torch.Tensor:
    """n applications of reweight_adapter: target + (1 - m)^n (theta - target)."""
    return target + (1 - ALPHA) ** n * (theta - target)


def _two_tasks_done(**method):
    """Task 0 and task 1 trained (adapters drawn at random) and ended; returns what the test needs."""
    scenario, model, mos, _ = prepare(parse_config(_cfg(**method)))
    trained = []
    for t in range(2):
        ctx = _ctx(scenario, t)
        mos.begin_task(scenario.tasks[t], ctx)
        _randomise(model, t, 10 + t)
        trained.append(_params(model, t))
        mos.end_task(scenario.tasks[t], ctx)
    return scenario, model, mos, trained


def test_a_training_forward_merges_before_every_block_and_the_step_adds_one_more():
    scenario, model, mos, trained = _two_tasks_done()
    ctx = _ctx(scenario, 2)
    mos.begin_task(scenario.tasks[2], ctx)
    _randomise(model, 2, 99)
    theta = _params(model, 2)
    target = {k: (trained[0][k] + trained[1][k]) / 2 for k in theta}  # mean of the stored adapters 0 and 1
    mos._ensure_hooks()
    seen: dict[int, torch.Tensor] = {}
    for i, module in enumerate(adapter_sets(model.backbone)["task2"].modules()):  # after the merge hook
        module.register_forward_pre_hook(lambda m, args, i=i: seen.update({i: m.down.weight.detach().clone()}))
    x, y = next(scenario.tasks[2].train.batches(8))
    params = list(adapter_sets(model.backbone)["task2"].parameters())
    opt = torch.optim.SGD(params, lr=0.5)
    opt.zero_grad()
    mos.loss(model, x, y, ctx).backward()
    for i in range(L):  # block i ran with i + 1 merges (vit_mos.py 360-365)
        assert torch.allclose(seen[i], _merged(theta[f"{i}.down.weight"], target[f"{i}.down.weight"], i + 1),
                              atol=1e-6)
    after_forward = _params(model, 2)
    for k in theta:  # the forward leaves every block's adapter merged L times
        assert torch.allclose(after_forward[k], _merged(theta[k], target[k], L), atol=1e-6)
    grads = {k: p.grad.clone() for k, p in zip(theta, params)}
    opt.step()
    mos.after_step(model, ctx)  # mos.py 171, 175: the step on the merged values, then adapter_merge()
    final = _params(model, 2)
    for k in theta:
        want = _merged(after_forward[k] - 0.5 * grads[k], target[k], 1)
        assert torch.allclose(final[k], want, atol=1e-5), k
    assert all(torch.equal(_params(model, t)[k], trained[t][k]) for t in range(2) for k in theta)


def test_the_class_statistics_pass_drifts_the_trained_adapter_the_next_task_starts_from_it_the_stored_copy_stays():
    scenario, model, mos, trained = _two_tasks_done()
    n_batches = -(-len(scenario.tasks[1].train) // 16)
    assert all(torch.equal(_params(model, 1)[k], v) for k, v in trained[1].items())  # adapter_list[1]
    for k, v in trained[1].items():  # cur_adapter after _compute_mean: L merges per batch towards adapter 0
        assert torch.allclose(mos._carry[k], _merged(v, trained[0][k], L * n_batches), atol=1e-6)
    mos.begin_task(scenario.tasks[2], _ctx(scenario, 2))
    assert all(torch.equal(_params(model, 2)[k], mos._carry[k]) for k in trained[1])


def test_evaluation_merges_the_stored_adapters_in_place():
    scenario, model, mos, trained = _two_tasks_done()
    model.eval()
    x, _ = next(scenario.tasks[0].test.batches(8))
    for calls in (1, 2):  # each prediction runs every task's adapter once: L merges of each stored adapter k >= 1
        mos.inference_model()(x)
        now = [_params(model, t) for t in range(2)]
        assert all(torch.equal(now[0][k], v) for k, v in trained[0].items())  # adapter 0: idx 0, never merged
        for k, v in trained[1].items():
            assert torch.allclose(now[1][k], _merged(v, trained[0][k], L * calls), atol=1e-6)


def test_per_step_is_the_rule_before_one_merge_per_step_stored_adapters_untouched():
    scenario, model, mos, trained = _two_tasks_done(merge_schedule="per_step")
    ctx = _ctx(scenario, 2)
    mos.begin_task(scenario.tasks[2], ctx)
    assert all(torch.equal(_params(model, 2)[k], v) for k, v in trained[1].items())  # from the stored adapter 1
    _randomise(model, 2, 99)
    theta = _params(model, 2)
    x, y = next(scenario.tasks[2].train.batches(8))
    mos.loss(model, x, y, ctx)
    assert all(torch.equal(_params(model, 2)[k], v) for k, v in theta.items())  # no merge in the forward
    mos.after_step(model, ctx)
    for k, v in theta.items():
        assert torch.allclose(_params(model, 2)[k], _merged(v, (trained[0][k] + trained[1][k]) / 2, 1), atol=1e-6)
    model.eval()
    mos.inference_model()(next(scenario.tasks[0].test.batches(8))[0])
    assert all(torch.equal(_params(model, t)[k], trained[t][k]) for t in range(2) for k in trained[t])


def test_merges_per_step_belongs_to_the_per_step_schedule():
    with pytest.raises(Exception, match="merges_per_step"):
        parse_config(_cfg(merges_per_step=13))
    assert MOSOptions(merges_per_step=13, merge_schedule="per_step").merges_per_step == 13
    assert MOSOptions().merge_schedule == "official"
