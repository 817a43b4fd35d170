"""``method.head_convention`` of er, der and derpp: Mammoth's full-size head (the default) and the grown head.

The reference rule, transcribed from Mammoth (aimagelab/mammoth at e75a491):

- the head has every class of the dataset from the first task: ``main.py`` lines 420-422 set
  ``args.num_classes = dataset.N_CLASSES`` and ``backbone/MNISTMLP.py`` lines 79-82 build the classifier with
  ``num_classes`` outputs;
- every cross-entropy covers all outputs: ``datasets/seq_mnist.py`` lines 99-100 (``get_loss`` is
  ``F.cross_entropy``), applied to the whole output in ``models/er.py`` lines 53-60 (current batch and buffer
  batch concatenated, one loss), ``models/der.py`` lines 34-35 and ``models/derpp.py`` lines 36-38 and 47-50;
- DER stores ``outputs.data``, the logits over all classes (``models/der.py`` line 46, ``models/derpp.py``
  lines 56-58), and its MSE compares all of them (``models/der.py`` line 41, ``models/derpp.py`` line 44);
- evaluation masks the classes not seen yet: ``utils/evaluate.py`` line 54 (``n_classes =
  dataset.get_offsets()[1]``, the end of the current task) and line 88 (the class-IL argmax over
  ``outputs[:, :n_classes]``); task-IL keeps the task's own range (lines 11-25 and 96-98).
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from clmerge.config import ConfigError, parse_config
from clmerge.engine.checkpoint import load_checkpoint
from clmerge.engine.evaluate import evaluate_tasks
from clmerge.engine.run import run_experiment
from clmerge.methods import build_method, method_options_model
from clmerge.methods.rehearsal import replay_generator
from clmerge.models.classifier import ContinualClassifier, IncrementalHead

from _lora_cl_helpers import uncommit_checkpoint

N_CLASSES = 10


def _method(name: str, **opts):
    m = build_method(name, method_options_model(name)(buffer_size=6, minibatch_size=3, **opts), seed=7)
    torch.manual_seed(0)
    model = ContinualClassifier(nn.Linear(3, 3), IncrementalHead(3))
    m.setup(model)
    ctx = SimpleNamespace(task=SimpleNamespace(class_range=(2, 4), index=1, offset=2, n_classes=2),
                          head_loss="seen", batch_size=5, n_outputs=N_CLASSES,
                          generator=torch.Generator().manual_seed(1), log=lambda ev: None)
    m.begin_task(ctx.task, ctx)
    return m, model, ctx


def _fill(m, width: int):
    g = torch.Generator().manual_seed(0)
    m.buffer.add(g, x=torch.randn(6, 3, generator=g), y=torch.tensor([0, 1, 0, 1, 0, 1]),
                 logits=torch.randn(6, width, generator=g), width=torch.full((6,), width))


@pytest.mark.parametrize("name", ["er", "der", "derpp"])
def test_mammoth_is_the_default_and_the_head_has_every_class_at_the_first_task(name):
    assert method_options_model(name)().head_convention == "mammoth"
    m, model, ctx = _method(name)
    assert model.head.num_classes == N_CLASSES and len(model.head.blocks) == 1  # not the task's 4
    later = SimpleNamespace(**{**vars(ctx), "task": SimpleNamespace(class_range=(4, 6), index=2, offset=4,
                                                                      n_classes=2)})
    m.begin_task(later.task, later)
    assert model.head.num_classes == N_CLASSES and len(model.head.blocks) == 1  # later tasks add nothing
    g, model_g, _ = _method(name, head_convention="grow")
    assert model_g.head.num_classes == 4  # the grown head: the classes up to the task's end


def test_er_is_mammoths_one_cross_entropy_over_every_output():
    m, model, ctx = _method("er")
    _fill(m, N_CLASSES)
    x, y = torch.randn(5, 3), torch.tensor([2, 3, 3, 2, 3])
    b = m.buffer.sample(3, replay_generator(7, 0, 1))
    # models/er.py lines 53-60: inputs and labels concatenated with the buffer batch, loss over all outputs
    want = F.cross_entropy(model(torch.cat([x, b["x"]])), torch.cat([y, b["y"]]))
    assert torch.allclose(m.loss(model, x, y, ctx), want, atol=1e-6)
    m.buffer = type(m.buffer)(6)  # the first step (empty buffer): the current batch alone, every output
    assert torch.allclose(m.loss(model, x, y, ctx), F.cross_entropy(model(x), y), atol=1e-6)


@pytest.mark.parametrize("name", ["der", "derpp"])
def test_der_is_mammoths_loss_over_every_output_and_stores_every_logit(name):
    m, model, ctx = _method(name)
    _fill(m, N_CLASSES)
    m.step = 5
    x, y = torch.randn(5, 3, generator=torch.Generator().manual_seed(9)), torch.tensor([2, 3, 3, 2, 3])
    got = m.loss(model, x, y, ctx)
    b1 = m.buffer.sample(3, replay_generator(7, 5, 1))
    # models/der.py lines 34-41; models/derpp.py lines 36-50
    want = F.cross_entropy(model(x), y) + m.options.alpha * F.mse_loss(model(b1["x"]), b1["logits"])
    if name == "derpp":
        b2 = m.buffer.sample(3, replay_generator(7, 5, 2))
        want = want + m.options.beta * F.cross_entropy(model(b2["x"]), b2["y"])
    assert torch.allclose(got, want, atol=1e-6)
    m, model, ctx = _method(name)  # an empty buffer: the step's five examples go to slots 0-4
    m.loss(model, x, y, ctx)
    m.after_step(model, ctx)  # models/der.py line 46: outputs.data, every class, stored after the step
    assert torch.equal(m.buffer.fields["logits"][:5], model(x).detach())
    assert m.buffer.fields["logits"].shape[1] == N_CLASSES and m.buffer.fields["width"][:5].eq(N_CLASSES).all()


@pytest.mark.parametrize("name", ["er", "der", "derpp"])
def test_head_loss_local_contradicts_mammoths_head_when_the_config_is_parsed(name):
    with pytest.raises(ConfigError, match="head.loss=local: method.head_convention=mammoth.*head_convention=grow"):
        parse_config(_sgd_cfg(name) | {"head": {"loss": "local"}})
    parse_config(_sgd_cfg(name, head_convention="grow") | {"head": {"loss": "local"}})  # grow: the user's loss


def test_head_loss_local_in_a_hand_built_context_is_refused_at_the_first_task():
    with pytest.raises(ConfigError, match="head.loss=local.*head_convention=grow"):
        m = build_method("er", method_options_model("er")(buffer_size=6), seed=0)
        m.setup(ContinualClassifier(nn.Linear(3, 3), IncrementalHead(3)))
        ctx = SimpleNamespace(task=SimpleNamespace(class_range=(0, 2), index=0, offset=0, n_classes=2),
                              head_loss="local", n_outputs=4, generator=torch.Generator().manual_seed(0))
        m.begin_task(ctx.task, ctx)


def _sgd_cfg(method: str, **options) -> dict:
    """Two class-incremental digits tasks of 5 classes on a small MLP, with Mammoth's optimizer (SGD)."""
    return {
        "scenario": {"dataset": "digits", "n_tasks": 2, "train_per_class": 40, "test_per_class": 10},
        "model": {"name": "mlp", "config": {"image_size": 8, "hidden": [32]}},
        "method": {"name": method, "buffer_size": 30, "minibatch_size": 8, **options},
        "optim": {"name": "sgd", "lr": 5e-2}, "train": {"epochs": 2, "batch_size": 20},
        "run": {"progress": False, "report": False, "keep_checkpoints": 2},
    }


@pytest.mark.parametrize("method", ["der", "derpp"])
def test_a_digits_run_stores_pushed_down_logits_of_the_classes_not_seen_yet(tmp_path, method):
    full = run_experiment(parse_config(_sgd_cfg(method)), tmp_path / "run")
    model_state, tensors, meta = load_checkpoint(tmp_path / "run" / "checkpoints" / "task_000.safetensors")
    assert meta["structure"]["modules"]["head"]["blocks"] == [N_CLASSES]  # the full head after task 1
    z = tensors["buffer/logits"]
    assert z.shape == (30, N_CLASSES) and tensors["buffer/width"].eq(N_CLASSES).all()
    # the cross-entropy over all outputs pushed the logits of classes 5-9 (task 2's) down before they were seen
    assert z[:, 5:].mean() < 0 < z[:, :5].max(1).values.mean()
    assert full["accuracy_matrix"][0][0] > 50


def test_evaluation_takes_the_argmax_over_the_classes_seen_so_far():
    """utils/evaluate.py lines 54 and 88: a class not seen yet cannot be predicted, however large its logit."""
    head = IncrementalHead(2)
    head.grow(4)
    with torch.no_grad():
        head.blocks[0].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]]))
        head.blocks[0].bias.copy_(torch.tensor([0.0, 0.0, 100.0, 100.0]))  # classes 2, 3: not seen yet
    model = ContinualClassifier(nn.Identity(), head)
    x, y = torch.tensor([[2.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 1])
    task = SimpleNamespace(index=0, class_range=(0, 2), test=_Data(x, y))
    res = evaluate_tasks(model, [task], n_outputs=2)  # the engine's n_out: the end of the current task
    assert res[0]["acc"] == 100.0
    assert evaluate_tasks(model, [task], n_outputs=4)[0]["acc"] == 0.0  # unmasked, the unseen classes win


class _Data:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def batches(self, batch_size):
        yield self.x, self.y


@pytest.mark.parametrize("method", ["er", "der", "derpp"])
def test_a_mammoth_head_run_resumes_bit_for_bit(tmp_path, method):
    data = _sgd_cfg(method)
    full = run_experiment(parse_config(data), tmp_path / "full")
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    (tmp_path / "resumed" / "metrics.json").unlink()
    uncommit_checkpoint(tmp_path / "resumed", "task_001.safetensors")  # killed after task 1
    resumed = run_experiment(parse_config(data), tmp_path / "resumed", resume=True)
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    assert resumed["method_metrics"] == full["method_metrics"]
    a = load_checkpoint(tmp_path / "full" / "checkpoints" / "task_001.safetensors")
    b = load_checkpoint(tmp_path / "resumed" / "checkpoints" / "task_001.safetensors")
    assert a[2]["structure"]["modules"]["head"]["blocks"] == [N_CLASSES]
    for x, z in zip(a[:2], b[:2]):  # model and method tensors (the buffer)
        assert x.keys() == z.keys() and all(torch.equal(x[k], z[k]) for k in x)


@pytest.mark.parametrize("method", ["er", "der", "derpp"])
def test_grow_keeps_one_head_block_per_task(tmp_path, method):
    grow = run_experiment(parse_config(_sgd_cfg(method, head_convention="grow")), tmp_path / "grow")
    _, _, meta = load_checkpoint(tmp_path / "grow" / "checkpoints" / "task_001.safetensors")
    assert meta["structure"]["modules"]["head"]["blocks"] == [5, 5]  # one block per task
    assert grow["accuracy_matrix"][0][0] > 50
