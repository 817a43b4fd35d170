"""``icarl``: PyCIL's herding, exemplar means, NME classifier and loss transcribed, and resume bit for bit.

The reference is G-U-N/PyCIL at 87cc411:

- ``models/base.py`` lines 39-45: ``samples_per_class = memory_size // total_classes`` (``fixed_memory`` off);
- lines 180-214, ``_reduce_exemplar``: each old class keeps its first ``m`` exemplars; its mean is the mean of
  the exemplars' normalised features (``EPSILON = 1e-8``, line 11), normalised, with the current network;
- lines 216-285, ``_construct_exemplar``: herding on the class's normalised features, ``mu_p = (vectors + S) / k``
  and the argmin of ``||class_mean - mu_p||`` over the remaining examples (lines 228-253), then the mean as above;
- lines 151-159, ``_eval_nme``: the argmin of ``cdist(class_means, vectors, 'sqeuclidean')`` over the
  normalised test features;
- ``models/icarl.py`` lines 30 and 156-167: ``T = 2``; ``loss = CE(logits, targets) + _KD_loss(logits[:, :known],
  old(inputs), T)`` over the batches of the new data with the exemplars appended (lines 53-58).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from clmerge.config import parse_config
from clmerge.engine.checkpoint import load_checkpoint
from clmerge.engine.run import run_experiment
from clmerge.methods import build_method, method_options_model
from clmerge.methods.icarl import NMEClassifier, herding_order
from clmerge.methods.rehearsal import replay_generator
from clmerge.models.classifier import ContinualClassifier, IncrementalHead
from scipy.spatial.distance import cdist

from _lora_cl_helpers import assert_same_checkpoint, resume_killed_copy

EPSILON = 1e-8


def _pycil_herding(vectors: np.ndarray, m: int) -> list[int]:
    """models/base.py lines 228-253 (indices into the original rows instead of the data itself)."""
    vectors = (vectors.T / (np.linalg.norm(vectors.T, axis=0) + EPSILON)).T
    class_mean = np.mean(vectors, axis=0)
    rows = np.arange(len(vectors))
    selected, exemplar_vectors = [], []
    for k in range(1, m + 1):
        S = np.sum(exemplar_vectors, axis=0)
        mu_p = (vectors + S) / k
        i = np.argmin(np.sqrt(np.sum((class_mean - mu_p) ** 2, axis=1)))
        selected.append(int(rows[i]))
        exemplar_vectors.append(np.array(vectors[i]))
        vectors = np.delete(vectors, i, axis=0)
        rows = np.delete(rows, i, axis=0)
    return selected


def _pycil_mean(vectors: np.ndarray) -> np.ndarray:
    """models/base.py lines 209-214."""
    vectors = (vectors.T / (np.linalg.norm(vectors.T, axis=0) + EPSILON)).T
    mean = np.mean(vectors, axis=0)
    return mean / np.linalg.norm(mean)


def _pycil_kd(pred, soft, T):
    """models/icarl.py's _KD_loss (lines 202-205)."""
    pred = torch.log_softmax(pred / T, dim=1)
    soft = torch.softmax(soft / T, dim=1)
    return -1 * torch.mul(soft, pred).sum() / pred.shape[0]


def _normalize(v):
    return v / (torch.linalg.vector_norm(v, dim=1, keepdim=True) + EPSILON)


def test_defaults_are_pycils():
    o = method_options_model("icarl")()
    assert (o.buffer_size, o.temperature, o.kd_weight, o.classifier) == (2000, 2.0, 1.0, "nme")


def test_herding_is_pycils():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(40, 6, generator=g, dtype=torch.float64)
    for m in (1, 5, 17):
        assert herding_order(_normalize(v), m) == _pycil_herding(v.numpy(), m)


def test_nme_is_pycils():
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(7, 5, generator=g)
    means = torch.stack([torch.as_tensor(_pycil_mean(torch.randn(4, 5, generator=g).numpy())) for _ in range(3)])
    nme = NMEClassifier(ContinualClassifier(nn.Identity(), IncrementalHead(5)), means.float())
    got = nme(feats)
    vectors = _normalize(feats.double()).numpy()
    dists = cdist(means.numpy(), vectors, "sqeuclidean")  # models/base.py line 156
    assert np.allclose(-got.numpy(), dists.T, atol=1e-5)
    assert got.argmax(1).tolist() == np.argsort(dists.T, axis=1)[:, 0].tolist()


class _Data:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def batches(self, batch_size, *, shuffle=False, generator=None):
        for s in range(0, len(self.y), batch_size):
            yield self.x[s:s + batch_size], self.y[s:s + batch_size]


def _task(index, n=20, cpt=2):
    g = torch.Generator().manual_seed(50 + index)
    lo = index * cpt
    return SimpleNamespace(index=index, class_range=(lo, lo + cpt), offset=lo, n_classes=cpt,
                           train=_Data(torch.randn(n, 3, generator=g), lo + torch.arange(n) % cpt))


def _ctx(tasks, t):
    return SimpleNamespace(task=tasks[t], seen_tasks=tasks[: t + 1], head_loss="seen", batch_size=5,
                           eval_batch_size=7, generator=torch.Generator().manual_seed(1), log=lambda ev: None)


def test_the_memory_and_class_means_are_pycils_and_the_loss_is_ce_plus_kd():
    m = build_method("icarl", method_options_model("icarl")(buffer_size=12, minibatch_size=4), seed=3)
    torch.manual_seed(0)
    model = ContinualClassifier(nn.Sequential(nn.Linear(3, 4), nn.Tanh()), IncrementalHead(4))
    m.setup(model)
    tasks = [_task(0), _task(1)]
    c0 = _ctx(tasks, 0)
    m.begin_task(tasks[0], c0)
    m.end_task(tasks[0], c0)
    feats = model.forward_features(tasks[0].train.x).detach()
    per = 12 // 2  # lines 39-45
    want_rows = []
    for c in (0, 1):
        rows = (tasks[0].train.y == c).nonzero().flatten()
        want_rows += rows[_pycil_herding(feats[rows].double().numpy(), per)].tolist()
    assert torch.equal(m.buffer.fields["x"], tasks[0].train.x[want_rows])
    assert m.buffer.fields["y"].tolist() == [0] * 6 + [1] * 6
    for c in (0, 1):
        ex = model.forward_features(tasks[0].train.x[want_rows][m.buffer.fields["y"] == c]).detach()
        assert np.allclose(m.means[c].numpy(), _pycil_mean(ex.double().numpy()), atol=1e-5)
    c1 = _ctx(tasks, 1)
    m.begin_task(tasks[1], c1)
    with torch.no_grad():
        model.backbone[0].weight.mul_(-1.5)
    x, y = tasks[1].train.x[:5], tasks[1].train.y[:5]
    got = m.loss(model, x, y, c1)
    b = m.buffer.sample(4, replay_generator(3, 0, 1))
    xa, ya = torch.cat([x, b["x"]]), torch.cat([y, b["y"]])
    logits = model(xa)
    want = F.cross_entropy(logits, ya) + _pycil_kd(logits[:, :2], m.old(xa), 2)  # models/icarl.py 160-167
    assert torch.allclose(got, want, atol=1e-6)
    m.end_task(tasks[1], c1)
    # lines 180-200: the old classes keep their first 12 // 4 = 3 exemplars in herding order
    assert m.buffer.fields["y"][: len(m.buffer)].tolist() == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    assert torch.equal(m.buffer.fields["x"][:3], tasks[0].train.x[want_rows[:3]])
    assert torch.equal(m.buffer.fields["x"][3:6], tasks[0].train.x[want_rows[6:9]])
    ex0 = model.forward_features(m.buffer.fields["x"][:3]).detach()  # the old class's mean, current model
    assert np.allclose(m.means[0].numpy(), _pycil_mean(ex0.double().numpy()), atol=1e-5)
    assert isinstance(m.inference_model(), NMEClassifier) and m.means.shape == (4, 4)


def test_the_memory_batch_is_in_the_proportion_of_the_memory_to_the_task():
    m = build_method("icarl", method_options_model("icarl")(buffer_size=12), seed=3)
    torch.manual_seed(0)
    model = ContinualClassifier(nn.Linear(3, 4), IncrementalHead(4))
    m.setup(model)
    tasks = [_task(0), _task(1, n=30)]
    c0 = _ctx(tasks, 0)
    m.begin_task(tasks[0], c0)
    m.end_task(tasks[0], c0)
    c1 = _ctx(tasks, 1)
    m.begin_task(tasks[1], c1)
    seen = []
    m.old = lambda xa: seen.append(len(xa)) or torch.zeros(len(xa), 2)
    m.loss(model, tasks[1].train.x[:10], tasks[1].train.y[:10], c1)
    assert seen == [10 + 4]  # 10 * 12 / 30 memory examples beside the 10 new ones


def _cfg(**method) -> dict:
    return {
        "scenario": {"dataset": "digits", "n_tasks": 5, "train_per_class": 30, "test_per_class": 10},
        "model": {"name": "mlp", "config": {"image_size": 8, "hidden": [32]}},
        "method": {"name": "icarl", "buffer_size": 40, **method},
        "optim": {"name": "sgd", "lr": 5e-2}, "train": {"epochs": 2, "batch_size": 20},
        "run": {"progress": False, "report": False, "keep_checkpoints": 5},
    }


def test_a_digits_run_keeps_a_balanced_memory_and_resumes_bit_for_bit(tmp_path):
    data = _cfg()
    full = run_experiment(parse_config(data), tmp_path / "full")
    _, tensors, _ = load_checkpoint(tmp_path / "full" / "checkpoints" / "task_002.safetensors")
    assert tensors["buffer/y"][:36].bincount().tolist() == [6] * 6  # 40 // 6 per class
    assert tensors["icarl/means"].shape[0] == 6 and any(k.startswith("old/") for k in tensors)
    assert full["accuracy_matrix"][4][0] > 0
    resumed = resume_killed_copy(parse_config(data), tmp_path / "full", "task_004.safetensors")  # killed after task 4
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    assert resumed["method_metrics"] == full["method_metrics"]
    a, b = assert_same_checkpoint(tmp_path / "full", tmp_path / "resumed", "task_004.safetensors")
    linear = run_experiment(parse_config(_cfg(classifier="linear")), tmp_path / "linear")
    assert linear["accuracy_matrix"] != full["accuracy_matrix"]  # the same training, another classifier


def test_the_papers_bce_loss_targets_the_previous_models_sigmoids_for_old_classes():
    """Rebuffi et al. 2017, Algorithm 3 (an option; PyCIL's CE + KD is the default)."""
    m = build_method("icarl", method_options_model("icarl")(buffer_size=12, loss="bce"), seed=3)
    torch.manual_seed(0)
    model = ContinualClassifier(nn.Linear(3, 4), IncrementalHead(4))
    m.setup(model)
    tasks = [_task(0), _task(1)]
    m.begin_task(tasks[0], _ctx(tasks, 0))
    x0, y0 = tasks[0].train.x[:5], tasks[0].train.y[:5]
    want0 = F.binary_cross_entropy_with_logits(model(x0), F.one_hot(y0, 2).float(), reduction="sum") / 5
    assert torch.allclose(m.loss(model, x0, y0, _ctx(tasks, 0)), want0, atol=1e-6)
    m.end_task(tasks[0], _ctx(tasks, 0))
    m.buffer.fields, m.buffer.n_seen = {}, 0  # no memory batch: the current batch alone
    m.begin_task(tasks[1], _ctx(tasks, 1))
    x, y = tasks[1].train.x[:5], tasks[1].train.y[:5]
    target = torch.cat([torch.sigmoid(m.old(x)), F.one_hot(y, 4).float()[:, 2:]], 1)
    want = F.binary_cross_entropy_with_logits(model(x), target, reduction="sum") / 5
    assert torch.allclose(m.loss(model, x, y, _ctx(tasks, 1)), want, atol=1e-6)


def test_head_compare_is_refused_with_the_nme_classifier(tmp_path):
    data = {**_cfg(), "head": {"compare": True}}
    with pytest.raises(ValueError, match="head.compare: method 'icarl'.*NMEClassifier"):
        run_experiment(parse_config(data), tmp_path / "run")
