"""``scenario.dataset: mixed``: tasks drawn from different sources with fixed transforms, keys stable across orders."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clmerge.config import parse_config
from clmerge.data import build_dataset, build_scenario
from clmerge.data.mixed import MixedTask, task_key
from clmerge.data.scenarios import Rotation
from clmerge.engine.orders import run_orders

TASKS = [
    {"dataset": "mnist5k", "train_per_class": 20, "test_per_class": 5},
    {"dataset": "digits", "train_per_class": 15, "test_per_class": 5},
    {"dataset": "mnist5k", "transform": "rotation", "degrees": 90, "train_per_class": 20, "test_per_class": 5},
    {"dataset": "digits", "transform": "invert", "classes": [0, 1, 2], "train_per_class": 15},
]


@pytest.fixture(scope="module")
def splits():
    return build_dataset("mixed", image_size=28, tasks=TASKS)


def test_groups_keys_and_global_labels(splits):
    keys = [k for k, _ in splits.task_groups]
    assert keys == ["mnist5k", "digits", "mnist5k+rotation(90)", "digits[0, 1, 2]+invert"]
    assert [g for _, g in splits.task_groups] == [list(range(10)), list(range(10, 20)), list(range(20, 30)),
                                                 [30, 31, 32]]
    assert np.bincount(splits.train.targets).tolist() == [20] * 10 + [15] * 10 + [20] * 10 + [15] * 3
    x, y = splits.train.get_batch(np.arange(0, len(splits.train), 37))
    assert x.shape[1:] == (1, 28, 28) and x.min() >= 0 and x.max() <= 1
    assert splits.class_names[10] == "digits/0" and len(splits.class_names) == 33


def test_transforms_are_applied_to_the_same_images(splits):
    tr = splits.train
    rot = tr.parts[2]
    src_x, _ = rot.source.get_batch(rot.indices[:3])
    start = int(tr.ends[1])
    assert torch.equal(tr.get_batch(np.arange(start, start + 3))[0], Rotation(90)(src_x.float()))
    inv = tr.parts[3]
    src_x, _ = inv.source.get_batch(inv.indices[:2])
    start = int(tr.ends[2])
    resized = torch.nn.functional.interpolate(src_x.float(), size=(28, 28), mode="bilinear", align_corners=False)
    assert torch.allclose(tr.get_batch([start, start + 1])[0], 1 - resized.clamp(0, 1), atol=1e-6)


def test_pad_fit_and_channels():
    sp = build_dataset("mixed", image_size=12, channels=3, tasks=[{"dataset": "digits", "fit": "pad"}])
    x, _ = sp.train.get_batch([0, 1])
    assert x.shape == (2, 3, 12, 12)
    assert x[..., :2, :].abs().sum() == 0 and x[..., :, -2:].abs().sum() == 0  # 8x8 centred in 12x12
    assert torch.equal(x[:, 0], x[:, 2])


def test_task_content_is_the_same_under_every_order(splits):
    a = build_scenario(splits, kind="task_incremental", n_tasks=4, val_fraction=0.2)
    b = build_scenario(splits, kind="task_incremental", n_tasks=4, val_fraction=0.2, task_order=[3, 1, 0, 2])
    assert [t.key for t in b.tasks] == [a.tasks[i].key for i in (3, 1, 0, 2)]
    for tb in b.tasks:
        ta = next(t for t in a.tasks if t.key == tb.key)
        assert np.array_equal(ta.train.indices, tb.train.indices) and np.array_equal(ta.test.indices, tb.test.indices)
        xa, ya = ta.test.get_batch(np.arange(len(ta.test)))
        xb, yb = tb.test.get_batch(np.arange(len(tb.test)))
        assert torch.equal(xa, xb) and torch.equal(ya - ta.offset, yb - tb.offset)
        assert (yb >= tb.offset).all() and (yb < tb.offset + tb.n_classes).all()
    # the subsample of a task does not depend on the other entries either
    alone = build_dataset("mixed", image_size=28, tasks=[TASKS[3]])
    assert np.array_equal(alone.train.parts[0].indices, splits.train.parts[3].indices)


def test_class_incremental_uses_disjoint_ids(splits):
    sc = build_scenario(splits, kind="class_incremental", n_tasks=4)
    assert [t.offset for t in sc.tasks] == [0, 10, 20, 30] and sc.num_outputs == 33


@pytest.mark.parametrize("kwargs,match", [
    ({"n_tasks": 3}, "defines 4 tasks"),
    ({"n_tasks": 4, "transform": "permutation"}, "transform none"),
    ({"n_tasks": 4, "classes_per_task": [10, 10, 10, 3]}, "do not apply"),
])
def test_scenario_conflicts(splits, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_scenario(splits, kind="task_incremental", **kwargs)


@pytest.mark.parametrize("tasks,match", [
    ([], "non-empty list"),
    ([{"dataset": "digits"}, {"dataset": "digits"}], "repeats the content key"),
    ([{"dataset": "digits", "degree": 3}], r"tasks\[0\]"),
    ([{"dataset": "digits", "classes": [0, 11]}], "not in the source"),
    ([{"dataset": "mixed"}], "cannot nest"),
])
def test_bad_task_entries(tasks, match):
    with pytest.raises(ValueError, match=match):
        build_dataset("mixed", tasks=tasks)


def test_default_keys():
    spec = MixedTask(dataset="x", transform="hflip")
    assert task_key(spec, [0, 1], [0, 1], "hflip") == "x+'hflip'"
    assert task_key(MixedTask(dataset="x", key="mine"), [0], [0, 1], None) == "mine"


def test_orders_sweep_on_a_mixed_sequence(tmp_path):
    tasks = [{"dataset": "digits", "train_per_class": 8, "test_per_class": 3},
             {"dataset": "digits", "transform": "rotation", "degrees": 90, "train_per_class": 8, "test_per_class": 3},
             {"dataset": "digits", "transform": "invert", "train_per_class": 8, "test_per_class": 3}]
    cfg = parse_config({
        "scenario": {"dataset": "mixed", "kind": "task_incremental", "n_tasks": 3, "val_fraction": 0.2,
                     "options": {"tasks": tasks}},
        "model": {"name": "mlp", "config": {"image_size": 28, "hidden": [16, 16]}},
        "method": {"name": "halrp", "prune": False}, "optim": {"lr": 1e-2},
        "train": {"epochs": 1, "batch_size": 32}, "run": {"progress": False, "report": False},
    })
    summary = run_orders(cfg, tmp_path, 2)
    assert set(summary["opd"]) == {"digits", "digits+rotation(90)", "digits+invert"}
    assert summary["orders"][0] == [0, 1, 2] and summary["bwt_per_order"] == [0.0, 0.0]
