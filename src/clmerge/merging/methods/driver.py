"""The shared driver: apply a per-tensor kernel key by key, plus the small tensor helpers kernels share.

A kernel sees one key at a time: ``kernel(key, base, experts) -> Tensor`` with ``base`` the pretrained tensor
(or ``None``) and ``experts`` the ``T`` fine-tuned tensors of that key. Only floating tensors reach a kernel;
integer / bool buffers are copied from the base (or the first expert). Results are cast back to the inputs'
dtype. Kernels never modify their inputs.

An elementwise kernel (one whose output entry depends only on the same entry of its inputs) can be run with
``chunk=N``: the driver then hands it flat slices of ``N`` entries and writes the results into one output
tensor, so the kernel's temporaries (stacks, masks, float64 copies) stay in the CPU cache instead of costing a
trip through main memory each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ...utils.device import Device, current_device
from .sources import ModelSet
from .trim import input_dtype_arithmetic

__all__ = ["CHUNK", "DEVICE_CHUNK", "Kernel", "SinkView", "apply_chunked", "check_experts_weights", "chunk_for",
           "map_keys", "on_device", "row_blocks", "stack64", "task_vectors64"]

Kernel = Callable[[str, Tensor | None, list[Tensor]], Tensor]

# Entries per slice for elementwise kernels: a few float32 buffers of 64 K entries stay in L2.
CHUNK = 1 << 16
# Entries per slice of a streamed kernel on a GPU: cache-sized slices gain nothing there, and big ones keep
# its launches few.
DEVICE_CHUNK = 1 << 24


def chunk_for(t: Tensor) -> int:
    """Entries per slice of a kernel that streams a key in blocks (two passes where it needs a whole-tensor
    reduction first): :data:`CHUNK` for a tensor on the CPU, :data:`DEVICE_CHUNK` on a GPU."""
    return CHUNK if t.device.type == "cpu" else DEVICE_CHUNK


def row_blocks(t: Tensor) -> list[Any]:
    """Indices of ``t``'s first dimension, slices of about :func:`chunk_for` entries each (at least one row),
    for a kernel whose rows are independent; a tensor of fewer than two dimensions is one block (``...``)."""
    if t.dim() < 2 or t.shape[0] == 0:
        return [...]
    rows = max(1, chunk_for(t) // max(1, t[0].numel()))
    return [slice(i, i + rows) for i in range(0, t.shape[0], rows)]


def map_keys(models: ModelSet, kernel: Kernel, *, needs_base: bool = False,
             chunk: int | None = None, propagates_nonfinite: bool = False) -> MutableMapping[str, Tensor]:
    """Run ``kernel`` over every key of ``models`` and collect a new parameter dict.

    Args:
        models: the base and experts. With ``models.sink`` set, each merged tensor is handed to the sink as
            soon as it is computed and dropped (a streaming merge), and the returned mapping reads back from
            the sink (assigning to it rewrites the key there).
        kernel: the per-tensor merge.
        needs_base: raise if ``models`` has no base.
        chunk: if given, ``kernel`` is elementwise and is run on flat slices of this many entries.
        propagates_nonfinite: the kernel's output is non-finite wherever an input is (linear combinations
            such as averaging): the NaN/Inf check then reads the output, and the inputs only to name the
            offending file (one read of the inputs saved).

    Returns:
        A new dict with the same keys, shapes and dtypes as the experts (a :class:`SinkView` when streaming).
    """
    if needs_base and models.base is None:
        raise ValueError("this method needs base= (the pretrained parameters)")
    sink = getattr(models, "sink", None)
    out: MutableMapping[str, Tensor] = {} if sink is None else SinkView(sink, models.keys())
    check_inputs = None if not propagates_nonfinite else False
    device = current_device()
    # compute_dtype bfloat16 / float16 / input: the kernels' work dtype is the inputs' (trim.work_dtype)
    with input_dtype_arithmetic(getattr(models, "narrow", False)):
        _map_keys(models, kernel, chunk, propagates_nonfinite, check_inputs, device, out)
    return out


def _map_keys(models: ModelSet, kernel: Kernel, chunk: int | None, propagates_nonfinite: bool,
              check_inputs: bool | None, device: Device | None, out: MutableMapping[str, Tensor]) -> None:
    for key, base, experts in models.items(check_inputs):
        if not experts[0].is_floating_point():
            res = (base if base is not None else experts[0]).clone()
        elif device is not None:
            res = on_device(device, kernel, key, base, experts, chunk)
        elif chunk is None:
            res = kernel(key, base, experts).to(experts[0].dtype).contiguous()
        else:
            res = apply_chunked(kernel, key, base, experts, chunk)
        if propagates_nonfinite and models.check_finite and not torch.isfinite(res.sum()):
            models.load(key, check=True)  # raises MergeInputError naming the key and the file
        out[key] = res
        del base, experts, res  # else this key's inputs stay alive while the next key is read


def on_device(device: Device, kernel: Kernel, key: str, base: Tensor | None, experts: list[Tensor],
              chunk: int | None) -> Tensor:
    """One key merged on ``device``: its inputs moved there, the kernel run there (allocating there), the
    result cast to the inputs' dtype and moved back to the CPU. Elementwise kernels are sliced only on the CPU
    (cache-sized slices pay off there; on a GPU one launch per operation over the whole tensor does)."""
    b, xs = device.put(base), [device.put(x) for x in experts]
    with device.mode():
        if chunk is not None and device.torch.type == "cpu":
            res = apply_chunked(kernel, key, b, xs, chunk)
        else:
            res = kernel(key, b, xs).to(xs[0].dtype)
    return device.back(res).contiguous()


class SinkView(MutableMapping):
    """The merged parameters of a streaming merge as a mapping over the sink they were written to.

    Reading a key reads it back from the sink; assigning rewrites it there. A tensor read back may be patched
    in place (TIES settles its ambiguous entries once the model-wide sign majority is known): it is written
    back when the next key is read, or at :meth:`flush`, so at most one tensor is held.
    """

    def __init__(self, sink: Any, keys: list[str]) -> None:
        self.sink, self._keys = sink, list(keys)
        self._open: tuple[str, Tensor] | None = None

    def flush(self) -> None:
        """Write back the tensor last read (the caller is done patching it)."""
        if self._open is not None:
            key, tensor = self._open
            self._open = None
            self.sink.write(key, tensor)

    def __getitem__(self, key: str) -> Tensor:
        self.flush()
        tensor = self.sink.read(key)
        self._open = (key, tensor)
        return tensor

    def __setitem__(self, key: str, value: Tensor) -> None:
        if self._open is not None and self._open[0] == key:
            self._open = None  # replaced as a whole
        self.sink.write(key, value)

    def __delitem__(self, key: str) -> None:
        raise TypeError("a streamed merge result cannot drop keys")

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def apply_chunked(kernel: Kernel, key: str, base: Tensor | None, experts: list[Tensor], chunk: int) -> Tensor:
    """An elementwise ``kernel`` over flat slices of ``chunk`` entries, written into one output tensor.

    The slices run on one intra-op thread: a thread pool woken for every cache-sized slice spends more time
    handing off work than computing (on a busy 2-core machine, 2 threads took 8-30x the wall time of 1), and
    these kernels are memory-bound anyway. ``clmerge merge --threads`` overlaps reading and writing instead.
    """
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
    try:
        flat = [x.reshape(-1) for x in experts]
        fbase = None if base is None else base.reshape(-1)
        res = torch.empty(experts[0].shape, dtype=experts[0].dtype)
        rflat = res.view(-1)
        for i in range(0, rflat.numel(), chunk):
            j = i + chunk
            rflat[i:j] = kernel(key, None if fbase is None else fbase[i:j], [x[i:j] for x in flat])
    finally:
        if threads > 1:
            torch.set_num_threads(threads)
    return res


def stack64(tensors: Sequence[Tensor]) -> Tensor:
    """Stack one key's tensors as float64, shape ``(T, *shape)``."""
    return torch.stack([t.to(torch.float64) for t in tensors])


def task_vectors64(base: Tensor, experts: Sequence[Tensor]) -> Tensor:
    """Task vectors ``tau_t = theta_t - theta_0`` of one key, float64, shape ``(T, *shape)``."""
    return stack64(experts) - base.to(torch.float64)


def check_experts_weights(weights: Sequence[float] | None, n: int) -> Tensor | None:
    """Validate optional per-expert weights; returns them as a float64 tensor (or ``None``)."""
    if weights is None:
        return None
    if len(weights) != n:
        raise ValueError(f"weights: got {len(weights)} values for {n} experts")
    return torch.tensor([float(w) for w in weights], dtype=torch.float64)


def bshape(v: Tensor, like: Tensor) -> Tensor:
    """Reshape a ``(T,)`` vector to broadcast against ``like`` of shape ``(T, *shape)``."""
    return v.reshape(-1, *([1] * (like.dim() - 1)))
