"""``mixed``: a task sequence whose tasks come from different sources (Five-dataset style; HALRP App. F.1).

Config::

    scenario:
      dataset: mixed
      kind: task_incremental          # one head per task (class_incremental also works: class ids are disjoint)
      n_tasks: 5                      # must equal the number of entries below
      options:
        tasks:
          - {dataset: mnist5k}
          - {dataset: digits}
          - {dataset: fashion_mnist, train_per_class: 300}
          - {dataset: mnist5k, transform: rotation, degrees: 90}
          - {dataset: digits, transform: invert}

Each entry draws one task from its own registered source (built once per distinct source/options and shared):
``classes`` (a subset, default all), ``train_per_class`` / ``test_per_class`` (subsamples), a fixed input
``transform`` (``rotation`` by ``degrees``, ``invert``, ``hflip``, ``permutation`` with ``perm_seed``),
``options`` / ``data_root`` / ``source_image_size`` for the source itself and an optional ``key``.

Images of every task are brought to one shape: ``channels`` (default: the most among the sources; grey is
repeated, RGB averaged to grey) and ``image_size`` (default: the backbone's; else the largest source side), by
bilinear resizing (``fit: resize``) or zero padding around the centre (``fit: pad``, e.g. 28 -> 32 as the
Five-dataset code does for MNIST). The transform is applied last, on the common shape.

Task identity: ``key`` (default ``<dataset>[<classes>]+<transform>``) names the task by content, so it is the
same under every task order; subsamples are seeded by ``(split_seed or seed, crc32(key))`` and therefore do not
depend on the task's position either. The source returns :class:`~clmerge.data.base.DataSplits` with
``task_groups`` set, which :func:`~clmerge.data.scenarios.build_scenario` uses instead of cutting classes.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .base import ClassificationData, DataSplits, build_dataset, register_dataset
from .bundled import write_fashion_mnist_idx
from .lookalike import LookalikeSpec, png_pool, register_lookalike, write_presplit
from .scenarios import PixelPermutation, Rotation

__all__ = ["MixedTask", "MixedData", "Invert", "HFlip", "mixed", "task_key", "write_mixed_lookalike"]


class MixedTask(BaseModel):
    """One entry of ``scenario.options.tasks``."""

    model_config = ConfigDict(extra="forbid")
    dataset: str
    key: str | None = Field(None, description="content key (default <dataset>[<classes>]+<transform>)")
    classes: list[int] | None = Field(None, description="subset of the source's classes (default: all)")
    train_per_class: int | None = Field(None, ge=1)
    test_per_class: int | None = Field(None, ge=1)
    transform: Literal["none", "rotation", "invert", "hflip", "permutation"] = "none"
    degrees: float = Field(90.0, description="transform=rotation: angle")
    perm_seed: int = Field(0, description="transform=permutation: seed of the pixel permutation")
    fit: Literal["resize", "pad"] = Field("resize", description="how images reach the common size")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword options of the source")
    data_root: str | None = Field(None, description="the source's data root (default: scenario.data_root)")
    source_image_size: int | None = Field(None, ge=1, description="image_size passed to the source (folders)")


class Invert:
    """``1 - x`` (images are in [0, 1])."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return 1.0 - x

    def __repr__(self) -> str:
        return "invert"


class HFlip:
    """Mirror images left-right."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.flip(-1)

    def __repr__(self) -> str:
        return "hflip"


def _transform(spec: MixedTask, size: tuple[int, int]):
    if spec.transform == "rotation":
        return Rotation(spec.degrees)
    if spec.transform == "invert":
        return Invert()
    if spec.transform == "hflip":
        return HFlip()
    if spec.transform == "permutation":
        return PixelPermutation(spec.perm_seed, size[0] * size[1])
    return None


def task_key(spec: MixedTask, classes: list[int], all_classes: list[int], tf) -> str:
    """The content key of a task: its ``key`` if given, else dataset, class subset and transform."""
    if spec.key:
        return spec.key
    key = spec.dataset + ("" if classes == all_classes else f"{classes}")
    return key if tf is None else f"{key}+{tf!r}"


@dataclass
class _Part:
    """One task's slice of a source split, with what brings it to the common shape."""

    source: ClassificationData
    indices: np.ndarray
    label_map: np.ndarray  # source class id -> global class id (-1: unused)
    fit: str
    transform: Any


class MixedData(ClassificationData):
    """The concatenation of several task parts, all returned as ``(channels, *size)`` float images."""

    def __init__(self, parts: list[_Part], channels: int, size: tuple[int, int], *, name: str = "") -> None:
        self.parts = parts
        self.channels, self.size, self.name = channels, size, name
        self.ends = np.cumsum([len(p.indices) for p in parts])
        labels = [p.label_map[p.source.targets[p.indices]] for p in parts]
        self.targets = np.concatenate(labels).astype(np.int64) if labels else np.zeros(0, np.int64)

    @property
    def decodes_files(self) -> bool:
        return any(p.source.decodes_files for p in self.parts)

    def _prepare(self, part: _Part, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[1]
        if c != self.channels:
            if c == 1:
                x = x.expand(-1, self.channels, -1, -1)
            elif self.channels == 1:
                x = x.mean(1, keepdim=True)
            else:
                raise ValueError(f"{self.name}: cannot map {c} channels to {self.channels}")
        if tuple(x.shape[-2:]) != self.size:
            x = _fit(x, self.size, part.fit)
        return part.transform(x) if part.transform is not None else x

    def get_batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        which = np.searchsorted(self.ends, idx, side="right")
        out = torch.empty(len(idx), self.channels, *self.size)
        for p in np.unique(which):
            sel = np.flatnonzero(which == p)
            part = self.parts[int(p)]
            start = 0 if p == 0 else int(self.ends[p - 1])
            x, _ = part.source.get_batch(part.indices[idx[sel] - start])
            out[torch.as_tensor(sel)] = self._prepare(part, x.float())
        return out, torch.as_tensor(self.targets[idx], dtype=torch.long)


def _fit(x: torch.Tensor, size: tuple[int, int], how: str) -> torch.Tensor:
    """Resize (bilinear, antialiased when shrinking) or zero-pad around the centre (resize if too large)."""
    h, w = x.shape[-2:]
    if how == "pad" and h <= size[0] and w <= size[1]:
        top, left = (size[0] - h) // 2, (size[1] - w) // 2
        return F.pad(x, (left, size[1] - w - left, top, size[0] - h - top))
    shrink = h > size[0] or w > size[1]
    return F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=shrink).clamp_(0, 1)


def _parse_tasks(tasks: Any) -> list[MixedTask]:
    if not isinstance(tasks, list) or not tasks:
        raise ValueError("mixed: scenario.options.tasks must be a non-empty list of {dataset: ..., ...} entries")
    specs = []
    for i, entry in enumerate(tasks):
        if isinstance(entry, str):
            entry = {"dataset": entry}
        try:
            specs.append(MixedTask.model_validate(entry))
        except ValidationError as exc:
            msg = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"mixed: scenario.options.tasks[{i}]: {msg}") from None
        if specs[-1].dataset == "mixed":
            raise ValueError(f"mixed: scenario.options.tasks[{i}]: a mixed source cannot nest another")
    return specs


def _subsample(targets: np.ndarray, idx: np.ndarray, per_class: int | None, rng: np.random.Generator) -> np.ndarray:
    if per_class is None:
        return idx
    keep = [np.sort(m[rng.permutation(len(m))[:per_class]]) for c in np.unique(targets[idx])
            for m in [idx[targets[idx] == c]]]
    return np.sort(np.concatenate(keep)) if keep else idx


def _load_sources(specs: list[MixedTask], data_root, seed: int) -> list[DataSplits]:
    """Build every distinct (dataset, root, options, image size) once."""
    cache: dict[str, DataSplits] = {}
    out = []
    for spec in specs:
        root = spec.data_root if spec.data_root is not None else data_root
        ck = json.dumps([spec.dataset, root, spec.options, spec.source_image_size], sort_keys=True, default=str)
        if ck not in cache:
            cache[ck] = build_dataset(spec.dataset, data_root=root, image_size=spec.source_image_size, seed=seed,
                                      **spec.options)
        out.append(cache[ck])
    return out


def _common_shape(sources: list[DataSplits], channels: int | None, image_size: int | None) -> tuple[int, tuple]:
    shapes = [tuple(s.train.get_batch(np.asarray([0]))[0].shape[1:]) for s in sources]
    c = channels if channels is not None else max(sh[0] for sh in shapes)
    size = (image_size, image_size) if image_size else (max(sh[1] for sh in shapes), max(sh[2] for sh in shapes))
    return int(c), (int(size[0]), int(size[1]))


def _task_classes(spec: MixedTask, src: DataSplits, i: int) -> tuple[list[int], list[int]]:
    all_classes = sorted(set(np.unique(src.train.targets).tolist()))
    classes = list(spec.classes) if spec.classes is not None else all_classes
    unknown = sorted(set(classes) - set(all_classes))
    if unknown or len(set(classes)) != len(classes) or not classes:
        raise ValueError(f"mixed: tasks[{i}] ({spec.dataset}): classes {classes} are empty, repeated or not in the "
                         f"source (it has {all_classes[:20]}{' ...' if len(all_classes) > 20 else ''}); "
                         f"bad: {unknown}")
    return classes, all_classes


@register_dataset("mixed", "one task per entry of options.tasks, each from its own source/transform (Five-dataset style)")
def mixed(*, data_root: str | None = None, image_size: int | None = None, seed: int = 0, tasks: Any = None,
          channels: int | None = None, split_seed: int | None = None, **options: Any) -> DataSplits:
    """Build the mixed source; see the module docstring.

    Args:
        data_root: default root for the sources (each entry may override it).
        image_size: common side of all images (the engine passes the backbone's); ``None``: largest source side.
        seed: seed passed to the sources and (unless ``split_seed``) of the per-task subsamples.
        tasks: the task entries (:class:`MixedTask` fields).
        channels: common channel count (default: the most among the sources).
        split_seed: seed of the per-task subsamples, to keep them fixed across scenario seeds.
        **options: rejected (``ValueError``).

    Returns:
        Splits over global class ids (task i owns a consecutive block) with ``task_groups`` set.
    """
    if options:
        raise ValueError(f"mixed: unknown option(s) {sorted(options)}; accepted: tasks, channels, split_seed")
    specs = _parse_tasks(tasks)
    sources = _load_sources(specs, data_root, seed)
    c, size = _common_shape(sources, channels, image_size)
    base_seed = seed if split_seed is None else split_seed
    parts: dict[str, list[_Part]] = {"train": [], "test": []}
    groups: list[tuple[str, list[int]]] = []
    names: list[str] = []
    info: list[dict] = []
    offset = 0
    for i, (spec, src) in enumerate(zip(specs, sources)):
        classes, all_classes = _task_classes(spec, src, i)
        tf = _transform(spec, size)
        key = task_key(spec, classes, all_classes, tf)
        if key in [g[0] for g in groups]:
            raise ValueError(f"mixed: tasks[{i}] repeats the content key {key!r}; give it a distinct `key:`")
        rng = np.random.default_rng([int(base_seed) % 2**32, zlib.crc32(key.encode())])
        n_map = max(int(src.train.targets.max()), int(src.test.targets.max())) + 1
        label_map = np.full(n_map, -1, dtype=np.int64)
        label_map[classes] = offset + np.arange(len(classes))
        for split, per in (("train", spec.train_per_class), ("test", spec.test_per_class)):
            data = getattr(src, split)
            idx = np.flatnonzero(np.isin(data.targets, classes))
            parts[split].append(_Part(data, _subsample(data.targets, idx, per, rng), label_map, spec.fit, tf))
        src_names = src.class_names or [str(k) for k in range(n_map)]
        names += [f"{key}/{src_names[k] if k < len(src_names) else k}" for k in classes]
        groups.append((key, list(range(offset, offset + len(classes)))))
        info.append({"key": key, "dataset": spec.dataset, "classes": classes,
                     "n_train": len(parts["train"][-1].indices), "n_test": len(parts["test"][-1].indices),
                     "source": src.fingerprint})
        offset += len(classes)
    return DataSplits(
        train=MixedData(parts["train"], c, size, name="mixed/train"),
        test=MixedData(parts["test"], c, size, name="mixed/test"),
        class_names=names, task_groups=groups,
        fingerprint={"source": "mixed", "channels": c, "size": list(size), "split_seed": base_seed, "tasks": info},
    )


@register_lookalike("mixed")
def write_mixed_lookalike(root: Path, spec: LookalikeSpec) -> None:
    """Per-task look-alikes of ``options.tasks``: class folders for ``image_folder`` entries (10 classes),
    IDX files for ``fashion_mnist``; bundled sources need nothing."""
    for entry in spec.options.get("tasks", []):
        ds, opts = entry.get("dataset"), entry.get("options", {}) or {}
        if ds == "image_folder":
            sub = opts.get("subdir")
            names = [f"class_{c}" for c in range(10)]
            write_presplit(root / sub if sub else root, names, spec.n_train, spec.n_test, png_pool())
        elif ds == "fashion_mnist":
            write_fashion_mnist_idx(root, spec.n_train, spec.n_test)
