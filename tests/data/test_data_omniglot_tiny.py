"""``omniglot`` (rotation protocol) and ``tinyimagenet`` (release layout) on generated look-alike files."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from data_helpers import make_omniglot, make_tiny

from clmerge.data import build_dataset, build_scenario


# ------------------------------------------------------------------------------------------------ omniglot


def test_omniglot_rotated_copies_and_split(tmp_path):
    make_omniglot(tmp_path, {"Alpha": 2, "Beta": 1})
    make_omniglot(tmp_path, {"Gamma": 2}, subset="images_evaluation")
    sp = build_dataset("omniglot", data_root=tmp_path, image_size=12, n_classes=4, test_fraction=0.4)
    assert sp.class_names == ["images_background/Alpha/character01", "images_background/Alpha/character02",
                              "images_background/Beta/character01", "images_evaluation/Gamma/character01"]
    assert np.bincount(sp.train.targets).tolist() == [12] * 4 and np.bincount(sp.test.targets).tolist() == [8] * 4
    assert not set(sp.train.paths) & set(sp.test.paths)  # rotated copies of a test drawing stay in test
    x, y = sp.train.get_batch(np.arange(4))  # one drawing, rotated 0/90/180/270
    assert x.shape == (4, 1, 12, 12) and y.tolist() == [0, 0, 0, 0]
    assert float(x.max()) == 1.0 and float(x.mean()) < 0.1  # inverted: stroke 1, background 0
    for k in range(4):
        assert torch.equal(x[k], torch.rot90(x[0], k, dims=(1, 2)))
    again = build_dataset("omniglot", data_root=tmp_path, image_size=12, n_classes=4, test_fraction=0.4)
    assert again.test.paths == sp.test.paths  # deterministic split


def test_omniglot_protocol_100_tasks_of_12(tmp_path):
    make_omniglot(tmp_path, {f"A{i:02d}": 40 for i in range(30)}, drawings=2, size=8)
    sp = build_dataset("omniglot", data_root=tmp_path, image_size=8, test_fraction=0.5)
    sc = build_scenario(sp, kind="task_incremental", n_tasks=100, shuffle_classes=False)
    assert len(sc.tasks) == 100 and {t.n_classes for t in sc.tasks} == {12}
    assert len(sc.tasks[0].train) == 12 * 4 and sc.tasks[1].classes == list(range(12, 24))


def test_omniglot_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="images_background"):
        build_dataset("omniglot", data_root=tmp_path)
    make_omniglot(tmp_path, {"Alpha": 2})
    with pytest.raises(ValueError, match="only 2 characters"):
        build_dataset("omniglot", data_root=tmp_path)
    with pytest.raises(ValueError, match="multiples of 90"):
        build_dataset("omniglot", data_root=tmp_path, n_classes=2, rotations=[45])
    with pytest.raises(ValueError, match="unknown option"):
        build_dataset("omniglot", data_root=tmp_path, n_classes=2, colour=True)


# ------------------------------------------------------------------------------------------------ tiny


def test_tinyimagenet_release_layout(tmp_path):
    wnids = ["n02", "n01", "n03"]
    make_tiny(tmp_path, wnids)
    sp = build_dataset("tinyimagenet", data_root=tmp_path, image_size=64)
    assert sp.class_names == ["thing n01", "thing n02", "thing n03"]  # sorted wnids
    assert np.bincount(sp.train.targets).tolist() == [3, 3, 3] and np.bincount(sp.test.targets).tolist() == [2] * 3
    x, y = sp.test.get_batch(np.arange(len(sp.test)))
    assert x.shape[1:] == (3, 64, 64)
    # the val image of wnid k has value 10 * position-in-generation; its label is the sorted position
    for xi, yi in zip(x, y):
        assert round(float(xi[0, 0, 0]) * 255) == 10 * wnids.index(sorted(wnids)[int(yi)])
    direct = build_dataset("tinyimagenet", data_root=tmp_path / "tiny-imagenet-200", image_size=32)
    assert direct.train.get_batch([0])[0].shape == (1, 3, 32, 32)


def test_tinyimagenet_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tiny-imagenet-200"):
        build_dataset("tinyimagenet", data_root=tmp_path)
    folder = make_tiny(tmp_path, ["n01", "n02"])
    (folder / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn09\t0\t0\t1\t1\n")
    with pytest.raises(ValueError, match="unknown wnid"):
        build_dataset("tinyimagenet", data_root=tmp_path)
