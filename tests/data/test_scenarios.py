import numpy as np
import pytest
import torch

from clmerge.data import TensorData, build_dataset, build_scenario
from clmerge.data.base import DataSplits


def toy_splits(n_classes=6, per_class=10, size=4):
    g = torch.Generator().manual_seed(0)
    def make(n):
        y = np.repeat(np.arange(n_classes), n)
        return TensorData(torch.rand(len(y), 1, size, size, generator=g), y)
    return DataSplits(train=make(per_class), test=make(per_class // 2))


def test_class_incremental_disjoint_complete_deterministic():
    s = toy_splits()
    a = build_scenario(s, kind="class_incremental", n_tasks=3, seed=5)
    b = build_scenario(s, kind="class_incremental", n_tasks=3, seed=5)
    c = build_scenario(s, kind="class_incremental", n_tasks=3, seed=6)
    groups = [t.classes for t in a.tasks]
    assert groups == [t.classes for t in b.tasks]
    assert sorted(sum(groups, [])) == list(range(6))  # complete and disjoint
    assert a.class_order != c.class_order or groups != [t.classes for t in c.tasks]
    # train/test indices cover each class exactly once across tasks
    all_train = np.concatenate([t.train.indices for t in a.tasks])
    assert len(all_train) == len(set(all_train.tolist())) == len(s.train)
    # labels are mapped into each task's head range
    for t in a.tasks:
        _, y = t.train.get_batch(np.arange(len(t.train)))
        lo, hi = t.class_range
        assert y.min() >= lo and y.max() < hi
    assert [t.offset for t in a.tasks] == [0, 2, 4]


def test_uneven_and_explicit_order():
    s = toy_splits()
    sc = build_scenario(s, kind="class_incremental", n_tasks=2, class_order=[5, 4, 3, 2, 1, 0], classes_per_task=[4, 2])
    assert [t.classes for t in sc.tasks] == [[5, 4, 3, 2], [1, 0]]
    assert sc.class_order == [5, 4, 3, 2, 1, 0]
    with pytest.raises(ValueError, match="do not split evenly"):
        build_scenario(s, kind="class_incremental", n_tasks=4)
    with pytest.raises(ValueError, match="class_order"):
        build_scenario(s, kind="class_incremental", n_tasks=2, class_order=[0, 0, 1, 2, 3, 4])


def test_sorted_order_when_not_shuffled():
    sc = build_scenario(toy_splits(), kind="task_incremental", n_tasks=3, shuffle_classes=False)
    assert [t.classes for t in sc.tasks] == [[0, 1], [2, 3], [4, 5]]


def test_domain_incremental_permutation_and_rotation():
    s = toy_splits()
    sc = build_scenario(s, kind="domain_incremental", n_tasks=3, transform="permutation", seed=1)
    assert all(t.class_range == (0, 6) for t in sc.tasks)
    x0, y0 = sc.tasks[0].test.get_batch(np.arange(4))
    x1, y1 = sc.tasks[1].test.get_batch(np.arange(4))
    assert torch.equal(y0, y1)
    assert not torch.equal(x0, x1)
    assert torch.equal(x0.flatten(1).sort(1).values, x1.flatten(1).sort(1).values)  # same pixels, permuted
    assert len({t.key for t in sc.tasks}) == 3
    rot = build_scenario(s, kind="domain_incremental", n_tasks=2, transform="rotation", rotations=[0, 90])
    xa, _ = rot.tasks[0].test.get_batch(np.arange(2))
    xb, _ = rot.tasks[1].test.get_batch(np.arange(2))
    assert torch.allclose(xa, x0[:2]) and not torch.allclose(xb, xa)


def test_task_incremental_permuted_has_own_heads():
    sc = build_scenario(toy_splits(), kind="task_incremental", n_tasks=2, transform="permutation")
    assert [t.class_range for t in sc.tasks] == [(0, 6), (6, 12)]


def test_val_split_and_subsampling():
    sc = build_scenario(toy_splits(), kind="class_incremental", n_tasks=3, val_fraction=0.25, train_per_class=8)
    for t in sc.tasks:
        assert len(t.train) + len(t.val) == 16
        assert not set(t.train.indices.tolist()) & set(t.val.indices.tolist())


def test_bundled_sources():
    d = build_dataset("digits")
    assert d.train.get_batch([0, 1])[0].shape == (2, 1, 8, 8)
    assert len(d.train) + len(d.test) == 1797
    assert not set(d.train.targets.tolist()) ^ set(range(10))
    m = build_dataset("mnist5k")
    x, y = m.test.get_batch(np.arange(3))
    assert x.shape == (3, 1, 28, 28) and 0.0 <= x.min() and x.max() <= 1.0
    assert len(m.train) == 4000 and len(m.test) == 1000
    assert np.bincount(m.test.targets).tolist() == [100] * 10  # stratified
    again = build_dataset("mnist5k")
    assert np.array_equal(again.test.targets, m.test.targets)


def test_mnist1d_generated_offline():
    d = build_dataset("mnist1d", num_samples=200)
    x, _ = d.train.get_batch([0])
    assert x.shape == (1, 1, 1, 40)


def test_unknown_dataset_suggests():
    with pytest.raises(ValueError, match="did you mean 'mnist5k'"):
        build_dataset("mnist5")


# PILOT's (and PyCIL's) class order for seed 1993 on 100 classes, as its DataManager logs it and as the
# iCaRL-order tables of other CIL code bases list it (transcribed, not computed here)
PILOT_ORDER_100_SEED_1993 = [
    68, 56, 78, 8, 23, 84, 90, 65, 74, 76, 40, 89, 3, 92, 55, 9, 26, 80, 43, 38, 58, 70, 77, 1, 85, 19, 17, 50,
    28, 53, 13, 81, 45, 82, 6, 59, 83, 16, 15, 44, 91, 41, 72, 60, 79, 52, 20, 10, 31, 54, 37, 95, 14, 71, 96,
    98, 97, 2, 64, 66, 42, 22, 35, 86, 24, 34, 87, 21, 99, 0, 88, 27, 18, 94, 11, 12, 47, 25, 30, 46, 62, 69,
    36, 61, 7, 63, 75, 5, 32, 4, 51, 48, 73, 93, 39, 67, 29, 49, 57, 33,
]


def test_legacy_seed_class_order_is_pilots():
    from clmerge.data.scenarios import class_order_from_seed

    assert class_order_from_seed(list(range(100)), 1993, rng="legacy_seed") == PILOT_ORDER_100_SEED_1993
    assert class_order_from_seed(list(range(100)), 1993) != PILOT_ORDER_100_SEED_1993  # the default differs
    with pytest.raises(ValueError, match="class_order_rng"):
        class_order_from_seed([0, 1], 0, rng="torch")


def test_legacy_seed_scenario_tasks_follow_pilots_order():
    """B0-Inc10 on 100 classes: task k holds PILOT's classes order[10k:10k+10], mapped to outputs in that order."""
    sc = build_scenario(toy_splits(n_classes=100, per_class=2, size=2), kind="class_incremental", n_tasks=10,
                        seed=1993, class_order_rng="legacy_seed")
    assert sc.class_order == PILOT_ORDER_100_SEED_1993
    assert [t.classes for t in sc.tasks] == [PILOT_ORDER_100_SEED_1993[10 * k: 10 * k + 10] for k in range(10)]
    task = sc.tasks[3]
    x, y = task.train.get_batch(np.arange(len(task.train)))
    raw = np.repeat(np.arange(100), 2)[task.train.indices]
    assert [task.offset + task.classes.index(int(c)) for c in raw] == y.tolist()
