"""``lwf``: PyCIL's LwF rule transcribed, the frozen previous model, and resume bit for bit.

The reference is G-U-N/PyCIL at 87cc411, ``models/lwf.py``:

- lines 28-29: ``T = 2``, ``lamda = 3``;
- lines 156-166 (``_update_representation``, tasks after the first): ``loss_clf`` is the cross-entropy of
  ``logits[:, known:]`` against ``targets - known``; ``loss_kd = _KD_loss(logits[:, :known],
  old_network(inputs), T)``; ``loss = lamda * loss_kd + loss_clf``;
- lines 202-205: ``_KD_loss(pred, soft, T) = -sum(softmax(soft / T) * log_softmax(pred / T)) / batch``;
- the first task (``_init_train``) trains ``F.cross_entropy(logits, targets)`` over its own classes;
- ``after_task`` keeps ``self._network.copy().freeze()`` (``utils/inc_net.py`` lines 97-102: no gradients,
  eval mode).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from clmerge.config import parse_config
from clmerge.engine.checkpoint import load_checkpoint
from clmerge.engine.run import run_experiment
from clmerge.methods import build_method, method_class, method_options_model
from clmerge.methods.lwf import kd_loss
from clmerge.models.classifier import ContinualClassifier, IncrementalHead

from _lora_cl_helpers import assert_same_checkpoint, resume_killed_copy


def _pycil_kd(pred, soft, T):
    """models/lwf.py lines 202-205."""
    pred = torch.log_softmax(pred / T, dim=1)
    soft = torch.softmax(soft / T, dim=1)
    return -1 * torch.mul(soft, pred).sum() / pred.shape[0]


def test_defaults_are_pycils():
    o = method_options_model("lwf")()
    assert (o.temperature, o.lamda) == (2.0, 3.0)
    assert method_class("lwf").head_defaults == {"loss": "local"}


def test_kd_is_pycils():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    for T in (1.0, 2.0, 5.0):
        assert torch.allclose(kd_loss(a, b, T), _pycil_kd(a, b, T), atol=1e-6)


def _ctx(index, lo, hi, head_loss="local"):
    return SimpleNamespace(task=SimpleNamespace(class_range=(lo, hi), index=index, offset=lo, n_classes=hi - lo),
                           head_loss=head_loss, batch_size=5, generator=torch.Generator().manual_seed(1),
                           log=lambda ev: None)


def test_the_loss_is_pycils_after_the_first_task_and_plain_ce_before():
    m = build_method("lwf", method_options_model("lwf")(), seed=0)
    torch.manual_seed(0)
    model = ContinualClassifier(nn.Sequential(nn.Linear(3, 4), nn.ReLU()), IncrementalHead(4))
    m.setup(model)
    c0 = _ctx(0, 0, 2)
    m.begin_task(c0.task, c0)
    x0, y0 = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
    assert torch.allclose(m.loss(model, x0, y0, c0), F.cross_entropy(model(x0), y0), atol=1e-6)
    m.end_task(c0.task, c0)
    old = m.old
    assert not any(p.requires_grad for p in old.parameters()) and not old.training
    c1 = _ctx(1, 2, 4)
    m.begin_task(c1.task, c1)
    with torch.no_grad():  # the model moves away from the frozen copy
        model.backbone[0].weight.add_(0.3)
    x, y = torch.randn(5, 3), torch.tensor([2, 3, 3, 2, 3])
    logits = model(x)
    known = 2
    want = 3 * _pycil_kd(logits[:, :known], old(x), 2) + F.cross_entropy(logits[:, known:], y - known)
    assert torch.allclose(m.loss(model, x, y, c1), want, atol=1e-6)
    assert old(x).shape[1] == 2 and model(x).shape[1] == 4
    # head.loss seen: the cross-entropy over every seen class (an option, not PyCIL's rule)
    want_seen = 3 * _pycil_kd(logits[:, :known], old(x), 2) + F.cross_entropy(logits, y)
    assert torch.allclose(m.loss(model, x, y, _ctx(1, 2, 4, "seen")), want_seen, atol=1e-6)


def _cfg() -> dict:
    return {
        "scenario": {"dataset": "digits", "n_tasks": 5, "train_per_class": 30, "test_per_class": 10},
        "model": {"name": "mlp", "config": {"image_size": 8, "hidden": [32]}},
        "method": {"name": "lwf"},
        "optim": {"name": "sgd", "lr": 5e-2}, "train": {"epochs": 2, "batch_size": 20},
        "run": {"progress": False, "report": False, "keep_checkpoints": 5},
    }


def test_a_digits_run_keeps_the_previous_model_and_resumes_bit_for_bit(tmp_path):
    data = _cfg()
    full = run_experiment(parse_config(data), tmp_path / "full")
    model_state, tensors, _ = load_checkpoint(tmp_path / "full" / "checkpoints" / "task_001.safetensors")
    old = {k[len("old/"):]: v for k, v in tensors.items() if k.startswith("old/")}
    assert old.keys() == model_state.keys() and all(torch.equal(old[k], model_state[k]) for k in old)
    resumed = resume_killed_copy(parse_config(data), tmp_path / "full", "task_004.safetensors")  # killed after task 4
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    a, b = assert_same_checkpoint(tmp_path / "full", tmp_path / "resumed", "task_004.safetensors")
