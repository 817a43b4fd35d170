"""Where merge kernels compute: the CPU (the default, unchanged) or one CUDA device (``--device cuda[:N]``).

On a device, each key's input tensors are moved there just before its kernel runs, the kernel runs with the
device as PyTorch's default (so its ``torch.empty`` / ``torch.zeros`` temporaries are allocated there), and
the result comes back to the CPU for writing: device memory holds one key's tensors and temporaries at a time.
Random draws stay on the CPU generator and are moved (:func:`cpu_draw`), so a seed gives the same numbers on
either device.

A :class:`Device` made with ``forced=True`` runs this whole path with the CPU as the device (each move a real
copy): what the tests use to check, without a GPU, that the device path gives the plain path's results.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor

from ..errors import UsageError

__all__ = ["Device", "cpu_draw", "current_device", "like_device", "parse_device", "stats_line", "to_host",
           "using_device"]


class Device:
    """A compute device for merge kernels, with the counters a run reports.

    Attributes:
        moved: tensors moved to the device so far (each key's inputs; random draws and statistics a kernel
            takes from the CPU).
    """

    def __init__(self, spec: str | torch.device = "cpu", *, forced: bool = False) -> None:
        self.torch = torch.device(spec)
        self.forced = forced
        self.moved = 0
        self._start = time.perf_counter()

    @property
    def active(self) -> bool:
        """Whether kernels take the device path (a CUDA device, or the CPU when forced)."""
        return self.torch.type != "cpu" or self.forced

    def put(self, t: Tensor | None) -> Tensor | None:
        """``t`` on the device (a copy when forced, as a real transfer would be)."""
        if t is None:
            return None
        self.moved += 1
        return t.to(self.torch, copy=self.forced)

    def holds(self, t: Tensor) -> bool:
        """Whether ``t`` is on this device (when forced: any CPU tensor)."""
        return t.device == self.torch

    def back(self, t: Tensor) -> Tensor:
        """``t`` on the CPU, for writing."""
        return t.to("cpu", copy=self.forced)

    def mode(self) -> Any:
        """A context in which new tensors are allocated on the device."""
        return torch.device(self.torch) if self.active else nullcontext()

    def start(self) -> None:
        """Start the wall clock and the device's peak-memory counter."""
        self._start = time.perf_counter()
        if self.torch.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.torch)

    def stats(self) -> dict:
        """``{"device", "wall_s", "peak_device_memory_bytes"}`` (the peak is ``None`` off CUDA)."""
        peak = torch.cuda.max_memory_allocated(self.torch) if self.torch.type == "cuda" else None
        return {"device": str(self.torch), "wall_s": round(time.perf_counter() - self._start, 3),
                "peak_device_memory_bytes": peak}

    def summary(self) -> str:
        """One log line: the device, the wall time and the peak device memory."""
        return stats_line(self.stats())


def stats_line(stats: dict) -> str:
    """``device cuda:0: wall 12.3 s, peak device memory 1.20 GB`` from :meth:`Device.stats`."""
    peak = stats["peak_device_memory_bytes"]
    return (f"device {stats['device']}: wall {stats['wall_s']:.1f} s, peak device memory "
            f"{'n/a' if peak is None else f'{peak / 1e9:.2f} GB'}")


def parse_device(spec: str | Device | None, flag: str = "--device") -> Device:
    """A :class:`Device` from ``cpu``, ``cuda`` or ``cuda:N``; a CUDA device that is not visible is a
    :class:`~clmerge.errors.UsageError` naming ``flag``."""
    if isinstance(spec, Device):
        return spec
    spec = "cpu" if spec is None else str(spec).strip()
    head, _, index = spec.partition(":")
    if head not in ("cpu", "cuda") or (index and not (head == "cuda" and index.isdigit())):
        raise UsageError(f"{flag} {spec!r}: expected cpu, cuda or cuda:N")
    if head == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"{flag} {spec}: no CUDA device is visible (torch.cuda.is_available() is False); "
                             "use --device cpu")
        if index and int(index) >= torch.cuda.device_count():
            raise UsageError(f"{flag} {spec}: only {torch.cuda.device_count()} CUDA device(s) are visible "
                             f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return Device(spec)


_CURRENT: ContextVar[Device | None] = ContextVar("clmerge_device", default=None)


@contextmanager
def using_device(device: Device | None) -> Iterator[Device | None]:
    """Merge kernels called inside run on ``device`` (``None`` or an inactive one: the CPU, as always)."""
    token = _CURRENT.set(device)
    try:
        yield device
    finally:
        _CURRENT.reset(token)


def current_device() -> Device | None:
    """The active device of the enclosing :func:`using_device`, or ``None`` (the plain CPU path)."""
    dev = _CURRENT.get()
    return dev if dev is not None and dev.active else None


def like_device(t: Tensor, like: Tensor) -> Tensor:
    """``t`` moved to ``like``'s device (onto the active device when ``like`` is there; as is on the CPU)."""
    device = current_device()
    if device is not None and device.holds(like):
        return device.put(t)
    return t.to(like.device)


def to_host(t: Tensor) -> Tensor:
    """``t`` on the CPU (a kernel's side result that the CPU code after the merge patches with)."""
    device = current_device()
    return t if device is None else device.back(t)


def cpu_draw(fn: Callable[..., Tensor], *args: Any, generator: torch.Generator, like: Tensor,
             **kwargs: Any) -> Tensor:
    """``fn(*args, generator=generator, **kwargs)`` drawn on the (CPU) generator, then moved to ``like``'s
    device: the same numbers whichever device the kernel runs on."""
    return like_device(fn(*args, generator=generator, device=generator.device, **kwargs), like)
