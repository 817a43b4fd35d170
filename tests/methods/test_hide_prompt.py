"""HiDe-Prompt (methods.prompts.hide_prompt, methods.prompts.hide_parts): TII, the statistics it replays, WTP's regulariser, runs."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from clmerge.adapters.prompt import PromptInput
from clmerge.config import parse_config
from clmerge.engine.run import prepare, run_experiment
from clmerge.methods.base import TaskContext
from clmerge.methods.prompts.hide_parts import contrastive_regulariser

from conftest import tiny_config

VIT3 = {"num_hidden_layers": 3, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}
FAST = {"name": "hide_prompt", "pool_size": 3, "length": 2, "layers": [0, 1], "tii_epochs": 3,
        "tii_align_epochs": 2, "tii_align_samples": 8, "tap_epochs": 2, "tap_samples": 8, "contrast_weight": 0.1}


def _setup(method: dict, n_tasks: int = 2):
    cfg = parse_config(tiny_config(**{"scenario.n_tasks": n_tasks, "scenario.classes_per_task": [2] * n_tasks,
                                      "method": method, "model.config": VIT3}))
    scenario, model, meth, _ = prepare(cfg)
    return scenario, model, meth


def _ctx(task, tasks):
    return TaskContext(task=task, seen_tasks=tasks[: task.index + 1], device=torch.device("cpu"),
                       generator=torch.Generator().manual_seed(task.index), n_tasks=len(tasks), eval_batch_size=64)


def _run_task(model, meth, task, tasks, *, steps=4, lr=0.05):
    """begin_task, a few optimizer steps on the method's loss, end_task (the engine's order)."""
    ctx = _ctx(task, tasks)
    meth.begin_task(task, ctx)
    params = [p for g in meth.parameter_groups(model) for p in g["params"]]
    opt = torch.optim.Adam(params, lr=lr)
    model.train()
    for i, (x, y) in enumerate(task.train.batches(16, shuffle=True, generator=torch.Generator().manual_seed(1))):
        if i == steps:
            break
        opt.zero_grad()
        meth.loss(model, x, y, ctx).backward()
        opt.step()
    model.eval()
    meth.end_task(task, ctx)
    return ctx


def _separable(task):
    """Tasks whose inputs differ clearly: the task's own fixed random image plus 0.1 x the digit."""
    pattern = torch.rand(1, 8, 8, generator=torch.Generator().manual_seed(task.index))
    moved = lambda d: dataclasses.replace(d, transform=lambda x: 0.1 * x + pattern)  # noqa: E731
    return dataclasses.replace(task, train=moved(task.train), test=moved(task.test))


def test_task_identity_inference_beats_chance_on_a_separable_toy():
    # a linear TII head and a large alignment lr: the tiny random ViT's features differ by little in norm
    scenario, model, meth = _setup(FAST | {"tii_epochs": 30, "tii_lr": 0.01, "tii_hidden": 0, "tii_align_epochs": 20,
                                           "tii_align_lr": 1.0, "tii_align_samples": 32}, n_tasks=3)
    tasks = [_separable(t) for t in scenario.tasks]
    for task in tasks:
        _run_task(model, meth, task, tasks, steps=2)
    accs = []
    for task in tasks:
        q = torch.cat([meth.mechanism.query(x) for x, _ in task.test.batches(64)])
        accs.append(100.0 * float((meth.infer_task(q) == task.index).float().mean()))
    assert min(accs) > 80.0 and sum(accs) / 3 > 90.0  # chance: 33.3
    rec = meth.metrics()["prompt_selection"][-1]
    assert rec["task_id_acc"] == pytest.approx(accs, abs=1e-3)  # the record is the same computation
    assert [sum(c) for c in rec["test_counts"]] == [len(t.test) for t in tasks]  # a histogram per task
    assert len(meth.metrics()["hide"][-1]["tii_align_losses"]) == 20  # realigned on replayed statistics


def test_infer_task_is_the_task_of_the_top_class():
    scenario, model, meth = _setup(FAST, n_tasks=2)
    meth.ranges = [(0, 2), (2, 5)]
    meth.tii.classes.ensure_classes(5)
    q = torch.randn(40, 32)
    top = meth.tii(q).argmax(1)
    want = torch.tensor([0 if c < 2 else 1 for c in top.tolist()])
    assert torch.equal(meth.infer_task(q), want)


def test_statistics_are_the_direct_computation():
    """TII's statistics: frozen [CLS] features without prompts; TAP's: each class under its own task's prompt."""
    scenario, model, meth = _setup(FAST | {"stats": "full"})
    task = scenario.tasks[0]
    _run_task(model, meth, task, scenario.tasks)
    x, y = task.train.get_batch(range(len(task.train)))
    with torch.no_grad():
        plain = meth.mechanism.query(x).double()
        e = model.prompts.e_prompts
        prefixes = {layer: (e[i, 0, 0].expand(len(x), -1, -1), e[i, 1, 0].expand(len(x), -1, -1))
                    for i, layer in enumerate([0, 1])}
        with meth.mechanism.using(PromptInput(prefixes=prefixes)):
            prompted = model.forward_features(x).double()
    assert not torch.allclose(plain, prompted)
    eye = 1e-4 * torch.eye(32, dtype=torch.float64)
    for c in (0, 1):
        for stats, f in ((meth.tii_stats, plain), (meth.tap_stats, prompted)):
            torch.testing.assert_close(stats.mean(c), f[y == c].mean(0), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(stats.tensors[f"cov.{c}"], torch.cov(f[y == c].T) + eye, rtol=1e-4, atol=1e-5)
    # task 1's contrastive prototypes are those means
    meth.begin_task(scenario.tasks[1], _ctx(scenario.tasks[1], scenario.tasks))
    want = torch.stack([prompted[y == c].mean(0) for c in (0, 1)])
    torch.testing.assert_close(meth._prototypes.double(), want, rtol=1e-5, atol=1e-5)


def test_contrastive_regulariser_transcription():
    torch.manual_seed(0)
    feats, protos, tau = torch.randn(5, 8), torch.randn(3, 8), 0.8
    m = torch.cat([protos, feats])
    want = -sum(float(m[i] @ m[i] / tau - torch.logsumexp(m @ m[i] / tau, 0)) for i in range(8)) / 8
    assert float(contrastive_regulariser(feats, protos, tau)) == pytest.approx(want, rel=1e-5)
    batch_rows = -sum(float(m[i] @ m[i] / tau - torch.logsumexp(m @ m[i] / tau, 0)) for i in range(3, 8)) / 5
    assert float(contrastive_regulariser(feats, protos, tau, "batch")) == pytest.approx(batch_rows, rel=1e-5)
    assert float(contrastive_regulariser(feats, torch.zeros(0, 8), tau)) == pytest.approx(
        float(F.cross_entropy(feats @ feats.t() / tau, torch.arange(5))), rel=1e-6)


def test_prompt_momentum_and_init_from_previous():
    scenario, model, meth = _setup(FAST | {"prompt_momentum": 0.25}, n_tasks=3)
    pool = model.prompts
    gen = torch.Generator().manual_seed(0)
    pool.start_task(0, 3, gen)
    with torch.no_grad():
        pool.e_prompts[:, :, 0] += 1.0  # stand-in for training task 0
    pool.start_task(1, 3, gen)
    torch.testing.assert_close(pool.e_prompts[:, :, 1], pool.e_prompts[:, :, 0])  # code: shared_prompt_pool
    with torch.no_grad():
        pool.e_prompts[:, :, 1] -= 2.0
    e = pool.e_prompts.detach().clone()
    pool.fold_momentum()
    torch.testing.assert_close(pool.e_prompts[:, :, 1], 0.75 * e[:, :, 1] + 0.25 * e[:, :, 0])
    assert torch.equal(pool.e_prompts[:, :, 0], e[:, :, 0])


def test_training_touches_only_the_task_prompt_and_the_head():
    scenario, model, meth = _setup(FAST)
    e0 = model.prompts.e_prompts.detach().clone()
    _run_task(model, meth, scenario.tasks[0], scenario.tasks)
    e = model.prompts.e_prompts.detach()
    assert not torch.equal(e[:, :, 0], e0[:, :, 0]) and torch.equal(e[:, :, 1:], e0[:, :, 1:])
    assert model.backbone.inner.embeddings.cls_token.grad is None
    assert meth.metrics()["prompt_selection"][0]["train_counts"] == [64.0, 0.0, 0.0]  # 4 steps x 16, prompt 0


def test_end_to_end_run_records_tii(tmp_path):
    cfg = parse_config(tiny_config(**{"method": FAST, "model.config": VIT3}))
    metrics = run_experiment(cfg, tmp_path / "r")
    rec = metrics["method_metrics"]["prompt_selection"]
    assert [r["task"] for r in rec] == [0, 1] and len(rec[1]["task_id_acc"]) == 2
    assert rec[0]["task_id_acc"] == [100.0]  # one task seen: TII has one task to choose
    hide = metrics["method_metrics"]["hide"]
    assert hide[0]["tap_losses"] == [] and len(hide[1]["tap_losses"]) == 2  # TAP from the second task on
    assert len(hide[1]["tii_losses"]) == 3
    assert len(metrics["accuracy_matrix"]) == 2


def test_too_few_prompts_is_a_clear_error():
    scenario, model, meth = _setup(FAST | {"pool_size": 2}, n_tasks=3)
    with pytest.raises(ValueError, match="method.pool_size: 2 prompts for 3 tasks"):
        meth.begin_task(scenario.tasks[0], _ctx(scenario.tasks[0], scenario.tasks))


@pytest.mark.parametrize("stats", ["full", "multi_centroid"])
def test_resume_after_crash_gives_identical_metrics(tmp_path, monkeypatch, stats):
    from clmerge.methods.prompts.hide_prompt import HiDePrompt

    method = FAST | {"prompt_momentum": 0.1, "stats": stats, "n_centroids": 3}
    cfg = parse_config(tiny_config(**{"scenario.n_tasks": 3, "scenario.classes_per_task": [2, 2, 2],
                                      "method": method, "model.config": VIT3}))
    full = run_experiment(cfg, tmp_path / "full")
    original = HiDePrompt.end_task

    def crash_on_task_2(self, task, ctx):
        if task.index == 2:
            raise RuntimeError("simulated crash")
        return original(self, task, ctx)

    monkeypatch.setattr(HiDePrompt, "end_task", crash_on_task_2)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_experiment(cfg, tmp_path / "crashed")
    monkeypatch.setattr(HiDePrompt, "end_task", original)
    resumed = run_experiment(cfg, tmp_path / "crashed", resume=True)
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    assert resumed["method_metrics"] == full["method_metrics"]
    events = lambda d: [json.loads(x)["event"] for x in (d / "events.jsonl").read_text().splitlines()]  # noqa: E731
    assert events(tmp_path / "full") == events(tmp_path / "crashed")


def test_multi_centroid_statistics_and_draws():
    """The code's multi-centroid store: k-means clusters' means and np.var; n draws per non-singleton cluster."""
    from sklearn.cluster import KMeans

    from clmerge.methods.prompts.hide_parts import MultiCentroidStats

    torch.manual_seed(0)
    feats = torch.cat([torch.randn(30, 4), torch.randn(30, 4) + 8.0, torch.randn(1, 4) - 20.0])
    labels = torch.zeros(61, dtype=torch.long)
    st = MultiCentroidStats(4, n_centroids=3, seed=5)
    st.update(feats, labels)
    km = KMeans(n_clusters=3, n_init=10, random_state=5 * 7919).fit(feats.double().numpy())
    want = sorted(feats.double()[torch.as_tensor(km.labels_) == j].mean(0)[0].item() for j in range(3))
    assert sorted(st.centroids(0)[:, 0].tolist()) == pytest.approx(want)
    singleton = st.tensors["vars.0"].mean(1) == 0
    assert int(singleton.sum()) == 1  # the far-away point is its own cluster
    draw = st.sample(0, 7, torch.Generator().manual_seed(0))
    assert draw.shape == (14, 4)  # 7 per cluster, the one-sample cluster skipped (code)
    far = st.centroids(0)[singleton][0]
    assert float((draw - far).norm(dim=1).min()) > 5.0


def test_multi_centroid_run_uses_centroids_as_prototypes(tmp_path):
    cfg = parse_config(tiny_config(**{"method": FAST | {"stats": "multi_centroid", "n_centroids": 3},
                                      "model.config": VIT3}))
    scenario, model, meth, _ = prepare(cfg)
    _run_task(model, meth, scenario.tasks[0], scenario.tasks)
    meth.begin_task(scenario.tasks[1], _ctx(scenario.tasks[1], scenario.tasks))
    assert meth._prototypes.shape == (6, 32)  # 2 old classes x 3 centroids
    _run_task(model, meth, scenario.tasks[1], scenario.tasks)
    assert len(meth.metrics()["hide"][-1]["tap_losses"]) == 2


def test_overlapping_class_ranges_are_a_clear_error():
    scenario, model, meth = _setup(FAST)
    _run_task(model, meth, scenario.tasks[0], scenario.tasks)
    again = dataclasses.replace(scenario.tasks[1], offset=0)  # a domain-incremental task: same outputs
    with pytest.raises(ValueError, match="needs tasks with disjoint classes"):
        meth.begin_task(again, _ctx(again, scenario.tasks))
