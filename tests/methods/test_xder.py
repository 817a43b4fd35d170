"""``xder``: Mammoth's X-DER rules transcribed (without its SimCLR terms), the end-of-task buffer, and resume.

The reference is aimagelab/mammoth at e75a491, ``models/xder.py``:

- lines 132-144, ``update_logits(old, new, gt, task_start, n_tasks)``: the columns of the heads from
  ``task_start`` on are taken from ``new``; a row whose max there exceeds its ground-truth logit in ``old`` is
  scaled by ``gamma * gt / max``;
- lines 59-130, ``end_task``: from the second task the buffer keeps the first ``buffer_size // ((t+1) * cpt)``
  examples of each class (ascending labels, slot order); the free room goes to the task's classes in equal
  shares (the remainder to random classes), filled from the training stream in order, with the step's logits
  whose past heads are damped (line 98); then every past example's logits of the current and later heads are
  rewritten from the model (lines 111-126);
- lines 146-288, ``observe``: the present head's cross-entropy (line 154), alpha times the MSE of a buffer batch
  over every output (lines 159-172), beta times the cross-entropy of a second batch over the past heads
  (lines 175-181), duplicates of the two batches removed (lines 183-200), the online rewrite of drawn past
  examples with probability 1/(draws this task) (lines 202-213), and the future-heads margin constraint over
  the batch and the buffer examples (lines 257-271).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from clmerge.config import parse_config
from clmerge.engine.checkpoint import load_checkpoint
from clmerge.engine.run import run_experiment
from clmerge.methods import build_method, method_options_model
from clmerge.methods.rehearsal import replay_generator
from clmerge.methods.rehearsal_plus import xder_damp
from clmerge.models.classifier import ContinualClassifier, IncrementalHead

from _lora_cl_helpers import assert_same_checkpoint, resume_killed_copy

CPT, N_TASKS = 2, 3
N_CLASSES = CPT * N_TASKS


def _mammoth_update_logits(old, new, gt, task_start, n_tasks, gamma, cpt=CPT):
    """models/xder.py lines 132-144, written out."""
    old, new = old.clone(), new.clone()
    transplant = new[:, task_start * cpt:(task_start + n_tasks) * cpt]
    gt_values = old[torch.arange(len(gt)), gt]
    max_values = transplant.max(1).values
    coeff = gamma * gt_values / max_values
    coeff = coeff.unsqueeze(1).repeat(1, cpt * n_tasks)
    mask = (max_values > gt_values).unsqueeze(1).repeat(1, cpt * n_tasks)
    transplant[mask] *= coeff[mask]
    old[:, task_start * cpt:(task_start + n_tasks) * cpt] = transplant
    return old


def test_defaults_are_mammoths():
    o = method_options_model("xder")()
    assert (o.alpha, o.beta, o.gamma, o.constr_eta, o.constr_margin) == (0.3, 0.8, 0.85, 0.1, 0.3)
    assert (o.future_constraint, o.past_constraint, o.head_convention) == (True, False, "mammoth")


def test_the_damping_is_mammoths_update_logits():
    g = torch.Generator().manual_seed(0)
    old, new = torch.randn(8, N_CLASSES, generator=g), torch.randn(8, N_CLASSES, generator=g) * 3
    gt = torch.tensor([0, 1, 0, 1, 2, 3, 0, 1])
    for start, n in ((1, 2), (0, 1), (2, 1)):
        want = _mammoth_update_logits(old, new, gt, start, n, 0.85)
        assert torch.allclose(xder_damp(old, new, gt, start * CPT, (start + n) * CPT, 0.85), want)
    assert not torch.equal(xder_damp(old, new, gt, 2, 6, 0.85)[:, 2:], new[:, 2:])  # some rows were damped


class _Data:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def batches(self, batch_size, *, shuffle=False, generator=None):
        order = torch.randperm(len(self.y), generator=generator) if shuffle else torch.arange(len(self.y))
        for s in range(0, len(order), batch_size):
            yield self.x[order[s:s + batch_size]], self.y[order[s:s + batch_size]]


def _task(index, n=12):
    g = torch.Generator().manual_seed(100 + index)
    lo = index * CPT
    y = lo + torch.arange(n) % CPT
    return SimpleNamespace(index=index, class_range=(lo, lo + CPT), offset=lo, n_classes=CPT,
                           train=_Data(torch.randn(n, 3, generator=g), y))


def _setup(buffer_size=8, **opts):
    m = build_method("xder", method_options_model("xder")(buffer_size=buffer_size, minibatch_size=3, **opts),
                     seed=7)
    torch.manual_seed(0)
    model = ContinualClassifier(nn.Sequential(nn.Linear(3, 4), nn.Tanh()), IncrementalHead(4))
    m.setup(model)
    tasks = [_task(i) for i in range(N_TASKS)]
    return m, model, tasks


def _ctx(tasks, t):
    return SimpleNamespace(task=tasks[t], seen_tasks=tasks[: t + 1], head_loss="seen", batch_size=5,
                           n_outputs=N_CLASSES, n_tasks=N_TASKS, generator=torch.Generator().manual_seed(1),
                           log=lambda ev: None)


def test_end_task_fills_the_buffer_class_balanced_and_rewrites_the_past_examples():
    m, model, tasks = _setup()
    c0 = _ctx(tasks, 0)
    m.begin_task(tasks[0], c0)
    m.end_task(tasks[0], c0)
    f = m.buffer.fields
    assert len(m.buffer) == 8 and f["y"].bincount().tolist() == [4, 4]  # 8 // 2 per class (line 82)
    assert torch.allclose(f["logits"], model(f["x"]).detach(), atol=1e-6)  # the first task: undamped logits
    before = {k: v.clone() for k, v in f.items()}
    with torch.no_grad():
        model.backbone[0].weight.mul_(-2.0)  # the model changes during the second task
    c1 = _ctx(tasks, 1)
    m.begin_task(tasks[1], c1)
    m.end_task(tasks[1], c1)
    f = m.buffer.fields
    # lines 65-78: 8 // (2 * 2) = 2 first examples of classes 0 and 1 kept, in slot order
    keep = torch.cat([(before["y"] == c).nonzero().flatten()[:2] for c in (0, 1)])
    assert torch.equal(f["x"][:4], before["x"][keep]) and f["y"].tolist()[:4] == [0, 0, 1, 1]
    # lines 111-126: the kept past examples' heads from task 2 on rewritten from the current model, damped
    want_past = _mammoth_update_logits(before["logits"][keep], model(f["x"][:4]).detach(), f["y"][:4], 1, 2, 0.85)
    assert torch.allclose(f["logits"][:4], want_past, atol=1e-6)
    # lines 80-109: the free room (4) in equal shares to classes 2 and 3, logits with the past heads damped
    assert f["y"][4:].tolist().count(2) == 2 and f["y"][4:].tolist().count(3) == 2
    out = model(f["x"][4:]).detach()
    assert torch.allclose(f["logits"][4:], _mammoth_update_logits(out, out, f["y"][4:], 0, 1, 0.85), atol=1e-6)
    assert m.update_counter.eq(0).all()


def test_the_loss_is_mammoths_observe_without_the_simclr_terms():
    m, model, tasks = _setup(past_constraint=True)
    c0 = _ctx(tasks, 0)
    m.begin_task(tasks[0], c0)
    m.end_task(tasks[0], c0)
    c1 = _ctx(tasks, 1)
    m.begin_task(tasks[1], c1)
    with torch.no_grad():
        model.backbone[0].weight.mul_(-2.0)
    m.step = 3
    stored = m.buffer.fields["logits"].clone()
    x, y = torch.randn(5, 3, generator=torch.Generator().manual_seed(9)), torch.tensor([2, 3, 3, 2, 3])
    got = m.loss(model, x, y, c1)
    o = m.options
    out = model(x)
    i1 = torch.randperm(8, generator=replay_generator(7, 3, 1))[:3]
    i2 = torch.randperm(8, generator=replay_generator(7, 3, 2))[:3]
    bx, by = m.buffer.fields["x"], m.buffer.fields["y"]
    o1, o2 = model(bx[i1]), model(bx[i2])
    want = F.cross_entropy(out[:, 2:4], y - 2)  # line 154
    want = want + o.alpha * F.mse_loss(o1, stored[i1])  # lines 171-172
    want = want + o.beta * F.cross_entropy(o2[:, :2], by[i2])  # line 180
    idx = torch.cat([i1, i2])
    eyey = torch.eye(8)[idx]
    umask = (eyey * eyey.cumsum(0)).sum(1) < 2  # lines 192-193
    bo, bl = torch.cat([o1, o2])[umask], by[idx][umask]
    bad = torch.cat([out[:, 4:], bo[:, 4:]]).max(1)[0]  # lines 259-267
    good = torch.cat([out[:, 2:4], torch.stack(bo.split(CPT, 1), 1)[torch.arange(len(bl)), bl // CPT]]).max(1)[0]
    constr = bad + o.constr_margin - good
    if (constr > 0).any():
        want = want + o.constr_eta * constr[constr > 0].mean()
    chead = F.softmax(out[:, :4], 1)  # lines 275-286 (past_constraint on here)
    pc = chead[:, :2].max(1)[0].detach() + o.constr_margin - chead[:, 2:4].max(1)[0]
    if (pc > 0).any():
        want = want + o.constr_eta * pc[pc > 0].mean()
    assert torch.allclose(got, want, atol=1e-5)
    # lines 202-213: every drawn example is a past one and drawn once this task, so each is rewritten (1 * u < 1)
    slots = idx[umask]
    assert m.update_counter[slots].eq(1).all() and m.update_counter.sum() == len(slots)
    want_logits = _mammoth_update_logits(stored[slots], bo.detach(), bl, 1, 2, o.gamma)
    assert torch.allclose(m.buffer.fields["logits"][slots], want_logits, atol=1e-6)
    untouched = torch.ones(8, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(m.buffer.fields["logits"][untouched], stored[untouched])


def _cfg() -> dict:
    return {
        "scenario": {"dataset": "digits", "n_tasks": 5, "train_per_class": 30, "test_per_class": 10},
        "model": {"name": "mlp", "config": {"image_size": 8, "hidden": [32]}},
        "method": {"name": "xder", "buffer_size": 40, "minibatch_size": 8},
        "optim": {"name": "sgd", "lr": 5e-2}, "train": {"epochs": 2, "batch_size": 20},
        "run": {"progress": False, "report": False, "keep_checkpoints": 5},
    }


def test_a_digits_run_balances_its_buffer_and_resumes_bit_for_bit(tmp_path):
    data = _cfg()
    full = run_experiment(parse_config(data), tmp_path / "full")
    _, tensors, meta = load_checkpoint(tmp_path / "full" / "checkpoints" / "task_002.safetensors")
    assert tensors["buffer/y"].bincount().tolist() == [6] * 4 + [8] * 2  # 40 // 6 of each past class; 16 to 4, 5
    assert tensors["buffer/logits"].shape == (40, 10)
    resumed = resume_killed_copy(parse_config(data), tmp_path / "full", "task_004.safetensors")  # killed after task 4
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    assert resumed["method_metrics"] == full["method_metrics"]
    a, b = assert_same_checkpoint(tmp_path / "full", tmp_path / "resumed", "task_004.safetensors")


def test_a_buffer_larger_than_the_tasks_data_stays_partly_empty():
    m, model, tasks = _setup(buffer_size=30)  # 6 training examples per class: the quotas (15, then 9) not met
    for t in (0, 1):
        ctx = _ctx(tasks, t)
        m.begin_task(tasks[t], ctx)
        m.end_task(tasks[t], ctx)
    f = m.buffer.fields
    assert len(m.buffer) == 24 and f["y"][:24].bincount().tolist() == [6] * 4
    out = model(f["x"][:12]).detach()
    assert torch.allclose(f["logits"][:12, 2:], xder_damp(f["logits"][:12], out, f["y"][:12], 2, 6, 0.85)[:, 2:])
