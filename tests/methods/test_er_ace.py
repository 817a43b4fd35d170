"""``er_ace``: the asymmetric cross-entropy against a transcription of Mammoth's rule, its state, and resume.

The reference is aimagelab/mammoth at e75a491, ``models/er_ace.py``:

- lines 59-60: ``present = labels.unique()``; ``seen_so_far`` accumulates every class seen in a batch;
- lines 62-68: a mask of the logits' shape, 1 on the present classes and on every class from
  ``seen_so_far.max()`` up (the guard of line 67 is commented out);
- lines 70-71: from the second task (or ``task_free``) the masked logits are set to -1e9;
- line 73: ``loss = self.loss(logits, labels)``, the dataset's cross-entropy over all outputs;
- lines 76-83: from the second task, with a non-empty buffer, ``loss += CE(net(buf_inputs), buf_labels)``
  over a buffer batch of ``minibatch_size``, unmasked;
- lines 88-89: the batch goes into the reservoir buffer after the step;
- lines 15-33 and 45, 50-52: by default (``--use_custom_classifier``) the classifier is ``CustomLinear``: no
  bias, ``10 * cos(features, weight rows)``, each norm plus 1e-5.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from clmerge.config import parse_config
from clmerge.engine.checkpoint import load_checkpoint
from clmerge.engine.run import run_experiment
from clmerge.methods import build_method, method_options_model
from clmerge.methods.rehearsal import replay_generator
from clmerge.models.classifier import ContinualClassifier, IncrementalHead

from _lora_cl_helpers import assert_same_checkpoint, resume_killed_copy

N_CLASSES = 10


def _custom_linear(x, weight):
    """models/er_ace.py lines 24-33 (CustomLinear.forward), written out."""
    x_norm = torch.norm(x, p=2, dim=1).unsqueeze(1).expand_as(x)
    x_normalized = x.div(x_norm + 0.00001)
    L_norm = torch.norm(weight, p=2, dim=1).unsqueeze(1).expand_as(weight)
    cos_dist = torch.mm(x_normalized, weight.div(L_norm + 0.00001).transpose(0, 1))
    return 10 * cos_dist


def _net(model, classifier):
    """Mammoth's network: the backbone and its classifier (CustomLinear by default, else the linear head)."""
    if classifier == "linear":
        return model
    return lambda x: _custom_linear(model.backbone(x), torch.cat([b.weight for b in model.head.blocks]))


def _mammoth_observe_loss(net, inputs, labels, seen_so_far, current_task, buf, task_free=False):
    """models/er_ace.py lines 59-83, written out (the loss before ``backward``)."""
    present = labels.unique()
    seen_so_far = torch.cat([seen_so_far, present]).unique()
    logits = net(inputs)
    mask = torch.zeros_like(logits)
    mask[:, present] = 1
    mask[:, seen_so_far.max():] = 1
    if current_task > 0 or task_free:
        logits = logits.masked_fill(mask == 0, -1e9)
    loss = F.cross_entropy(logits, labels)
    if buf is not None and (task_free or current_task > 0):
        loss = loss + F.cross_entropy(net(buf[0]), buf[1])
    return loss, seen_so_far


def _method(task_index=1, **opts):
    m = build_method("er_ace", method_options_model("er_ace")(buffer_size=6, minibatch_size=3, **opts), seed=7)
    torch.manual_seed(0)
    model = ContinualClassifier(nn.Linear(3, 3), IncrementalHead(3))
    m.setup(model)
    ctx = SimpleNamespace(task=SimpleNamespace(class_range=(2, 4), index=task_index, offset=2, n_classes=2),
                          head_loss="seen", batch_size=5, n_outputs=N_CLASSES,
                          generator=torch.Generator().manual_seed(1), log=lambda ev: None)
    m.begin_task(ctx.task, ctx)
    return m, model, ctx


def _fill(m):
    g = torch.Generator().manual_seed(0)
    m.buffer.add(g, x=torch.randn(6, 3, generator=g), y=torch.tensor([0, 1, 0, 1, 0, 1]))


def test_defaults_are_mammoths():
    o = method_options_model("er_ace")()
    assert (o.task_free, o.head_convention, o.buffer_size, o.minibatch_size) == (False, "mammoth", 200, None)
    assert o.classifier == "cosine"  # --use_custom_classifier, default true (line 45)


@pytest.mark.parametrize("classifier", ["cosine", "linear"])
@pytest.mark.parametrize("task_index", [0, 1])
def test_the_loss_is_mammoths_asymmetric_cross_entropy(task_index, classifier):
    m, model, ctx = _method(task_index, classifier=classifier)
    _fill(m)
    m.seen = [0, 1]
    net = _net(model, classifier)
    x, y = torch.randn(5, 3, generator=torch.Generator().manual_seed(9)), torch.tensor([2, 3, 3, 2, 3])
    got = m.loss(model, x, y, ctx)
    b = m.buffer.sample(3, replay_generator(7, 0, 1))
    want, seen = _mammoth_observe_loss(net, x, y, torch.tensor([0, 1]), task_index, (b["x"], b["y"]))
    assert torch.allclose(got, want, atol=1e-5)
    assert m.seen == seen.tolist() == [0, 1, 2, 3]
    if task_index == 0:  # lines 70 and 77: no mask and no replay in the first task, whatever the buffer holds
        assert torch.allclose(got, F.cross_entropy(net(x), y), atol=1e-5)
    assert torch.allclose(m.inference_model()(x), net(x), atol=1e-5)  # the evaluated classifier is the same


def test_the_mask_keeps_the_present_classes_and_those_from_the_largest_seen_up():
    m, model, ctx = _method(1, classifier="linear")
    m.seen = [0, 1, 2, 3, 4, 5]  # seen max 5 after this batch of classes 2 and 3
    x, y = torch.randn(4, 3), torch.tensor([2, 3, 2, 3])
    logits = model(x)
    keep = torch.tensor([0, 0, 1, 1, 0, 1, 1, 1, 1, 1], dtype=torch.bool)  # 2, 3 and 5..9
    want = F.cross_entropy(logits.masked_fill(~keep, -1e9), y)
    assert torch.allclose(m.loss(model, x, y, ctx), want, atol=1e-6)  # empty buffer: no replay term
    want_ref, _ = _mammoth_observe_loss(model, x, y, torch.tensor(m.seen), 1, None)
    assert torch.allclose(want, want_ref, atol=1e-6)


def test_task_free_masks_and_replays_from_the_first_task():
    m, model, ctx = _method(0, task_free=True)
    _fill(m)
    x, y = torch.randn(5, 3), torch.tensor([2, 3, 3, 2, 3])
    b = m.buffer.sample(3, replay_generator(7, 0, 1))
    want, _ = _mammoth_observe_loss(_net(model, "cosine"), x, y, torch.tensor([], dtype=torch.long), 0, (b["x"], b["y"]),
                                    task_free=True)
    assert torch.allclose(m.loss(model, x, y, ctx), want, atol=1e-5)


def test_the_batch_is_inserted_after_the_step():
    m, model, ctx = _method(1)
    x, y = torch.randn(5, 3), torch.tensor([2, 3, 3, 2, 3])
    m.loss(model, x, y, ctx)
    assert len(m.buffer) == 0
    m.after_step(model, ctx)
    assert len(m.buffer) == 5 and torch.equal(m.buffer.fields["y"][:5], y)


def _cfg(**options) -> dict:
    return {
        "scenario": {"dataset": "digits", "n_tasks": 2, "train_per_class": 40, "test_per_class": 10},
        "model": {"name": "mlp", "config": {"image_size": 8, "hidden": [32]}},
        "method": {"name": "er_ace", "buffer_size": 30, "minibatch_size": 8, **options},
        "optim": {"name": "sgd", "lr": 5e-2}, "train": {"epochs": 2, "batch_size": 20},
        "run": {"progress": False, "report": False, "keep_checkpoints": 2},
    }


def test_a_digits_run_keeps_its_seen_classes_and_resumes_bit_for_bit(tmp_path):
    data = _cfg()
    full = run_experiment(parse_config(data), tmp_path / "full")
    _, tensors, meta = load_checkpoint(tmp_path / "full" / "checkpoints" / "task_001.safetensors")
    assert meta["method"]["replay"]["seen"] == list(range(10))
    assert tensors["buffer/y"].min() < 5 <= tensors["buffer/y"].max()
    assert full["accuracy_matrix"][1][0] > 0  # replay keeps the first task's classes
    resumed = resume_killed_copy(parse_config(data), tmp_path / "full", "task_001.safetensors")  # killed after task 1
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    assert resumed["method_metrics"] == full["method_metrics"]
    a, b = assert_same_checkpoint(tmp_path / "full", tmp_path / "resumed", "task_001.safetensors")
    assert a[2]["method"] == b[2]["method"]


def test_head_compare_is_refused_with_the_cosine_classifier(tmp_path):
    with pytest.raises(ValueError, match="head.compare: method 'er_ace'.*CosineClassifier"):
        run_experiment(parse_config({**_cfg(), "head": {"compare": True}}), tmp_path / "run")
    run_experiment(parse_config({**_cfg(classifier="linear"), "head": {"compare": True}}), tmp_path / "linear")
