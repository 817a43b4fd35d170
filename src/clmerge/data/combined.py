"""Combined sources: ``mnist5k_fmnist20``, MNIST-5k digits (classes 0-9) plus a Fashion-MNIST subset of the same
size (classes 10-19), for class-incremental sequences of 10 tasks (a longer benchmark than Split-MNIST-5k).

The Fashion-MNIST part is a deterministic stratified subset: ``per_class`` training and ``per_class_test``
test images per class, the first ones in file order (no randomness), so the two halves have the same size and
split ratio as mnist5k (400 / 100 per class by default).
"""

from __future__ import annotations

import numpy as np
import torch

from .base import DataSplits, TensorData, build_dataset, register_dataset

__all__ = ["mnist5k_fmnist20", "first_per_class"]


def first_per_class(targets: np.ndarray, n: int) -> np.ndarray:
    """Indices of the first ``n`` samples of every class, in file order (sorted)."""
    keep = [np.flatnonzero(targets == c)[:n] for c in np.unique(targets)]
    return np.sort(np.concatenate(keep))


def _as_uint8(images: torch.Tensor) -> torch.Tensor:
    if images.dtype == torch.uint8:
        return images
    return (images.clamp(0, 1) * 255).round().to(torch.uint8)


@register_dataset("mnist5k_fmnist20", "MNIST-5k digits (classes 0-9) + an equal-size Fashion-MNIST subset "
                  "(classes 10-19); 20 classes, 28x28")
def mnist5k_fmnist20(*, data_root: str | None = None, split_seed: int = 0, per_class: int = 400,
                     per_class_test: int = 100, **_) -> DataSplits:
    """MNIST-5k (its fixed 80/20 split) followed by ``per_class`` / ``per_class_test`` Fashion-MNIST images.

    Args:
        data_root: where the Fashion-MNIST IDX files are (see the ``fashion_mnist`` source).
        split_seed: mnist5k's split seed.
        per_class, per_class_test: Fashion-MNIST training / test images per class.
    """
    m = build_dataset("mnist5k", split_seed=split_seed)
    f = build_dataset("fashion_mnist", data_root=data_root)
    parts = {}
    for split in ("train", "test"):
        a, b = getattr(m, split), getattr(f, split)
        idx = first_per_class(np.asarray(b.targets), per_class if split == "train" else per_class_test)
        xb, yb = b.get_batch(idx)
        xa, ya = a.get_batch(np.arange(len(a)))
        images = torch.cat([_as_uint8(xa), _as_uint8(xb)])
        targets = np.concatenate([ya.numpy(), yb.numpy() + 10]).astype(np.int64)
        parts[split] = TensorData(images, targets, name=f"mnist5k_fmnist20/{split}")
    names = [str(i) for i in range(10)] + [f"fmnist:{n}" for n in f.class_names]
    fp = {"mnist5k": m.fingerprint, "fashion_mnist": f.fingerprint, "per_class": per_class,
          "per_class_test": per_class_test}
    return DataSplits(train=parts["train"], test=parts["test"], class_names=names, fingerprint=fp)
