"""Batches decoded in worker processes (``train.num_workers``), for sources that decode image files.

:meth:`~clmerge.data.scenarios.TaskData.batches` draws the order and cuts it into batches (and data-parallel
shares) in the calling process, exactly as without workers; this module only hands those index lists to a
torch ``DataLoader`` whose items are whole batches (``batch_size=None``), so the workers decode (and apply the
task's input transform) and the batches come back in the same order with the same values.

In-memory sources (``TensorData``) gain nothing from workers (a batch is an index-select) and keep the plain
path. Batches travel from the workers through shared memory (``/dev/shm``): in a container, give it room
(``docker run --shm-size``) for ``num_workers * 2`` batches of float images.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["PREFETCH_BATCHES", "file_sources", "load_in_workers", "pinning_available"]

# batches each worker prepares ahead: enough to hide one slow image, few enough to keep large evaluation
# batches (500 x 3 x 224 x 224 floats = 300 MB) from filling memory
PREFETCH_BATCHES = 2


def pinning_available() -> bool:
    """Page-locked memory needs CUDA; without it ``pin_memory`` is accepted and does nothing."""
    return torch.cuda.is_available()


def file_sources(source: Any) -> list:
    """The :class:`~clmerge.data.base.FileListData` sources behind ``source`` (itself, or a ``mixed`` source's parts)."""
    from .base import FileListData

    if isinstance(source, FileListData):
        return [source]
    return [s for part in getattr(source, "parts", []) for s in file_sources(part.source)]


@dataclass
class _Failure:
    """A data error raised in a worker, re-raised unchanged (same type, same one-line message) in the caller."""

    kind: type
    message: str


class _ShareDataset(Dataset):
    """Item ``k``: the ``k``-th batch (or data-parallel share) of ``data``, as ``TaskData.get_share`` loads it."""

    def __init__(self, data: Any, shares: list[tuple[np.ndarray, bool]]) -> None:
        self.data, self.shares = data, shares

    def __len__(self) -> int:
        return len(self.shares)

    def __getitem__(self, k: int):
        positions, empty = self.shares[k]
        try:
            return self.data.get_share(positions, empty)
        except (ValueError, OSError) as exc:  # a missing / corrupt file: the caller raises the same error
            return _Failure(type(exc), str(exc))


def load_in_workers(data: Any, shares: list[tuple[np.ndarray, bool]], *, num_workers: int,
                    pin_memory: bool) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``data.get_share(*share)`` for every share, in order, decoded by ``num_workers`` processes.

    Args:
        data: a ``TaskData`` (picklable; the workers call its ``get_share``).
        shares: ``(positions, empty)`` per batch, as ``TaskData`` cuts them.
        num_workers: worker processes (>= 1).
        pin_memory: page-locked batches when CUDA is available (a no-op otherwise).
    """
    loader = DataLoader(_ShareDataset(data, shares), batch_size=None, shuffle=False, num_workers=num_workers,
                        pin_memory=pin_memory and pinning_available(), prefetch_factor=PREFETCH_BATCHES,
                        persistent_workers=False)
    for item in loader:
        if isinstance(item, _Failure):
            raise item.kind(item.message)
        yield item
