"""Order robustness (HALRP, Li et al., TKDE 2024, Sec. 5.3, Eq. 14): OPD/MOPD/AOPD, task orders, content keys
across orders."""

from __future__ import annotations

import pytest

from clmerge.config import ConfigError, parse_config
from clmerge.data import build_dataset
from clmerge.data.scenarios import build_scenario
from clmerge.engine.orders import summarize_orders, task_orders
from clmerge.metrics import order_robustness


def test_opd_mopd_aopd_hand_computed():
    finals = [{"a": 90.0, "b": 80.0, "c": 70.0}, {"a": 85.0, "b": 82.0, "c": 70.0}, {"a": 88.0, "b": 74.0, "c": 71.0}]
    res = order_robustness(finals)
    assert res["opd"] == {"a": 5.0, "b": 8.0, "c": 1.0}  # max_r - min_r per task
    assert res["mopd"] == 8.0
    assert res["aopd"] == pytest.approx(14.0 / 3)


def test_summary_matches_tasks_by_content_key():
    m0 = {"accuracy_matrix": [[90.0, None], [88.0, 70.0]], "task_keys": ["x", "y"], "acc": 79.0, "bwt": -2.0,
          "method": "m", "dataset": "d", "accuracy_curve": [90.0, 79.0]}
    m1 = {"accuracy_matrix": [[75.0, None], [72.0, 80.0]], "task_keys": ["y", "x"], "acc": 76.0, "bwt": -3.0,
          "method": "m", "dataset": "d", "accuracy_curve": [75.0, 76.0]}
    s = summarize_orders([m0, m1], [[0, 1], [1, 0]])
    assert s["opd"] == {"x": 8.0, "y": 2.0}  # x: 88 vs 80; y: 70 vs 72
    assert s["mopd"] == 8.0 and s["aopd"] == 5.0 and s["acc"] == 77.5 and s["bwt"] == -2.5


def test_task_orders_listed_then_seeded():
    cfg = parse_config({"scenario": {"n_tasks": 5, "task_orders": [[4, 3, 2, 1, 0]]}, "method": {"name": "finetune"}})
    orders = task_orders(cfg, 3)
    assert orders[0] == [4, 3, 2, 1, 0] and sorted(orders[2]) == list(range(5))
    assert len({tuple(o) for o in task_orders(cfg, 6)}) == 6  # always distinct
    plain = parse_config({"scenario": {"n_tasks": 5}, "method": {"name": "finetune"}})
    assert task_orders(plain, 2)[0] == [0, 1, 2, 3, 4]
    with pytest.raises(ConfigError, match="task_order"):
        parse_config({"scenario": {"n_tasks": 3, "task_order": [0, 0, 1]}})


@pytest.mark.parametrize("transform", ["none", "permutation"])
def test_reordered_tasks_keep_their_content(transform):
    splits = build_dataset("digits")
    kw = dict(kind="task_incremental", n_tasks=3, seed=1, transform=transform, val_fraction=0.1,
              classes_per_task=[3, 3, 3] if transform == "none" else None, train_per_task=100)
    ref = build_scenario(splits, **kw)
    new = build_scenario(splits, **kw, task_order=[2, 0, 1])
    assert [t.key for t in new.tasks] == [ref.tasks[k].key for k in (2, 0, 1)]
    assert [t.offset for t in new.tasks] == [0, ref.tasks[2].n_classes, ref.tasks[2].n_classes + ref.tasks[0].n_classes]
    for t, old in zip(new.tasks, (ref.tasks[2], ref.tasks[0], ref.tasks[1])):
        assert (t.train.indices == old.train.indices).all() and (t.val.indices == old.val.indices).all()
        x_new, y_new = t.test.get_batch(range(5))
        x_old, y_old = old.test.get_batch(range(5))
        assert (x_new == x_old).all() and ((y_new - t.offset) == (y_old - old.offset)).all()
