"""Mixed precision: ``run.precision`` = ``fp32`` | ``bf16`` | ``fp16`` (docs/scaling.md).

bf16 and fp16 run the training forward pass and the loss, and the evaluation forward passes, under
``torch.autocast``; fp16 also scales the loss with a ``GradScaler`` so that small gradients do not underflow.
Parameters, optimizer state and gradients stay fp32 (autocast casts copies for the matmuls only).

Everything numerically sensitive runs in fp32 whatever the run's precision: the end-of-task work of every
method (Fisher accumulation, P&M's alpha sums, GPM/DualGPM and InfLoRA SVDs, HALRP's importance, the heads'
alignment statistics) happens outside the training loop's autocast region, and the functions that compute it
are wrapped in :func:`full_precision`, which switches autocast off, so a caller that does hold an autocast
region (a method calling them from inside a loss, a user's script) still gets fp32 results.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

__all__ = ["PRECISIONS", "autocast", "grad_scaler", "full_precision", "fp32_region", "check_precision"]

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

F = TypeVar("F", bound=Callable[..., Any])


def check_precision(precision: str, device: torch.device | str) -> None:
    """A clear error for a precision the device cannot run (fp16 autocast needs CUDA or a recent CPU build)."""
    if precision not in PRECISIONS:
        raise ValueError(f"run.precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
    dev = torch.device(device)
    if precision == "fp16" and dev.type == "cpu":
        import warnings

        warnings.warn("run.precision=fp16 on a CPU runs ~9x slower than fp32 without fp16 matrix instructions "
                      "(benchmarks/throughput.md); fp16 is meant for GPUs", stacklevel=2)
    if precision == "bf16" and dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"run.precision: bf16 is not supported on {torch.cuda.get_device_name(dev)}; use fp16")


def autocast(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    """The autocast region of ``precision`` on ``device`` (a no-op context for fp32)."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def grad_scaler(precision: str, device: torch.device | str) -> torch.amp.GradScaler:
    """A loss scaler, enabled for fp16 only (bf16 has fp32's exponent range and needs none)."""
    return torch.amp.GradScaler(torch.device(device).type, enabled=precision == "fp16")


@contextlib.contextmanager
def fp32_region() -> Iterator[None]:
    """Autocast off on CPU and CUDA inside (an ``autocast`` opened inside, e.g. by a method's inner ``fit``,
    switches it back on for its own region)."""
    with torch.autocast("cpu", enabled=False):
        if torch.cuda.is_available():
            with torch.autocast("cuda", enabled=False):
                yield
        else:
            yield


def full_precision(fn: F) -> F:
    """Run ``fn`` with autocast off (CPU and CUDA): for statistics that must be accumulated in fp32."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with fp32_region():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
