"""Look-alike dataset files written by tests in several folders: IDX Fashion-MNIST, Omniglot, Tiny ImageNet."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
from PIL import Image


def write_idx(path, arr, compress):
    header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(struct.pack(">I", d) for d in arr.shape)
    data = header + arr.astype(np.uint8).tobytes()
    (gzip.open if compress else open)(path, "wb").write(data)


def make_fmnist(root, n_train=20, n_test=10, compress=True):
    d = root / "fashion-mnist"
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    sfx = ".gz" if compress else ""
    write_idx(d / f"train-images-idx3-ubyte{sfx}", rng.integers(0, 255, (n_train, 28, 28)), compress)
    write_idx(d / f"train-labels-idx1-ubyte{sfx}", np.arange(n_train) % 10, compress)
    write_idx(d / f"t10k-images-idx3-ubyte{sfx}", rng.integers(0, 255, (n_test, 28, 28)), compress)
    write_idx(d / f"t10k-labels-idx1-ubyte{sfx}", np.arange(n_test) % 10, compress)
    return d


def _png(path: Path, arr: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)


def make_omniglot(root: Path, alphabets: dict[str, int], drawings: int = 5, size: int = 12,
                  subset: str = "images_background") -> None:
    """White background, one black pixel at a drawing-specific place (so rotations are visible)."""
    for a, n_chars in alphabets.items():
        for c in range(n_chars):
            for d in range(drawings):
                arr = np.full((size, size), 255, np.uint8)
                arr[0, d] = 0
                _png(root / "omniglot" / subset / a / f"character{c + 1:02d}" / f"{c:04d}_{d:02d}.png", arr)


def make_tiny(root: Path, wnids: list[str], n_train: int = 3, n_val: int = 2, size: int = 64) -> Path:
    folder = root / "tiny-imagenet-200"
    for k, w in enumerate(wnids):
        for i in range(n_train):
            arr = np.full((size, size, 3), (10 * k + i) % 256, np.uint8)
            Image.fromarray(arr).save(_mk(folder / "train" / w / "images" / f"{w}_{i}.JPEG"))
    lines = []
    for k, w in enumerate(wnids):
        for i in range(n_val):
            name = f"val_{k * n_val + i}.JPEG"
            arr = np.full((size, size, 3), (10 * k) % 256, np.uint8)
            Image.fromarray(arr).save(_mk(folder / "val" / "images" / name))
            lines.append(f"{name}\t{w}\t0\t0\t{size - 1}\t{size - 1}")
    (folder / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    (folder / "wnids.txt").write_text("\n".join(reversed(wnids)) + "\n")
    (folder / "words.txt").write_text("\n".join(f"{w}\tthing {w}, other" for w in wnids) + "\n")
    return folder


def _mk(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
