"""The process's thread setting for merges (``clmerge merge --threads``), one place that sets and reads it.

``set_threads(n)``: ``n = 1`` runs everything in one thread; ``n >= 2`` gives torch ``n - 1`` intra-op
threads for the arithmetic and lets a merge read the next key and write the last one in threads of their
own (:func:`io_threads` says whether). The setting is process-wide, like ``torch.set_num_threads``.
"""

from __future__ import annotations

import os

__all__ = ["default_threads", "io_threads", "set_threads"]

_IO_THREADS = {"on": False}


def set_threads(n: int) -> None:
    """Use ``n`` threads (values below 1 count as 1): ``n - 1`` compute, and with ``n >= 2`` one reads ahead
    and one writes behind."""
    import torch

    torch.set_num_threads(max(1, n - 1))
    _IO_THREADS["on"] = n >= 2


def io_threads() -> bool:
    """Whether reading and writing run in background threads (the last :func:`set_threads` had ``n >= 2``)."""
    return _IO_THREADS["on"]


def default_threads() -> int:
    """Half the cores, 1 to 4: merging is memory-bound, and a shared machine keeps cores for others."""
    return max(1, min(4, (os.cpu_count() or 2) // 2))
