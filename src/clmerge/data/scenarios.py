"""Scenarios: how a labelled source is cut into a sequence of tasks.

Every task owns a range of head outputs ``[offset, offset + n_classes)`` and its labels are mapped into it:
- class-incremental: disjoint class groups; ranges are consecutive; inference is over all seen classes;
- task-incremental: like class-incremental (or, with a per-task input transform, all classes in every task),
  but each task's range is its own head and evaluation masks to it (the task id is known);
- domain-incremental: every task has all classes and one shared range; tasks differ by a fixed input transform
  (a pixel permutation or a rotation).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import UsageError
from .base import ClassificationData, DataSplits
from .loading import file_sources, load_in_workers, pinning_available

__all__ = [
    "TaskData",
    "Task",
    "Scenario",
    "PixelPermutation",
    "Rotation",
    "class_order_from_seed",
    "split_classes",
    "class_group_key",
    "task_label",
    "task_name",
    "build_scenario",
    "reorder_tasks",
    "configure_loading",
]


class PixelPermutation:
    """A fixed permutation of pixel positions (the same for every channel), drawn from ``seed``."""

    def __init__(self, seed: int, num_pixels: int) -> None:
        self.seed = seed
        g = torch.Generator().manual_seed(int(seed))
        self.perm = torch.randperm(num_pixels, generator=g)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        if h * w != len(self.perm):
            raise ValueError(f"permutation is for {len(self.perm)} pixels, images have {h * w}")
        return x.reshape(b, c, h * w)[:, :, self.perm].reshape(b, c, h, w)

    def __repr__(self) -> str:
        return f"permutation(seed={self.seed})"


class Rotation:
    """Rotate images by a fixed angle (degrees) about their centre, bilinear, zero fill."""

    def __init__(self, degrees: float) -> None:
        self.degrees = float(degrees)
        t = np.deg2rad(self.degrees)
        self.theta = torch.tensor([[np.cos(t), -np.sin(t), 0.0], [np.sin(t), np.cos(t), 0.0]], dtype=torch.float32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.degrees % 360 == 0:
            return x
        grid = F.affine_grid(self.theta.expand(x.shape[0], 2, 3), list(x.shape), align_corners=False)
        return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)

    def __repr__(self) -> str:
        return f"rotation({self.degrees:g})"


@dataclass
class TaskData:
    """A view of a source: selected indices, labels mapped to head outputs, optional input transform."""

    source: ClassificationData
    indices: np.ndarray
    label_map: np.ndarray  # original class id -> head output index (-1: not in this task)
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    num_workers: int = 0  # processes that decode batches (sources that decode files only; see batches)
    pin_memory: bool = False  # page-locked batches; needs CUDA (a no-op without it)

    def __len__(self) -> int:
        return len(self.indices)

    def get_batch(self, positions) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.source.get_batch(self.indices[np.asarray(positions)])
        if self.transform is not None:
            x = self.transform(x)
        return x, torch.as_tensor(self.label_map[y.numpy()], dtype=torch.long)

    def get_share(self, positions: np.ndarray, empty: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`get_batch`, or for an empty data-parallel share a batch of the right shape with no rows."""
        x, y = self.get_batch(positions)
        return (x[:0], y[:0]) if empty else (x, y)

    def batches(self, batch_size: int, *, shuffle: bool = False, generator: torch.Generator | None = None,
                max_batches: int | None = None,
                part: tuple[int, int] | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches of ``batch_size`` in a (seeded) random or the stored order.

        ``part=(rank, world)``: only this process's contiguous share of each batch (``np.array_split`` of the
        batch's positions into ``world`` parts; possibly empty when the batch is smaller than ``world``), so
        that a data-parallel process loads and decodes only its own images. Every process draws the same
        order from the same ``generator``.

        With ``num_workers > 0`` and a source that decodes files, worker processes decode the batches (see
        :mod:`clmerge.data.loading`); the order is still drawn here, so the batches are the same tensors in the
        same order. In-memory sources ignore ``num_workers``.
        """
        n = len(self)
        order = torch.randperm(n, generator=generator).numpy() if shuffle else np.arange(n)
        shares = _batch_shares(order, batch_size, max_batches, part)
        if self.num_workers > 0 and self.source.decodes_files and shares:
            yield from load_in_workers(self, shares, num_workers=self.num_workers, pin_memory=self.pin_memory)
            return
        pin = self.pin_memory and pinning_available()
        for positions, empty in shares:
            x, y = self.get_share(positions, empty)
            yield (x.pin_memory(), y.pin_memory()) if pin else (x, y)

    def batch_sizes(self, batch_size: int, max_batches: int | None = None) -> list[int]:
        """The size of every batch :meth:`batches` yields (the whole batch, not a ``part``)."""
        n = len(self)
        sizes = [min(batch_size, n - s) for s in range(0, n, batch_size)]
        return sizes if max_batches is None else sizes[:max_batches]

    def num_batches(self, batch_size: int) -> int:
        return (len(self) + batch_size - 1) // batch_size


def _batch_shares(order: np.ndarray, batch_size: int, max_batches: int | None,
                  part: tuple[int, int] | None) -> list[tuple[np.ndarray, bool]]:
    """``(positions, empty)`` per batch of ``order``: the whole batch, or this process's share of it (an empty
    share keeps the batch's first position, loaded only for the shape)."""
    shares = []
    for k, start in enumerate(range(0, len(order), batch_size)):
        if max_batches is not None and k >= max_batches:
            break
        idx = order[start : start + batch_size]
        if part is not None:
            mine = np.array_split(idx, part[1])[part[0]]
            shares.append((mine, False) if len(mine) else (idx[:1], True))
        else:
            shares.append((idx, False))
    return shares


def configure_loading(scenario: Scenario, *, num_workers: int = 0, pin_memory: bool = False,
                      fast_jpeg: bool | None = None) -> None:
    """Set how every task's train, val and test data are loaded (in place).

    Args:
        scenario: the built scenario.
        num_workers: ``train.num_workers``, worker processes that decode batches of on-disk sources (0: decode
            in this process; in-memory sources always do).
        pin_memory: ``train.pin_memory``, page-locked batches for faster copies to a GPU (a no-op without CUDA).
        fast_jpeg: ``None`` leaves the sources as built; ``True`` / ``False`` switches reduced-size JPEG decoding
            (:class:`~clmerge.data.base.FileListData`'s ``fast_jpeg``) on every on-disk source of the scenario.
    """
    if num_workers < 0:
        raise ValueError(f"train.num_workers must be >= 0, got {num_workers}")
    for task in scenario.tasks:
        for data in (task.train, task.val, task.test):
            if data is None:
                continue
            data.num_workers, data.pin_memory = int(num_workers), bool(pin_memory)
            if fast_jpeg is not None:
                for source in file_sources(data.source):
                    source.fast_jpeg = bool(fast_jpeg)


@dataclass
class Task:
    index: int
    name: str
    key: str  # identity by content (class group / transform), stable across task orders
    classes: list[int]  # original class ids
    offset: int  # first head output of this task
    n_classes: int
    train: TaskData
    test: TaskData
    val: TaskData | None = None

    @property
    def class_range(self) -> tuple[int, int]:
        return self.offset, self.offset + self.n_classes

    @property
    def label(self) -> str:
        return task_label(self.key, self.classes)

    def describe(self) -> dict:
        return {"index": self.index, "name": self.name, "key": self.key, "classes": self.classes,
                "offset": self.offset, "n_classes": self.n_classes, "n_train": len(self.train),
                "n_val": len(self.val) if self.val is not None else 0, "n_test": len(self.test)}


@dataclass
class Scenario:
    kind: str
    tasks: list[Task]
    class_order: list[int]
    class_names: list[str] = field(default_factory=list)

    @property
    def num_outputs(self) -> int:
        return max(t.offset + t.n_classes for t in self.tasks)

    def __len__(self) -> int:
        return len(self.tasks)


def class_group_key(classes: list[int]) -> str:
    """The content key of a class group: its classes sorted, so the same group has one key in any order."""
    return f"classes{sorted(map(int, classes))}"


def task_label(key: str, classes: list[int]) -> str:
    """What a task is, for people: its classes in head-output order (as the ``classes`` field lists them) when
    its key is the class-group key, else the key itself (a transform, a source-defined name).

    The key sorts the classes so that it identifies the group in any order (order-robustness matches tasks by
    key); the label keeps the order so that a task's name agrees with its ``classes``.
    """
    return f"classes{[int(c) for c in classes]}" if key == class_group_key(classes) else key


def task_name(index: int, key: str, classes: list[int]) -> str:
    """The one place a task's display name is built: its position, then :func:`task_label`."""
    return f"task {index}: {task_label(key, classes)}"


def class_order_from_seed(classes: list[int], seed: int, shuffle: bool = True,
                          rng: str = "default_rng") -> list[int]:
    """The sorted ``classes`` permuted by ``seed``: numpy's ``default_rng`` (``rng="default_rng"``), or the legacy
    global-state generator (``"legacy_seed"``: ``np.random.seed(seed); np.random.permutation(n)``, which is how
    PILOT's and PyCIL's DataManager order the class indices, so the same seed gives their order)."""
    classes = sorted(classes)
    if not shuffle:
        return classes
    if rng == "legacy_seed":
        perm = np.random.RandomState(seed).permutation(len(classes))  # same stream as np.random.seed(seed)
    elif rng == "default_rng":
        perm = np.random.default_rng(seed).permutation(len(classes))
    else:
        raise ValueError(f"scenario.class_order_rng: expected default_rng or legacy_seed, got {rng!r}")
    return [classes[i] for i in perm]


def split_classes(order: list[int], n_tasks: int, classes_per_task: list[int] | None = None) -> list[list[int]]:
    """Cut ``order`` into task groups: equal groups, or the given (possibly uneven) sizes."""
    if classes_per_task is None:
        if n_tasks > len(order):  # refused before any group is built, however large n_tasks is
            raise UsageError(f"scenario.n_tasks={n_tasks}: {len(order)} classes cannot make {n_tasks} tasks (at "
                             f"most {len(order)}, one class per task)")
        if len(order) % n_tasks:
            raise UsageError(f"scenario.n_tasks={n_tasks}: {len(order)} classes do not split evenly into {n_tasks} "
                             "tasks; set scenario.classes_per_task")
        classes_per_task = [len(order) // n_tasks] * n_tasks
    if any(c < 1 for c in classes_per_task) or sum(classes_per_task) > len(order):
        raise ValueError(f"scenario.classes_per_task {classes_per_task} does not fit {len(order)} classes")
    groups, start = [], 0
    for c in classes_per_task:
        groups.append(list(order[start : start + c]))
        start += c
    return groups


def _subsample(targets: np.ndarray, idx: np.ndarray, per_class: int | None, rng: np.random.Generator) -> np.ndarray:
    if per_class is None:
        return idx
    keep = []
    for c in np.unique(targets[idx]):
        members = idx[targets[idx] == c]
        keep.append(np.sort(members[rng.permutation(len(members))[:per_class]]))
    return np.sort(np.concatenate(keep)) if keep else idx


def _val_split(idx: np.ndarray, frac: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray | None]:
    if frac <= 0:
        return idx, None
    perm = rng.permutation(len(idx))
    n_val = max(1, int(round(frac * len(idx))))
    return np.sort(idx[perm[n_val:]]), np.sort(idx[perm[:n_val]])


def _transforms(kind: str, n_tasks: int, seed: int, shape: tuple[int, ...], rotations, permute_first: bool):
    if kind == "none":
        return [None] * n_tasks
    if kind == "permutation":
        npix = int(np.prod(shape[-2:]))
        return [None if (t == 0 and not permute_first) else PixelPermutation(seed * 1000 + t, npix) for t in range(n_tasks)]
    angles = rotations if rotations is not None else [180.0 * t / n_tasks for t in range(n_tasks)]
    return [Rotation(a) for a in angles]


def build_scenario(splits: DataSplits, *, kind: str, n_tasks: int, seed: int = 0, shuffle_classes: bool = True,
                   class_order_rng: str = "default_rng", class_order: list[int] | None = None,
                   classes_per_task: list[int] | None = None,
                   transform: str = "none", rotations: list[float] | None = None, permute_first_task: bool = False,
                   train_per_class: int | None = None, test_per_class: int | None = None,
                   train_per_task: int | None = None, val_fraction: float = 0.0,
                   task_order: list[int] | None = None) -> Scenario:
    """Cut ``splits`` into tasks. Deterministic in ``seed``; see the module docstring for the kinds.

    ``task_order`` presents the tasks in another order (a permutation of 0..n_tasks-1 over the tasks as built):
    every task keeps its content (classes, transform, samples, ``key``); only positions and offsets change.
    """
    rng = np.random.default_rng(seed)
    ytr, yte = splits.train.targets, splits.test.targets
    all_classes = sorted(set(np.unique(ytr).tolist()))
    if class_order is not None:
        unknown = sorted(set(class_order) - set(all_classes))
        if unknown or len(set(class_order)) != len(class_order):
            raise ValueError(f"scenario.class_order: unknown or repeated classes {unknown or class_order}")
    order = (list(class_order) if class_order is not None
             else class_order_from_seed(all_classes, seed, shuffle_classes, class_order_rng))
    tr_all = _subsample(ytr, np.arange(len(ytr)), train_per_class, rng)
    te_all = _subsample(yte, np.arange(len(yte)), test_per_class, rng)
    preset_keys = None
    if splits.task_groups is not None:  # the source defines its tasks (data/mixed.py)
        groups, preset_keys = _preset_groups(splits.task_groups, kind=kind, n_tasks=n_tasks, transform=transform,
                                             class_order=class_order, classes_per_task=classes_per_task)
        order, tfs = [c for g in groups for c in g], [None] * n_tasks
    elif kind == "class_incremental" or (kind == "task_incremental" and transform == "none"):
        groups = split_classes(order, n_tasks, classes_per_task)
        tfs = [None] * n_tasks
    else:
        groups = [order] * n_tasks
        shape = tuple(splits.train.get_batch(np.asarray([0]))[0].shape)
        tfs = _transforms(transform, n_tasks, seed, shape, rotations, permute_first_task)
    tasks, offset = [], 0
    max_label = max(all_classes + [int(yte.max()) if len(yte) else 0]) + 1
    for t, (group, tf) in enumerate(zip(groups, tfs)):
        label_map = np.full(max_label, -1, dtype=np.int64)
        task_offset = 0 if kind == "domain_incremental" else offset
        label_map[group] = task_offset + np.arange(len(group))
        tr = tr_all[np.isin(ytr[tr_all], group)]
        if train_per_task is not None and len(tr) > train_per_task:
            tr = np.sort(tr[rng.permutation(len(tr))[:train_per_task]])
        tr, va = _val_split(tr, val_fraction, rng)
        te = te_all[np.isin(yte[te_all], group)]
        if preset_keys is not None:
            key = preset_keys[t]
        elif tf is not None:
            key = repr(tf)
        elif transform != "none" and kind != "class_incremental":
            key = "identity"
        else:
            key = class_group_key(group)
        tasks.append(Task(
            index=t, name=task_name(t, key, group), key=key, classes=list(map(int, group)), offset=task_offset,
            n_classes=len(group), train=TaskData(splits.train, tr, label_map, tf),
            test=TaskData(splits.test, te, label_map, tf),
            val=TaskData(splits.train, va, label_map, tf) if va is not None else None,
        ))
        offset += len(group)
    if task_order is not None:
        tasks = reorder_tasks(tasks, task_order, kind)
        if groups[0] is not order:  # disjoint class groups: the class order follows the task order
            order = [c for t in tasks for c in t.classes]
    return Scenario(kind=kind, tasks=tasks, class_order=list(map(int, order)), class_names=list(splits.class_names))


def _preset_groups(preset: list[tuple[str, list[int]]], *, kind: str, n_tasks: int, transform: str,
                   class_order: list[int] | None, classes_per_task: list[int] | None) -> tuple[list, list[str]]:
    """Check a source's own task groups against the scenario settings; return (groups, keys)."""
    if len(preset) != n_tasks:
        raise ValueError(f"scenario.n_tasks is {n_tasks} but the data source defines {len(preset)} tasks")
    if kind == "domain_incremental" or transform != "none":
        raise ValueError("a source that defines its own tasks (e.g. mixed) needs scenario.kind task_incremental or "
                         "class_incremental and scenario.transform none (put transforms on its task entries)")
    if class_order is not None or classes_per_task is not None:
        raise ValueError("scenario.class_order / classes_per_task do not apply to a source that defines its own "
                         "tasks (e.g. mixed); select classes per task entry instead")
    return [list(map(int, g)) for _, g in preset], [str(k) for k, _ in preset]


def _shift_labels(data: TaskData | None, shift: int) -> TaskData | None:
    if data is None or shift == 0:
        return data
    label_map = data.label_map.copy()
    label_map[label_map >= 0] += shift
    return replace(data, label_map=label_map)


def reorder_tasks(tasks: list[Task], order: list[int], kind: str) -> list[Task]:
    """Present ``tasks`` in ``order`` (a permutation of their positions), re-assigning indices and head offsets."""
    if sorted(order) != list(range(len(tasks))):
        raise ValueError(f"scenario.task_order {order} is not a permutation of 0..{len(tasks) - 1}")
    out, offset = [], 0
    for new_index, old in enumerate(order):
        t = tasks[old]
        new_offset = 0 if kind == "domain_incremental" else offset
        shift = new_offset - t.offset
        out.append(replace(t, index=new_index, name=task_name(new_index, t.key, t.classes), offset=new_offset,
                           train=_shift_labels(t.train, shift), test=_shift_labels(t.test, shift),
                           val=_shift_labels(t.val, shift)))
        offset += t.n_classes
    return out
