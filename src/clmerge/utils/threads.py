"""The process's thread setting for merges (``clmerge merge --threads``), one place that sets and reads it.

``set_threads(n)``: ``n = 1`` runs everything in one thread; ``n >= 2`` gives torch ``n - 1`` intra-op
threads for the arithmetic and lets a merge read the next key and write the last one in threads of their
own (:func:`io_threads` says whether). The setting is process-wide, like ``torch.set_num_threads``.

Bounds on torch's intra-op thread count (``clmerge run``'s ``run.threads``, ``pretrain`` and ``merge``'s
``--threads``).

A count far above the machine's cores buys nothing and breaks: ``torch.set_num_threads(100000)`` makes the
OpenMP runtime fail to create its threads and the next parallel op crash the process (segmentation fault).
So a count above :data:`THREADS_PER_CPU` times ``os.cpu_count()`` is refused before torch is touched.
"""

from __future__ import annotations

import os

__all__ = ["default_threads", "free_cores", "io_threads", "set_threads", "THREADS_PER_CPU", "max_threads", "threads_problem",
           "check_threads", "check_jobs"]

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


def free_cores(cpus: int | None = None, load: float | None = None) -> int:
    """The cores not already busy: ``cpus - round(load)``, at least 1, with ``load`` the 1-minute load
    average (``os.getloadavg``; 0 where the platform has none) and ``cpus`` ``os.cpu_count()``."""
    if cpus is None:
        cpus = os.cpu_count() or 1
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # no load average on this platform
            load = 0.0
    return max(1, cpus - int(round(max(0.0, load))))


def default_threads(cpus: int | None = None, load: float | None = None) -> int:
    """``clmerge merge``'s thread count without ``--threads``: half the cores, 1 to 4 (merging is
    memory-bound, and a shared machine keeps cores for others), and no more than the cores that are free
    now (:func:`free_cores`): on a busy machine more threads than free cores took longer than one
    (docs/threads.md, "Default thread count under load")."""
    if cpus is None:
        cpus = os.cpu_count() or 2
    return max(1, min(4, cpus // 2, free_cores(cpus, load)))


THREADS_PER_CPU = 4  # oversubscription up to this factor is allowed (it only costs time)


def max_threads() -> int:
    """The largest accepted thread count on this machine: :data:`THREADS_PER_CPU` x the CPUs."""
    return THREADS_PER_CPU * (os.cpu_count() or 1)


def threads_problem(n: int) -> str | None:
    """What is wrong with ``n`` threads (``"should be ..."``), or None when it is usable here."""
    top = max_threads()
    if n < 1:
        return "should be at least 1"
    if n > top:
        return f"should be at most {top} ({THREADS_PER_CPU} x the {top // THREADS_PER_CPU} CPUs here)"
    return None


def check_threads(n: int, name: str = "--threads") -> int:
    """``n`` when it is a usable thread count; else ``ValueError`` naming ``name``, the bound and ``n``."""
    problem = threads_problem(n)
    if problem is not None:
        raise ValueError(f"{name}: {problem}, got {n}")
    return n


def check_jobs(n: int, name: str = "--jobs") -> int:
    """``n`` worker processes (0: none) when at most :func:`max_threads`; else ``ValueError`` naming ``name``.
    A worker pool of a mistyped size (``--jobs 100000``) would fork until the machine falls over."""
    if n < 0 or n > max_threads():
        raise ValueError(f"{name}: should be 0 to {max_threads()} ({THREADS_PER_CPU} x the "
                         f"{max_threads() // THREADS_PER_CPU} CPUs here), got {n}")
    return n
