"""``ease``: one adapter subspace per task, prototype complement, subspace reweighting."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from clmerge.config import load_config, parse_config
from clmerge.engine import run as run_mod
from clmerge.engine.checkpoint import load_checkpoint
from clmerge.engine.run import run_experiment
from clmerge.methods import build_method, method_options_model
from clmerge.methods.ease import EaseClassifier, prototype_complement, subspace_weights
from _lora_cl_helpers import uncommit_checkpoint
from conftest import tiny_config

EASE = {"name": "ease", "bottleneck": 4}


def _cfg(n_tasks: int = 3, **method):
    return tiny_config(**{"method": {**EASE, **method}, "scenario.n_tasks": n_tasks,
                          "scenario.classes_per_task": [2] * n_tasks, "run.keep_checkpoints": n_tasks})


def _by_hand(own_old, shared_old, shared_new):
    """PILOT's double loop: cosine per pair, softmax over the shared classes, weighted sum of their prototypes."""
    sim = torch.zeros(len(own_old), len(shared_old))
    for a in range(len(own_old)):
        for b in range(len(shared_old)):
            sim[a, b] = torch.cosine_similarity(own_old[a], shared_old[b], dim=0)
    sim = torch.softmax(sim, dim=1)
    out = torch.zeros(len(own_old), shared_new.shape[1])
    for a in range(len(own_old)):
        for b in range(len(shared_old)):
            out[a] += sim[a, b] * shared_new[b]
    return out


def test_prototype_complement_is_the_similarity_weighted_combination():
    g = torch.Generator().manual_seed(0)
    own, shared_old, shared_new = (torch.randn(n, 3, generator=g) for n in (2, 4, 4))
    torch.testing.assert_close(prototype_complement(own, shared_old, shared_new), _by_hand(own, shared_old, shared_new))
    hot = prototype_complement(own, shared_old, shared_new, temperature=1e-4)  # τ -> 0: the most similar class
    nearest = (F.normalize(own, dim=1) @ F.normalize(shared_old, dim=1).T).argmax(1)
    torch.testing.assert_close(hot, shared_new[nearest])


def _method(**opts):
    return build_method("ease", method_options_model("ease")(bottleneck=4, **opts))


def test_completed_prototypes_of_three_tasks_match_the_hand_computation():
    """Tasks of 2, 1, 2 classes: every old class's prototype in every later subspace (PILOT solve_sim_reset)."""
    g = torch.Generator().manual_seed(1)
    m = _method()
    m.ranges = [(0, 2), (2, 3), (3, 5)]
    real = torch.randn(5, 3, 4, generator=g)
    m.protos = real.clone()
    m._complete()
    P = m.protos
    want_01 = _by_hand(real[0:2, 0], real[2:5, 0], real[2:5, 1])  # task 0 in subspace 1: classes of tasks 1..2
    want_02 = _by_hand(real[0:2, 0], real[3:5, 0], real[3:5, 2])  # task 0 in subspace 2: classes of task 2
    want_12 = _by_hand(real[2:3, 1], real[3:5, 1], real[3:5, 2])
    torch.testing.assert_close(P[0:2, 1], want_01)
    torch.testing.assert_close(P[0:2, 2], want_02)
    torch.testing.assert_close(P[2:3, 2], want_12)
    torch.testing.assert_close(P[:, 0], real[:, 0])  # own-subspace and real prototypes stay
    torch.testing.assert_close(P[3:5], real[3:5])

    m = _method(recalc_sim=False)  # PILOT solve_similarity: newest subspace only, from the current task
    m.ranges, m.protos = [(0, 2), (2, 3), (3, 5)], real.clone()
    m._complete()
    torch.testing.assert_close(m.protos[0:2, 1], real[0:2, 1])
    torch.testing.assert_close(m.protos[0:2, 2], want_02)


def test_subspace_weights_follow_the_reweighting_formula():
    w = subspace_weights(3, alpha=0.1)
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.05, 0.05], [0.05, 1.0, 0.05], [0.05, 0.05, 1.0]]))
    w = subspace_weights(2, alpha=0.1, beta=0.5, use_init_ptm=True)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0, 0.1], [0.5, 0.1, 1.0]]))
    assert torch.equal(subspace_weights(1, alpha=0.1), torch.ones(1, 1))


def test_reweighted_logits_are_the_weighted_sum_of_per_subspace_cosines():
    g = torch.Generator().manual_seed(2)
    feats, protos = torch.randn(4, 2, 3, generator=g), torch.randn(3, 2, 3, generator=g)  # 2 subspaces, 3 classes
    class_task = torch.tensor([0, 0, 1])
    weights = subspace_weights(2, alpha=0.3)
    clf = EaseClassifier(torch.nn.Identity(), ["task0", "task1"], protos, class_task, weights)
    logits = clf.logits_from(feats)
    for b in range(4):
        for c in range(3):
            i = int(class_task[c])
            want = sum((1.0 if k == i else 0.3) * F.cosine_similarity(feats[b, k], protos[c, k], dim=0)
                       for k in range(2))
            torch.testing.assert_close(logits[b, c], want)
    flat = EaseClassifier(torch.nn.Identity(), ["task0", "task1"], protos, class_task, None).logits_from(feats)
    torch.testing.assert_close(flat, F.normalize(feats.flatten(1), dim=1) @ F.normalize(protos.flatten(1), dim=1).T)
    assert not torch.allclose(flat, logits)


def test_each_task_trains_only_its_own_subspace_and_head_block(tmp_path, monkeypatch):
    seen, real = [], run_mod.fit

    def fit(model, data, *, groups, **kw):
        seen.append(sorted({n.split(".sets.")[1].split(".")[0] if ".sets." in n else n.rsplit(".", 1)[0]
                            for n, p in model.named_parameters() if any(p is q for g in groups for q in g["params"])}))
        return real(model, data, groups=groups, **kw)

    monkeypatch.setattr(run_mod, "fit", fit)
    result = run_experiment(parse_config(_cfg(3)), tmp_path / "run")
    assert seen == [["head.blocks.0", "task0"], ["head.blocks.1", "task1"], ["head.blocks.2", "task2"]]
    assert all(v is not None for v in result["accuracy_matrix"][2])
    _, tensors, meta = load_checkpoint(tmp_path / "run" / "checkpoints" / "task_002.safetensors")
    assert tensors["protos"].shape == (6, 3, 32) and meta["method"]["ranges"] == [[0, 2], [2, 4], [4, 6]]


def test_a_resumed_ease_run_gives_the_same_numbers(tmp_path):
    data = _cfg(3)
    full = run_experiment(parse_config(data), tmp_path / "full")
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    (tmp_path / "resumed" / "metrics.json").unlink()
    uncommit_checkpoint(tmp_path / "resumed", "task_002.safetensors")  # killed after the second task
    resumed = run_experiment(parse_config(data), tmp_path / "resumed", resume=True)
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    a = load_checkpoint(tmp_path / "full" / "checkpoints" / "task_002.safetensors")
    b = load_checkpoint(tmp_path / "resumed" / "checkpoints" / "task_002.safetensors")
    for x, z in zip(a[:2], b[:2]):  # the adapters and the prototypes
        assert x.keys() == z.keys() and all(torch.equal(x[k], z[k]) for k in x)


def test_ease_defaults_are_pilots():
    o = load_config(None, ["method.name=ease"]).method_options()
    assert (o.bottleneck, o.adapter_scale, o.alpha, o.beta, o.reweight, o.recalc_sim, o.use_init_ptm) == \
        (64, 0.1, 0.1, 0.0, True, True, False)
    with pytest.raises(Exception, match="sim_temperature"):
        load_config(None, ["method.name=ease", "method.sim_temperature=0"])


def test_the_pretrained_subspace_joins_with_use_init_ptm(tmp_path):
    result = run_experiment(parse_config(_cfg(2, use_init_ptm=True, beta=1.0)), tmp_path / "run")
    _, tensors, _ = load_checkpoint(tmp_path / "run" / "checkpoints" / "task_001.safetensors")
    assert tensors["protos"].shape == (4, 3, 32)
    assert all(v is not None for v in result["accuracy_matrix"][1])


def test_a_task_that_reuses_old_outputs_is_refused():
    """Domain-incremental tasks share their classes: no new classes, no subspace prototypes to complete."""
    from types import SimpleNamespace

    m = _method()
    m.ranges = [(0, 2)]
    with pytest.raises(ValueError, match="scenario.kind: ease needs new classes in every task"):
        m.begin_task(SimpleNamespace(index=1, offset=0, n_classes=2), None)
