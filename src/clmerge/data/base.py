"""The data interface every source implements, and the registry of sources.

A *source* is a labelled image collection with a train and a test split (optionally a class-name list).
Items are ``(image, label)`` with ``image`` a float tensor ``(C, H, W)`` in ``[0, 1]`` and ``label`` the
source's original class id. Sources never normalise: the backbone does (see ``models.backbones``).

Two implementations cover everything:
- :class:`TensorData`: images held in memory (MNIST-5k, digits, Fashion-MNIST, MNIST-1D, CIFAR-100);
- :class:`FileListData`: a list of image files decoded with PIL on access (ImageNet-R/A, DomainNet, CUB, folders).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ..registry import Registry

__all__ = [
    "ClassificationData",
    "TensorData",
    "FileListData",
    "DataSplits",
    "register_dataset",
    "check_source_options",
    "build_dataset",
    "available_datasets",
    "DATASETS",
    "DatasetEntry",
]


class ClassificationData(ABC):
    """Base class: ``targets`` (N,) int64 numpy array and ``get_batch(indices) -> (x, y)``."""

    targets: np.ndarray
    # whether get_batch decodes files (worth worker processes; see TaskData.batches); in-memory sources: False
    decodes_files: bool = False

    def __len__(self) -> int:
        return len(self.targets)

    @abstractmethod
    def get_batch(self, indices: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Images (B, C, H, W) in [0, 1] and original labels (B,) for the given item indices."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x, y = self.get_batch(np.asarray([i]))
        return x[0], int(y[0])

    @property
    def num_classes(self) -> int:
        return int(self.targets.max()) + 1 if len(self.targets) else 0


class TensorData(ClassificationData):
    """In-memory images. ``images`` is uint8 (0-255) or float in [0, 1], shape (N, C, H, W)."""

    def __init__(self, images: torch.Tensor, targets: np.ndarray | torch.Tensor, *, name: str = "") -> None:
        if images.dim() != 4:
            raise ValueError(f"{name or 'TensorData'}: images must be (N, C, H, W), got {tuple(images.shape)}")
        targets = np.asarray(targets, dtype=np.int64)
        if len(targets) != images.shape[0]:
            raise ValueError(f"{name or 'TensorData'}: {images.shape[0]} images but {len(targets)} labels")
        self.images = images
        self.targets = targets
        self.name = name

    def get_batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        x = self.images.index_select(0, idx)
        x = x.float().div_(255.0) if x.dtype == torch.uint8 else x.float()
        return x, torch.as_tensor(self.targets[idx.numpy()], dtype=torch.long)


class FileListData(ClassificationData):
    """Images read from files with PIL, converted to RGB (or L) and resized to ``image_size`` on access.

    Each image stays uint8 until the batch is stacked; the batch is then converted to float once.

    Args:
        paths: image files.
        targets: class id per file.
        image_size: square side after resizing (shorter side to ``image_size * 256 / 224``, then a centre crop,
            the standard ViT test transform); ``None`` keeps the original size (all images must match).
        mode: PIL mode, ``"RGB"`` or ``"L"``.
        fast_jpeg: let the JPEG decoder scale down while decoding (PIL ``draft``: 1/2, 1/4 or 1/8 of the stored
            size, never below the size the resize step needs). Much faster for JPEGs at least twice the resized
            size; the pixels differ slightly from the exact path (a DCT-domain downscale before the bicubic
            resize; see ``docs/data_loading.md`` for the measured difference). Other formats are unaffected.
    """

    decodes_files = True

    def __init__(self, paths: list[Path], targets, *, image_size: int | None = 224, mode: str = "RGB", name: str = "",
                 fast_jpeg: bool = False) -> None:
        from ..utils.extras import require_extra

        require_extra("PIL.Image", what=f"dataset {name or 'of image files'}")  # before any training starts
        self.paths = [Path(p) for p in paths]
        self.targets = np.asarray(targets, dtype=np.int64)
        if len(self.paths) != len(self.targets):
            raise ValueError(f"{name}: {len(self.paths)} files but {len(self.targets)} labels")
        self.image_size = image_size
        self.mode = mode
        self.name = name
        self.fast_jpeg = fast_jpeg

    def load_uint8(self, i: int) -> torch.Tensor:
        """Image ``i`` as uint8 ``(C, H, W)``; a missing or undecodable file raises an error naming it."""
        from PIL import Image, UnidentifiedImageError

        path = self.paths[i]
        try:
            with Image.open(path) as im:
                if self.fast_jpeg and self.image_size is not None and im.format == "JPEG":
                    im.draft(self.mode, _resized_size(im.size, self.image_size))
                if im.mode != self.mode:  # converting to the same mode would only copy
                    im = im.convert(self.mode)
                if self.image_size is not None:
                    im = _resize_center_crop(im, self.image_size)
                arr = np.array(im, dtype=np.uint8)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{self.name}: image file missing: {path}") from exc
        except (UnidentifiedImageError, OSError) as exc:
            raise ValueError(f"{self.name}: cannot decode image {path} ({exc})") from exc
        t = torch.from_numpy(arr)
        return t.unsqueeze(0) if t.dim() == 2 else t.permute(2, 0, 1)

    def load(self, i: int) -> torch.Tensor:
        """Image ``i`` as float ``(C, H, W)`` in [0, 1]."""
        return self.load_uint8(i).float().div_(255.0)

    def get_batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        idx = np.asarray(indices)
        x = torch.stack([self.load_uint8(int(i)) for i in idx])
        return x.float().div_(255.0), torch.as_tensor(self.targets[idx], dtype=torch.long)


def _resized_size(size: tuple[int, int], crop: int) -> tuple[int, int]:
    """The (width, height) :func:`_resize_center_crop` resizes an image of ``size`` to before cropping."""
    w, h = size
    scale = round(crop * 256 / 224) / min(w, h)
    return max(crop, round(w * scale)), max(crop, round(h * scale))


def _resize_center_crop(im, size: int):
    from PIL import Image

    im = im.resize(_resized_size(im.size, size), Image.BICUBIC)
    w, h = im.size
    left, top = (w - size) // 2, (h - size) // 2
    return im.crop((left, top, left + size, top + size))


@dataclass
class DataSplits:
    """What a source builder returns."""

    train: ClassificationData
    test: ClassificationData
    class_names: list[str] = field(default_factory=list)
    fingerprint: dict = field(default_factory=dict)  # file names / hashes for the run manifest
    # a source that defines its own tasks (``mixed``): (content key, class ids) per task, in order;
    # build_scenario then uses these groups instead of cutting the class order
    task_groups: list[tuple[str, list[int]]] | None = None

    @property
    def num_classes(self) -> int:
        return max(self.train.num_classes, self.test.num_classes)


class DatasetEntry(NamedTuple):
    """A registered dataset: its builder and one-line description (indexable as ``(fn, description)``)."""

    fn: Callable[..., DataSplits]
    description: str


DATASETS: Registry = Registry("dataset", key="scenario.dataset")  # name -> DatasetEntry


def register_dataset(name: str, description: str) -> Callable:
    """Register ``fn(*, data_root, image_size, seed, **options) -> DataSplits`` under ``name``."""

    def deco(fn):
        DATASETS.register(name, DatasetEntry(fn, description), description=description, module=fn.__module__)
        return fn

    return deco


def available_datasets() -> dict[str, str]:
    return DATASETS.available()


def build_dataset(name: str, **kwargs) -> DataSplits:
    fn = DATASETS.get(name).fn
    return fn(**_typed_options(name, fn, kwargs))


def check_source_options(name: str, keys) -> None:
    """Refuse ``scenario.options`` keys that the data source ``name`` does not take. Builders accept ``**_`` so
    that the engine can pass its generic arguments (``data_root``, ``image_size``, ``seed``) to every source;
    a user's misspelt option would vanish there, so the user's keys are checked against the named
    parameters (a builder whose ``**kwargs`` has another name than ``_`` uses them, and is not checked)."""
    import inspect

    from ..errors import UsageError, clip

    fn = DATASETS.get(name).fn
    sig = inspect.signature(fn).parameters.values()
    if any(p.kind == p.VAR_KEYWORD and p.name != "_" for p in sig):
        return  # a builder that uses its **kwargs (a plugin's, say) judges them itself
    params = [p.name for p in sig if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    for key in keys:
        if key not in params:
            valid = ", ".join(params) or "(none)"
            raise UsageError(f"unknown data option {clip(repr(f'scenario.options.{key}'), 80)} for dataset "
                             f"{name!r}; it takes: {clip(valid, 300)}")


def _plain_data(value: object) -> bool:
    """Whether ``value`` is what a YAML file or ``--set`` gives: None, bool, number, str, list or dict of them."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, list):
        return all(_plain_data(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain_data(v) for k, v in value.items())
    return False


def _typed_options(name: str, fn: Callable, kwargs: dict) -> dict:
    """``kwargs`` checked against the builder's annotated parameters (a data option of the wrong type, e.g.
    ``subdir: 5`` where a folder name is expected, is a ``UsageError`` naming the option, not a ``TypeError``
    deep inside the builder); values come back as validated (``"0.2"`` -> ``0.2``). Parameters without a
    usable annotation, and values that are not plain YAML data, pass unchecked."""
    import inspect
    import typing

    from pydantic import TypeAdapter, ValidationError

    from ..errors import UsageError, clip

    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001  (an annotation that does not resolve: nothing to check against)
        return kwargs
    params = inspect.signature(fn).parameters
    out = dict(kwargs)
    for key, value in kwargs.items():
        if key not in params or key not in hints or not _plain_data(value):
            continue  # Python callers' own objects (a Path, an array) are the builder's to judge
        try:
            out[key] = TypeAdapter(hints[key]).validate_python(value)
        except ValidationError as exc:
            msg = exc.errors()[0]["msg"]
            raise UsageError(f"{name}: data option {clip(key, 60)!r}: {msg} "
                             f"(got {clip(repr(value), 60)})") from None
        except Exception:  # noqa: BLE001  (a type pydantic has no schema for: left to the builder)
            continue
    return out
