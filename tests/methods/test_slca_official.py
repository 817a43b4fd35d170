"""SLCA's classifier alignment as the official code schedules it: the aligned head is discarded after each
evaluation (``head.align_keep: discard``, the default); ``persistent`` is the official InfLoRA-CA schedule.

The official rule, transcribed (GengDavid/SLCA at 169d4e6):

- ``trainer.py`` lines 54-57: per task ``incremental_train``, then ``eval_task``, then ``after_task``;
- ``models/slca.py`` line 107: ``self._network.fc.backup()`` (a deepcopy of the trained head's state,
  ``convs/linears.py`` lines 66-67) right after the slow learner has trained, before alignment;
- ``models/slca.py`` lines 111-113: the new classes' Gaussians are added (``_compute_class_mean``, lines
  198-208 keep the stored old ones), then ``_stage2_compact_classifier`` aligns the head from the second task on;
- ``models/slca.py`` line 79: ``after_task`` calls ``self._network.fc.recall()`` (``convs/linears.py`` lines
  69-70: ``load_state_dict`` of the backup): the aligned head is evaluated once and dropped, and the next
  task trains (old blocks frozen, ``convs/linears.py`` lines 88-90) and aligns from the unaligned head.

InfLoRA-CA (liangyanshuo/InfLoRA at e08b00e, ``methods/inflora_ca.py``): the backup is commented out (line 97)
and ``after_task`` (lines 68-70) restores nothing, so its aligned old blocks are kept and aligned again.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from clmerge.config import HeadConfig, load_config
from clmerge.engine.heads import HeadSuite, _generator
from clmerge.models.classifier import IncrementalHead
from clmerge.models.heads import ClassFeatureStats, align_linear_head

D, PER_TASK, SEED = 6, 2, 3


class _Data:
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def batches(self, batch_size: int):
        for i in range(0, len(self.y), batch_size):
            yield self.x[i:i + batch_size], self.y[i:i + batch_size]


class _Model(nn.Module):
    """A fixed linear 'backbone' and the model's own incremental head (what the slow learner trained)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(D, D)
        self.head = IncrementalHead(D)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _tasks(n: int) -> list:
    g = torch.Generator().manual_seed(0)
    tasks = []
    for t in range(n):
        ys = torch.arange(t * PER_TASK, (t + 1) * PER_TASK).repeat_interleave(30)
        xs = torch.randn(len(ys), D, generator=g) + 2.0 * torch.nn.functional.one_hot(ys % D, D).float()
        tasks.append(SimpleNamespace(index=t, offset=t * PER_TASK, n_classes=PER_TASK,
                                     class_range=(t * PER_TASK, (t + 1) * PER_TASK), train=_Data(xs, ys)))
    return tasks


def _train_new_block(model: _Model, t: int) -> None:
    """The slow learner's task t: a new block, trained (here: drawn); the old blocks stay as they were."""
    model.head.grow(PER_TASK, generator=torch.Generator().manual_seed(100 + t))
    with torch.no_grad():
        model.head.blocks[-1].weight.add_(torch.randn(PER_TASK, D, generator=torch.Generator().manual_seed(t)))


def _align(head: IncrementalHead, stats: ClassFeatureStats, seen: list, h: HeadConfig, t: int) -> None:
    align_linear_head(head, stats, [s.class_range for s in seen], epochs=h.align_epochs, lr=h.align_lr,
                      samples_per_class=h.align_samples, weight_decay=h.align_weight_decay,
                      logit_norm=h.align_logit_norm, mean_decay=h.align_mean_decay, generator=_generator(SEED, t, 1))


def _official(tasks: list, h: HeadConfig, *, recall: bool) -> list[dict]:
    """The transcription: the head evaluated after each task (``recall``: SLCA's backup / recall; without it:
    InfLoRA-CA, whose aligned head stays)."""
    torch.manual_seed(0)
    model = _Model()
    stats = ClassFeatureStats(D, cov=h.align_cov)
    fc = IncrementalHead(D)  # the official network's fc: the model's head
    evaluated = []
    for t, task in enumerate(tasks):
        _train_new_block(model, t)
        for b in list(model.head.blocks)[len(fc.blocks):]:
            fc.blocks.append(copy.deepcopy(b))  # update_fc + stage 1 trained the new block only
        backup = copy.deepcopy(fc.state_dict())  # slca.py:107 fc.backup()
        with torch.no_grad():
            stats.update(model.forward_features(task.train.x), task.train.y)  # slca.py:111
        if t > 0:  # slca.py:112-113
            _align(fc, stats, tasks[: t + 1], h, t)
        evaluated.append(copy.deepcopy(fc.state_dict()))  # trainer.py:56 eval_task
        if recall:
            fc.load_state_dict(backup)  # slca.py:79 after_task -> fc.recall()
    return evaluated


def _clmerge(tasks: list, h: HeadConfig) -> tuple[list[dict], list[dict]]:
    torch.manual_seed(0)
    model = _Model()
    suite = HeadSuite(h, seed=SEED, feature_dim=D)
    evaluated, model_heads = [], []
    for t, task in enumerate(tasks):
        _train_new_block(model, t)
        before = copy.deepcopy(model.head.state_dict())
        suite.end_task(model, task, tasks[: t + 1], batch_size=16, device=torch.device("cpu"))
        evaluated.append(copy.deepcopy(suite.aligned.state_dict()))
        model_heads.append((before, copy.deepcopy(model.head.state_dict())))
    return evaluated, model_heads


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(("keep", "recall"), [("discard", True), ("persistent", False)])
def test_the_aligned_head_follows_the_official_schedule(keep, recall):
    h = HeadConfig(align=True, align_keep=keep, align_epochs=2, align_samples=16)
    tasks = _tasks(4)
    got, model_heads = _clmerge(tasks, h)
    want = _official(tasks, h, recall=recall)
    assert all(_equal(g, w) for g, w in zip(got, want, strict=True))
    for before, after in model_heads:  # the model's own head is never touched: training sees the unaligned one
        assert _equal(before, after)


def test_the_two_schedules_differ_from_the_third_task_on():
    """Task 2 aligns the same copy either way (one alignment); from task 3 the persistent copy's old blocks
    have been aligned twice, the discarded one's once."""
    tasks = _tasks(4)
    cfg = dict(align=True, align_epochs=2, align_samples=16)
    discard, _ = _clmerge(tasks, HeadConfig(**cfg, align_keep="discard"))
    persistent, _ = _clmerge(tasks, HeadConfig(**cfg, align_keep="persistent"))
    assert [_equal(a, b) for a, b in zip(discard, persistent)] == [True, True, False, False]


def test_discard_is_the_default_for_every_method_and_persistent_an_option():
    assert load_config(None, ["method.name=slca"]).head.align_keep == "discard"
    assert load_config(None, ["method.name=inflora", "head.align=true"]).head.align_keep == "discard"
    assert load_config(None, ["method.name=slca", "head.align_keep=persistent"]).head.align_keep == "persistent"
    with pytest.raises(Exception, match="align_keep"):
        load_config(None, ["method.name=slca", "head.align_keep=sometimes"])
