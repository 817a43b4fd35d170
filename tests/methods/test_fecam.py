"""``fecam``: class means and shrunk, normalised covariances of frozen features; Mahalanobis classifier.

Transcribed rules: FeCAM's pretrained-ViT code (dipamgoswami/FeCAM at d2479b7bc9c3e704b0835ccd5928a2d7e0df5a09,
``FeCAM_vit_cifar100.py``), its ResNet code's Tukey transform (``models/base.py``), and LAMDA-PILOT's port
(sun-hailong/LAMDA-PILOT at 264745534fc2233f5a50b020e50a3472c47eb756, ``models/fecam.py``)."""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.nn.functional as F

from clmerge.config import ConfigError, load_config, parse_config
from clmerge.engine import run as run_mod
from clmerge.engine.checkpoint import load_checkpoint
from clmerge.engine.run import build_classifier, run_experiment
from clmerge.methods import build_method
from clmerge.methods.fecam import FeCAMHead, tukey
from _lora_cl_helpers import assert_same_checkpoint, resume_killed_copy
from conftest import tiny_config


def _cfg(n_tasks: int = 3, **method):
    return tiny_config(**{"method": {"name": "fecam", **method}, "scenario.n_tasks": n_tasks,
                          "scenario.classes_per_task": [2] * n_tasks, "run.keep_checkpoints": n_tasks})


def _data(seed=0, n=30, d=6, classes=3):
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(classes).repeat_interleave(n)
    centres = torch.randn(classes, d, generator=g) * 2
    scales = torch.rand(classes, d, generator=g) * 2 + 0.2  # heterogeneous class covariances
    feats = centres[labels] + torch.randn(len(labels), d, generator=g) * scales[labels]
    return feats.double(), labels


def _fecam(**opts):
    return build_method("fecam", load_config(None, ["method.name=fecam"] + [f"method.{k}={v}" for k, v in
                                                                           opts.items()]).method_options())


def _logits(m, feats, labels, test, classes=3):
    means, precs = m.class_statistics(feats, labels, 0, classes)
    return FeCAMHead(means, precs, m.options)(test.double())


# --- FeCAM_vit_cifar100.py, transcribed (numpy) -------------------------------------------------------------
def _vit_shrink_cov(cov):  # lines 29-39
    diag_mean = np.mean(np.diagonal(cov))
    off_diag = np.copy(cov)
    np.fill_diagonal(off_diag, 0.0)
    mask = off_diag != 0.0
    off_diag_mean = (off_diag * mask).sum() / mask.sum()
    iden = np.eye(cov.shape[0])
    alpha1, alpha2 = 1, 0
    return cov + (alpha1 * diag_mean * iden) + (alpha2 * off_diag_mean * (1 - iden))


def _vit_normalize_cov(cov_mat):  # lines 41-49
    out = []
    for cov in cov_mat:
        sd = np.sqrt(np.diagonal(cov))
        out.append(cov / (np.matmul(np.expand_dims(sd, 1), np.expand_dims(sd, 0))))
    return out


def _vit_mahalanobis(dist, cov):  # lines 51-57
    inv_covmat = np.linalg.pinv(cov)
    return np.diagonal(np.matmul(np.matmul(dist, inv_covmat), dist.T), 0)


def _vit_distances(feats, labels, test, classes=3):
    """Lines 75-106: F.normalize of the features, per class np.mean / np.cov / shrink, normalize_cov, then the
    distance of every test feature to every class; prediction = argmin."""
    X, y = F.normalize(feats).numpy(), labels.numpy()
    means, shrunk = [], []
    for i in range(classes):
        means.append(np.mean(X[y == i], axis=0))
        shrunk.append(_vit_shrink_cov(np.cov(X[y == i].T)))
    norm = _vit_normalize_cov(shrunk)
    out = F.normalize(test).numpy()
    return np.array([_vit_mahalanobis(out - means[c], norm[c]) for c in range(classes)]).T


def test_the_default_is_fecams_vit_code():
    feats, labels = _data()
    test, _ = _data(seed=1)
    m = _fecam()
    ours = -_logits(m, feats, labels, test)
    official = _vit_distances(feats, labels, test)
    assert np.allclose(ours.numpy(), official, rtol=1e-6, atol=1e-6)
    assert (ours.argmin(-1).numpy() == official.argmin(-1)).all()


# --- LAMDA-PILOT models/fecam.py, transcribed (torch) --------------------------------------------------------
def _pilot_distances(feats, labels, test, classes=3):
    """replace_fc (lines 41-63): torch.cov of the raw features, corrcoef(shrink_cov(cov, 100)) (line 64, alpha
    line 36, shrink_cov lines 152-155); _mahalanobis (lines 143-150): normalised feature minus normalised
    mean, pinv of the matrix."""
    mats, means = [], []
    for c in range(classes):
        emb = feats[labels == c]
        cov = torch.cov(emb.T)
        means.append(emb.mean(0))
        mats.append(torch.corrcoef(cov + 100 * torch.eye(cov.shape[0], dtype=cov.dtype)))
    out = []
    for c in range(classes):
        x_minus_mu = F.normalize(test, p=2, dim=-1) - F.normalize(means[c], p=2, dim=-1)
        inv = torch.linalg.pinv(mats[c])
        out.append(torch.diagonal(x_minus_mu @ inv @ x_minus_mu.T, 0))
    return torch.stack(out).T


def test_pilots_rule_is_three_options():
    feats, labels = _data()
    test, _ = _data(seed=2)
    m = _fecam(feature_norm="at_distance", shrink="identity", cov_norm="corrcoef")
    assert torch.allclose(-_logits(m, feats, labels, test), _pilot_distances(feats, labels, test), rtol=1e-6,
                          atol=1e-8)


def test_tukeys_transform_is_the_resnet_codes_and_refuses_signed_features():
    x = torch.rand(4, 5).double() + 0.01
    # models/base.py lines 196-202: log at beta 0, else x ** beta
    assert torch.equal(tukey(x, 0.5), torch.pow(x, 0.5)) and torch.equal(tukey(x, 0.0), torch.log(x))
    feats, labels = _data()
    with pytest.raises(ValueError, match=r"method.tukey_beta=0.5: Tukey's transform needs non-negative"):
        _fecam(tukey_beta=0.5).class_statistics(feats, labels, 0, 3)
    m = _fecam(tukey_beta=0.5)
    pos = feats.abs()
    means, _ = m.class_statistics(pos, labels, 0, 3)
    assert torch.allclose(means[0], F.normalize(pos[labels == 0].sqrt()).mean(0))


def test_heterogeneous_classes_are_told_apart_where_euclidean_ncm_fails():
    """Two classes with the same mean direction spread along different axes: the Mahalanobis head uses the
    shapes (the paper's motivation)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(400, 2, generator=g) * torch.tensor([3.0, 0.1]) + torch.tensor([0.0, 10.0])
    b = torch.randn(400, 2, generator=g) * torch.tensor([0.1, 3.0]) + torch.tensor([0.0, 10.0])
    feats, labels = torch.cat([a, b]).double(), torch.arange(2).repeat_interleave(400)
    m = _fecam(feature_norm="none", shrink="none", cov_norm="none")
    acc = (_logits(m, feats, labels, feats, classes=2).argmax(-1) == labels).double().mean()
    assert acc > 0.9


def test_a_class_with_one_example_is_refused():
    feats, labels = _data()
    labels = labels.clone()
    labels[labels == 2] = 1
    labels[0] = 2
    with pytest.raises(ValueError, match="fecam: class 2 has 1 training example"):
        _fecam().class_statistics(feats, labels, 0, 3)


def test_fecam_trains_nothing_and_its_head_predicts(tmp_path, monkeypatch):
    calls = []
    real = run_mod.fit
    monkeypatch.setattr(run_mod, "fit", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = parse_config(_cfg(2))
    result = run_experiment(cfg, tmp_path / "run")
    assert calls == []  # FeCAM's ViT code: the pretrained backbone as it is
    state, tensors, _ = load_checkpoint(tmp_path / "run" / "checkpoints" / "task_001.safetensors")
    initial = build_classifier(cfg).state_dict()
    assert all(torch.equal(state[k], initial[k]) for k in initial if k.startswith("backbone."))
    assert tensors["means"].shape[0] == 4 and tensors["precisions"].shape[:1] == (4,)
    assert all(v is not None for v in result["accuracy_matrix"][1])


def test_first_session_adapt_trains_the_first_task_only(tmp_path, monkeypatch):
    calls = []
    real = run_mod.fit
    monkeypatch.setattr(run_mod, "fit", lambda *a, **k: calls.append(1) or real(*a, **k))
    run_experiment(parse_config(_cfg(2, first_session_adapt=True, bottleneck=4)), tmp_path / "run")
    assert calls == [1]


def test_the_head_is_its_own_and_a_domain_incremental_scenario_is_refused():
    cfg = load_config(None, ["method.name=fecam"])
    assert cfg.head.classifier == "linear" and cfg.optim.lr == 1e-2
    o = cfg.method_options()
    assert (o.feature_norm, o.tukey_beta, o.shrink, o.alpha1, o.alpha2, o.cov_norm, o.first_session_adapt) == \
        ("before_stats", None, "fecam", 1.0, 0.0, "correlation", False)
    with pytest.raises((ConfigError, ValueError)):
        load_config(None, ["method.name=fecam", "method.cov_norm=pinv"])
    from types import SimpleNamespace

    m = _fecam()
    m.n_classes = 2
    with pytest.raises(ValueError, match="scenario.kind: fecam needs new classes in every task"):
        m.begin_task(SimpleNamespace(index=1, offset=0, n_classes=2), None)


@pytest.mark.parametrize("adapt", [False, True])
def test_a_resumed_fecam_run_gives_the_same_numbers(tmp_path, adapt):
    data = _cfg(3, first_session_adapt=adapt, bottleneck=4)
    full = run_experiment(parse_config(data), tmp_path / "full")
    resumed = resume_killed_copy(parse_config(data), tmp_path / "full", "task_002.safetensors")  # killed after the second task
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    a, b = assert_same_checkpoint(tmp_path / "full", tmp_path / "resumed", "task_002.safetensors")  # the backbone (adapter) and the means / precision matrices


@pytest.mark.parametrize("key", ["head.compare=true", "head.classifier=ncm"])
def test_the_feature_heads_and_compare_are_refused(key, tmp_path):
    """FeCAM's own head predicts; the suite's shadows would copy a linear head it never trains."""
    name, value = key.split("=")
    data = _cfg(2)
    node = data
    *path, last = name.split(".")
    for p in path:
        node = node.setdefault(p, {})
    node[last] = True if value == "true" else value
    with pytest.raises(ValueError, match=rf"{name}.*method 'fecam' has no single shared backbone"):
        run_experiment(parse_config(data), tmp_path / "run")

