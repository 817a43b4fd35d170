"""``mos``: the merged adapter equals its formula, self-refined retrieval, the ensemble, the orthogonality term, the
cosine prototype branch, an end-to-end digits run and an exact resume."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from clmerge.adapters.bottleneck import adapter_sets, only_adapters
from clmerge.config import parse_config
from clmerge.engine.checkpoint import load_checkpoint
from clmerge.engine.run import run_experiment
from clmerge.engine.setup import prepare
from clmerge.methods import TaskContext
from clmerge.methods.mos import ensemble_scores, merged_adapter, orthogonality_loss, refine_retrieval
from _lora_cl_helpers import uncommit_checkpoint
from conftest import tiny_config


def _cfg(tasks: int = 2, **method) -> dict:
    return tiny_config(**{"method": {"name": "mos", "align_epochs": 2, "align_samples": 8, **method},
                          "scenario.n_tasks": tasks, "scenario.classes_per_task": [2] * tasks})


def _ctx(scenario, t: int) -> TaskContext:
    return TaskContext(task=scenario.tasks[t], seen_tasks=scenario.tasks[: t + 1], device=torch.device("cpu"),
                       generator=torch.Generator().manual_seed(t), batch_size=16, eval_batch_size=64)


def _params(model, t: int) -> dict[str, torch.Tensor]:
    s = adapter_sets(model.backbone)[f"task{t}"]
    return {k: v.detach().clone() for k, v in s.bank.sets[s.name].named_parameters()}


def _three_sets(**method):
    """The method on the tiny ViT with task 2 begun and every adapter parameter random (no zeros)."""
    scenario, model, method_obj, _ = prepare(parse_config(_cfg(3, **method)))
    for t in range(3):
        method_obj.begin_task(scenario.tasks[t], _ctx(scenario, t))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.backbone.bottleneck_adapters.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    method_obj._task = 2
    return model, method_obj


@pytest.mark.parametrize("alpha, times", [(0.1, 1), (0.3, 1), (0.1, 3)])
def test_the_merged_adapter_equals_its_formula(alpha, times):
    """After a step of task 2: theta_2 <- (1-a) theta_2 + a (theta_0 + theta_1) / 2, per parameter and block;
    applied ``merges_per_step`` times; the earlier adapters do not move."""
    model, method = _three_sets(merge_momentum=alpha, merges_per_step=times, merge_schedule="per_step")
    before = [_params(model, t) for t in range(3)]
    method.after_step(model, None)
    after = [_params(model, t) for t in range(3)]
    assert set(after[2]) == {f"0.{m}.{w}" for m in ("down", "up") for w in ("weight", "bias")}
    for name, theta in before[2].items():
        mean = (before[0][name] + before[1][name]) / 2
        expected = theta
        for _ in range(times):
            expected = (1 - alpha) * expected + alpha * mean
        assert torch.allclose(after[2][name], expected, atol=1e-6)
        assert torch.equal(after[0][name], before[0][name]) and torch.equal(after[1][name], before[1][name])
    assert torch.equal(merged_adapter(before[0]["0.up.bias"], [], 0.5), before[0]["0.up.bias"])


def test_no_merge_in_the_first_task_or_with_zero_momentum():
    model, method = _three_sets(merge_momentum=0.0)
    before = _params(model, 2)
    method.after_step(model, None)
    assert all(torch.equal(before[k], v) for k, v in _params(model, 2).items())


def test_a_run_merges_after_every_step():
    """With alpha = 1 each step ends with theta_1 = theta_0: the second task's adapter equals the first's."""
    cfg = parse_config(_cfg(merge_momentum=1.0, adapter_init="fresh", align=False, merge_schedule="per_step"))
    scenario, model, method, _ = prepare(cfg)
    for t in range(2):
        ctx = _ctx(scenario, t)
        method.begin_task(scenario.tasks[t], ctx)
        opt = torch.optim.SGD([p for g in method.parameter_groups(model) for p in g["params"]], lr=0.1)
        x, y = next(scenario.tasks[t].train.batches(16))
        for _ in range(2):
            opt.zero_grad()
            method.loss(model, x, y, ctx).backward()
            opt.step()
            method.after_step(model, ctx)
        method.end_task(scenario.tasks[t], ctx)
    first, second = _params(model, 0), _params(model, 1)
    assert any(v.abs().sum() > 0 for k, v in first.items() if ".up." in k)  # the first adapter trained
    assert all(torch.allclose(first[k], second[k]) for k in first)


def test_refined_retrieval_follows_the_predicted_task_until_it_settles():
    task_of = torch.tensor([0, 0, 1, 1, 2, 2])
    # logits under task t's adapter: image 0 points 0 -> 1 -> 1 (settles); image 1 cycles 0 -> 2 -> 0 -> 2 ...
    table = {0: [[0, 0, 5, 0, 0, 0], [0, 0, 0, 0, 5, 0]],
             1: [[0, 0, 0, 5, 0, 0], [0, 0, 0, 0, 0, 0]],
             2: [[0, 0, 0, 0, 0, 0], [5, 0, 0, 0, 0, 0]]}
    calls = []

    def logits(tasks):
        calls.append(tasks.tolist())
        return torch.tensor([table[int(t)][i] for i, t in enumerate(tasks)], dtype=torch.float)

    out = refine_retrieval(torch.tensor([0, 0]), logits, task_of, iters=4)
    assert calls == [[0, 0], [1, 2], [1, 0], [1, 2]]  # at most 4 adapters per image
    assert out.argmax(-1).tolist() == [3, 0]
    calls.clear()
    refine_retrieval(torch.tensor([0, 0]), logits, task_of, iters=1)
    assert calls == [[0, 0]]


def test_the_ensemble_adds_the_softmaxes_with_the_prototypes_at_temperature_one_over_tasks():
    adapted, proto = torch.tensor([[2.0, 0.0, 1.0]]), torch.tensor([[0.1, 0.5, 0.2]])
    expected = torch.exp(adapted) / torch.exp(adapted).sum() + torch.exp(3 * proto) / torch.exp(3 * proto).sum()
    assert torch.allclose(ensemble_scores(adapted, proto, 3), expected)


def test_the_orthogonality_term_is_the_official_cross_entropy():
    g = torch.Generator().manual_seed(0)
    feats, means = torch.randn(4, 5, generator=g), torch.randn(3, 5, generator=g)
    m = torch.cat([means, feats])
    sim = m @ m.T / 0.8
    expected = -torch.log(torch.exp(sim.diag()) / torch.exp(sim).sum(1)).mean()
    assert torch.allclose(orthogonality_loss(feats, means, 0.8), expected, atol=1e-5)
    assert torch.allclose(orthogonality_loss(feats, torch.empty(0), 0.8),
                          F.cross_entropy(feats @ feats.T / 0.8, torch.arange(4)))


@pytest.mark.parametrize("orig_branch", ["first_adapter", "pretrained"])
def test_predict_is_the_refined_ensemble_of_the_cosine_prototypes_and_the_adapters(orig_branch):
    """A 2-task digits run; then, by hand: cosine prototypes (class means of the orig branch's features on the
    training data), its task, the head under that task's adapter, refined, and the ensemble."""
    # per_step: the stored adapters stay as trained at evaluation (the official schedule: test_mos_official.py)
    scenario, model, method, _ = prepare(parse_config(_cfg(orig_branch=orig_branch, merge_schedule="per_step")))
    g = torch.Generator().manual_seed(3)
    for t in range(2):
        ctx = _ctx(scenario, t)
        method.begin_task(scenario.tasks[t], ctx)
        with torch.no_grad():  # a trained adapter: not zero, so each branch has its own features
            for p in adapter_sets(model.backbone)[f"task{t}"].parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        method.end_task(scenario.tasks[t], ctx)
    model.eval()
    bb, sets = model.backbone, ["task0"] if orig_branch == "first_adapter" else []
    protos = []
    with torch.no_grad():
        for task in scenario.tasks:
            x, y = next(task.train.batches(10_000))
            with only_adapters(bb, sets):
                f = bb(x)
            protos += [f[y == c].mean(0) for c in range(*task.class_range)]
        x, _ = next(scenario.tasks[1].test.batches(10_000))
        with only_adapters(bb, sets):
            proto = F.normalize(bb(x), dim=-1) @ F.normalize(torch.stack(protos), dim=-1).T
        under = []
        for k in range(2):
            with only_adapters(bb, [f"task{k}"]):
                under.append(model.head(bb(x)))
        task_of = torch.tensor([0, 0, 1, 1])
        tasks = task_of[proto.argmax(-1)]
        for _ in range(3):
            logits = torch.stack([under[int(t)][i] for i, t in enumerate(tasks)])
            tasks = task_of[logits.argmax(-1)]
        expected = logits.softmax(-1) + (2 * proto).softmax(-1)
        got = method.inference_model()(x).exp()
    assert torch.allclose(got, expected, atol=1e-5)


def test_a_two_task_digits_run_trains_aligns_and_resumes_bit_for_bit(tmp_path):
    data = _cfg()
    data["run"]["keep_checkpoints"] = 2
    full = run_experiment(parse_config(data), tmp_path / "full")
    assert len(full["accuracy_matrix"]) == 2 and full["accuracy_matrix"][1][1] is not None
    _, tensors, _ = load_checkpoint(tmp_path / "full" / "checkpoints" / "task_001.safetensors")
    assert tensors["mos/means"].shape == (4, 32) and tensors["mos/covs"].shape == (4, 32, 32)
    assert tensors["mos/task_of"].tolist() == [0, 0, 1, 1]
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    (tmp_path / "resumed" / "metrics.json").unlink()
    uncommit_checkpoint(tmp_path / "resumed", "task_001.safetensors")  # killed after task 1
    resumed = run_experiment(parse_config(data), tmp_path / "resumed", resume=True)
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    a = load_checkpoint(tmp_path / "full" / "checkpoints" / "task_001.safetensors")
    b = load_checkpoint(tmp_path / "resumed" / "checkpoints" / "task_001.safetensors")
    for x, z in zip(a[:2], b[:2]):  # model (adapters of both tasks, head) and method tensors
        assert x.keys() == z.keys() and all(torch.equal(x[k], z[k]) for k in x)
    assert any("bottleneck_adapters.sets.task1" in k for k in a[0])


@pytest.mark.parametrize("align", [True, False])
def test_the_head_is_aligned_from_the_second_task_on(align):
    scenario, model, method, _ = prepare(parse_config(_cfg(align=align)))
    changed = []
    for t in range(2):
        ctx = _ctx(scenario, t)
        method.begin_task(scenario.tasks[t], ctx)
        before = [p.detach().clone() for p in model.head.parameters()]
        method.end_task(scenario.tasks[t], ctx)
        changed.append(any(not torch.equal(b, p) for b, p in zip(before, model.head.parameters())))
    assert changed == [False, align]
    assert not any(p.requires_grad for p in model.parameters())  # everything frozen between tasks


def test_pseudo_features_follow_the_class_gaussians():
    _, _, method, _ = prepare(parse_config(_cfg()))
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 3, generator=g)
    method._means = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, 0.0]])
    method._covs = torch.stack([a @ a.T + 0.1 * torch.eye(3), torch.diag(torch.tensor([0.5, 1.0, 2.0]))])
    chol_t = torch.linalg.cholesky(method._covs.double()).transpose(1, 2).float()
    x, y = method._pseudo_features(chol_t, 20_000, g)
    assert y.tolist() == [0] * 20_000 + [1] * 20_000
    for c in range(2):
        f = x[y == c]
        assert torch.allclose(f.mean(0), method._means[c], atol=0.05)
        assert torch.allclose(torch.cov(f.T), method._covs[c], atol=0.1)


@pytest.mark.parametrize("init", ["previous", "fresh"])
def test_a_new_tasks_adapter_starts_from_the_previous_one_or_fresh(init):
    scenario, model, method, _ = prepare(parse_config(_cfg(adapter_init=init)))
    method.begin_task(scenario.tasks[0], _ctx(scenario, 0))
    with torch.no_grad():
        for p in adapter_sets(model.backbone)["task0"].parameters():
            p.add_(1.0)
    method.begin_task(scenario.tasks[1], _ctx(scenario, 1))
    first, second = _params(model, 0), _params(model, 1)
    same = all(torch.equal(first[k], second[k]) for k in first)
    assert same == (init == "previous")
    if init == "fresh":
        assert all(v.abs().sum() == 0 for k, v in second.items() if ".up." in k)
    assert adapter_sets(model.backbone)["task1"].enabled and not adapter_sets(model.backbone)["task0"].enabled


def test_export_refuses_a_mos_run_in_one_line(tmp_path):
    """No single folded model reproduces MOS's retrieval and ensemble: `clmerge export` says so (exit 3)."""
    from typer.testing import CliRunner

    from clmerge.cli import app

    run_experiment(parse_config(_cfg()), tmp_path / "run")
    r = CliRunner().invoke(app, ["export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 3 and len(lines) == 1 and "Traceback" not in r.output, r.output
    assert "'mos' predicts with MOSEnsemble" in lines[0] and not (tmp_path / "hf").exists()
