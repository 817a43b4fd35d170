"""clmerge/configs/paper halrp_{omniglot,five_dataset,tiny}: the real configs build their scenario and network on look-alike
data (generated files with the release layouts; random-init networks) and a batch of the first and last task
goes through the routed model."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from clmerge.config import load_config
from clmerge.engine.run import prepare
from clmerge.paper_configs import PAPER_DIR

from data_helpers import make_omniglot, make_tiny

PAPER = PAPER_DIR


def _idx(path: Path, arr: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    code = {1: 1, 3: 3}[arr.ndim]
    path.write_bytes(bytes([0, 0, 8, code]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.astype(np.uint8).tobytes())


def make_five_dataset(root: Path, n: int = 2) -> None:
    rng = np.random.default_rng(0)
    for name, size, mode in (("cifar10", 32, "RGB"), ("mnist", 28, "L"), ("svhn", 32, "RGB"), ("notmnist", 28, "L")):
        for split in ("train", "test"):
            for c in range(10):
                for i in range(n):
                    shape = (size, size, 3) if mode == "RGB" else (size, size)
                    p = root / "five_dataset" / name / split / f"class_{c}" / f"{i}.png"
                    p.parent.mkdir(parents=True, exist_ok=True)
                    Image.fromarray(rng.integers(0, 255, shape, dtype=np.uint8)).save(p)
    for prefix, m in (("train", 3 * 10), ("t10k", 10)):
        _idx(root / "fashion-mnist" / f"{prefix}-images-idx3-ubyte", rng.integers(0, 255, (m, 28, 28)))
        _idx(root / "fashion-mnist" / f"{prefix}-labels-idx1-ubyte", np.arange(m) % 10)


def _check(cfg, n_tasks: int, n_classes: int, shape: tuple[int, ...]) -> None:
    scenario, model, method, _ = prepare(cfg)
    assert len(scenario) == n_tasks and {t.n_classes for t in scenario.tasks} == {n_classes}
    assert len({t.key for t in scenario.tasks}) == n_tasks
    model.eval()
    for task in (scenario.tasks[0], scenario.tasks[-1]):
        x, y = task.train.get_batch(np.arange(2))
        assert x.shape[1:] == shape and (y >= task.offset).all() and (y < task.offset + n_classes).all()
        assert torch.isfinite(model.backbone(x)).all()


def _load(name: str, root: Path):
    return load_config(PAPER / name, [f"scenario.data_root={root}", "run.device=cpu"])


def test_omniglot_rotation_config(tmp_path):
    make_omniglot(tmp_path, {f"A{i:02d}": 40 for i in range(30)}, drawings=2, size=8)
    cfg = _load("halrp_omniglot_rotation_lenet.yaml", tmp_path)
    assert cfg.method.options()["alpha"] == 0.99 and cfg.train.batch_size == 16 and cfg.optim.lr == 5e-3
    _check(cfg, 100, 12, (1, 28, 28))


@pytest.mark.parametrize("name", ["halrp_five_dataset_alexnet.yaml", "halrp_five_dataset_resnet18_reduced.yaml"])
def test_five_dataset_configs(tmp_path, name):
    make_five_dataset(tmp_path)
    cfg = _load(name, tmp_path)
    scenario, *_ = prepare(cfg)
    assert [t.key for t in scenario.tasks] == ["cifar10", "mnist", "svhn", "fashion_mnist", "notmnist"]
    _check(cfg, 5, 10, (3, 32, 32))


@pytest.mark.parametrize("name,n_tasks,n_classes", [("halrp_tiny20_alexnet.yaml", 20, 10),
                                                    ("halrp_tiny40_resnet18_reduced.yaml", 40, 5)])
def test_tiny_configs(tmp_path, name, n_tasks, n_classes):
    make_tiny(tmp_path, [f"n{k:08d}" for k in range(200)], n_train=2, n_val=1, size=64)
    _check(_load(name, tmp_path), n_tasks, n_classes, (3, 64, 64))
