"""Data-parallel training with ``torch.distributed``: several processes (GPUs, machines, or CPU processes with
the gloo backend) train one model on shares of every batch (docs/scaling.md).

How a run is split:

* **Training steps.** Every process draws the same batch order from the same per-task generator and loads
  only its contiguous share of each batch (``TaskData.batches(part=...)``). Its mean loss is weighted by its
  share of the batch, the gradients are summed over processes (one ``all_reduce`` per dtype bucket), and
  then the method's ``before_step`` hook (e.g. GPM's projection), clipping and the optimizer step run on the
  identical summed gradient in every process. The update is the one-process update of the whole batch, up
  to the order of floating-point additions. Batch statistics of BatchNorm layers are per share, as in DDP.
* **End-of-task work** (Fisher and Gram statistics, GPM / InfLoRA bases, P&M's alpha, CART / merge folds,
  HALRP's importance, the heads' alignment statistics, evaluation and every file of the run directory) runs
  once, in process 0, over the whole task, with data parallelism switched off (:func:`local`). Its result,
  the same state a checkpoint holds, is then broadcast: the other processes build a fresh model and method
  and load it, exactly as ``--resume`` does. So every process starts the next task bit-identical.

Why not ``torch.nn.parallel.DistributedDataParallel``: the methods change the model between tasks (LoRA
branches added and folded, heads grown, parameters frozen) and their losses call submodules directly
(``model.backbone``, teachers, perturbed copies), not the wrapper's ``forward``, which DDP needs to sync.
Summing the gradients after ``backward`` gives the same update for any of them.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DataParallel", "active", "setup", "local", "is_main", "launched", "torchrun_command",
           "broadcast_json", "broadcast_tensors", "BUCKET_BYTES"]

BUCKET_BYTES = 32 * 2**20  # gradients are summed in flat buckets of about this size


@dataclass
class DataParallel:
    """This process's place in the group: ``rank`` of ``world`` processes, ``device`` to train on."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str

    def all_reduce_grads(self, params: list[torch.Tensor]) -> None:
        """Sum the gradients of ``params`` over processes, in place (flat buckets per dtype)."""
        grads = [p.grad for p in params if p.grad is not None]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for group in by_dtype.values():
            bucket: list[torch.Tensor] = []
            size = 0
            for g in group:
                bucket.append(g)
                size += g.numel() * g.element_size()
                if size >= BUCKET_BYTES:
                    self._reduce(bucket)
                    bucket, size = [], 0
            if bucket:
                self._reduce(bucket)

    def _reduce(self, bucket: list[torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()

    def sum_scalar(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t.item())


_STATE: DataParallel | None = None
_LOCAL = 0


def launched() -> bool:
    """Whether this process was started by ``torchrun`` (or another launcher) as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def torchrun_command(nproc: int, clmerge_args: list[str]) -> list[str]:
    """The command that runs ``clmerge <clmerge_args>`` in ``nproc`` processes on this machine under torchrun
    (``--standalone``: a free rendezvous port, so several such jobs may run side by side)."""
    import sys

    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "clmerge", *clmerge_args]


def setup(device: str = "cpu", timeout_minutes: float = 120.0) -> DataParallel | None:
    """Join the process group that ``torchrun`` describes in the environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``); None in a single process. Idempotent.

    ``device``: ``run.device``. ``cuda``/``auto`` with CUDA present trains on ``cuda:LOCAL_RANK`` with NCCL;
    otherwise on the CPU with gloo. The timeout covers process 0's end-of-task work (evaluation included)
    while the others wait.
    """
    global _STATE
    if _STATE is not None or not launched():
        return _STATE
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device.startswith(("cuda", "auto")) and torch.cuda.is_available():
        dev, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(dev)
    elif device.startswith("cuda"):
        raise ValueError(f"run.device={device!r} but CUDA is not available in process {rank}")
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    _STATE = DataParallel(rank=rank, world=world, local_rank=local_rank, device=dev, backend=backend)
    return _STATE


def active() -> DataParallel | None:
    """The data-parallel group, or None (single process, or inside :func:`local`)."""
    return None if _LOCAL else _STATE


def is_main() -> bool:
    """True in process 0, and in a single-process run: the one that writes files and prints."""
    return _STATE is None or _STATE.rank == 0


@contextlib.contextmanager
def local() -> Iterator[None]:
    """Work of one process alone (process 0's end-of-task work): :func:`active` is None inside."""
    global _LOCAL
    _LOCAL += 1
    try:
        yield
    finally:
        _LOCAL -= 1


def broadcast_json(dp: DataParallel, obj=None):
    """``obj`` (JSON-serialisable) from process 0 to all; returns it in every process. JSON, never pickle."""
    if dp.rank == 0:
        data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=dp.device)
        n = torch.tensor([data.numel()], dtype=torch.int64, device=dp.device)
    else:
        n = torch.zeros(1, dtype=torch.int64, device=dp.device)
    dist.broadcast(n, 0)
    if dp.rank != 0:
        data = torch.empty(int(n.item()), dtype=torch.uint8, device=dp.device)
    dist.broadcast(data, 0)
    return json.loads(bytes(data.cpu().tolist()).decode()) if dp.rank != 0 else obj


def broadcast_tensors(dp: DataParallel, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Named CPU tensors from process 0 to all (their names, shapes and dtypes go first, as JSON)."""
    spec = None
    if dp.rank == 0:
        spec = [[k, list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in tensors.items()]
    spec = broadcast_json(dp, spec)
    out: dict[str, torch.Tensor] = {}
    for name, shape, dtype in spec:
        if dp.rank == 0:
            t = tensors[name].detach().contiguous().to(dp.device)
        else:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=dp.device)
        dist.broadcast(t, 0)
        out[name] = t.cpu() if dp.rank != 0 else tensors[name]
    return out
