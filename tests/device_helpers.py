"""A CPU stand-in for a GPU that refuses what a GPU refuses: an operation mixing a device tensor with a host one.

:class:`StrictCpuDevice` is ``Device("cpu", forced=True)`` that tags every tensor on "the device" (moved there
by ``put``, made by a factory inside a kernel, or computed from a tagged tensor) and raises when one
operation takes a tagged tensor and an untagged one of one or more dimensions (CUDA allows only host
0-dim scalars beside device tensors; ``copy_`` copies across devices), or when a random draw from a CPU
generator would be allocated on the device. Without a GPU, this is how the tests
find a kernel that combines a CPU statistic with a device tensor.
"""

from __future__ import annotations

import weakref

from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from clmerge.utils.device import Device

_CROSS_DEVICE_OK = {"copy_", "__set__", "__get__", "to", "cpu", "device"}


class CrossDeviceError(RuntimeError):
    pass


class StrictCpuDevice(Device):
    """The CPU forced as the device, with device tensors tracked (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__("cpu", forced=True)
        self.tags: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.checked = 0  # operations seen inside kernels

    def tagged(self, t: Tensor) -> bool:
        return self.tags.get(id(t)) is t

    def tag(self, t: Tensor) -> Tensor:
        self.tags[id(t)] = t
        return t

    def holds(self, t: Tensor) -> bool:
        return self.tagged(t)

    def put(self, t):
        out = super().put(t)
        return None if out is None else self.tag(out)

    def back(self, t: Tensor) -> Tensor:
        out = super().back(t)
        self.tags.pop(id(out), None)
        return out

    def mode(self):
        return _Strict(self)


class _Strict(TorchFunctionMode):
    def __init__(self, device: StrictCpuDevice) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = self.device
        dev.checked += 1
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        on_dev = [t for t in tensors if dev.tagged(t)]
        name = getattr(func, "__name__", str(func))
        host = [t for t in tensors if not dev.tagged(t) and t.dim() > 0]
        if on_dev and host and name not in _CROSS_DEVICE_OK:
            raise CrossDeviceError(f"{name}: mixes device tensors with host tensors of shapes "
                                   f"{[tuple(t.shape) for t in host]}")
        gen = kwargs.get("generator")
        if not tensors and gen is not None and kwargs.get("device") is None:  # CUDA: "expected a cuda generator"
            raise CrossDeviceError(f"{name}: a draw from a {gen.device} generator allocated on the device")
        out = func(*args, **kwargs)
        made_here = not tensors and kwargs.get("device") is None  # a factory: allocated on the device
        if (on_dev and name != "cpu") or made_here:  # .to(dtype) stays on the device; Device.back untags
            for t in tree_leaves(out):
                if isinstance(t, Tensor):
                    dev.tag(t)
        return out
