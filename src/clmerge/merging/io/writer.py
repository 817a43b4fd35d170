"""A streaming, sharded safetensors writer whose layout is fixed before the first tensor arrives.

A merge's output has the base's keys and shapes, and its dtypes are known up front, so every shard's header
(and each tensor's byte range) is computed first. Each tensor is then written straight to its place in its
shard file (``pwrite``) the moment it is merged and is dropped: the writer holds no tensor, and a key can be
written in any order or rewritten later (TIES re-merges a few keys after its sign election). Files follow the
safetensors format (8-byte little-endian header length, JSON header padded to 8 bytes, data) with
``format: pt`` metadata, plus ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``) when
there are several shards, as ``transformers`` writes them.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ...utils.dtypes import ST_DTYPES
from .checks import check_finite_output, is_finite

__all__ = ["DEFAULT_SHARD_SIZE", "BackgroundWriter", "ShardedWriter", "TensorPlan", "parse_size"]

DEFAULT_SHARD_SIZE = 5 * 10**9  # the transformers / mergekit default, "5GB"
_ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """``"500MB"`` -> 500_000_000, ``"2GiB"`` -> 2 * 2**30, ``1000`` -> 1000 (bytes); else ValueError."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*", str(text), flags=re.IGNORECASE)
        if not m:
            raise ValueError(f"shard size {text!r}: expected a size such as 500MB, 2GB or 1GiB")
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if value <= 0:
        raise ValueError(f"shard size {text!r}: must be positive")
    return value


@dataclass(frozen=True)
class TensorPlan:
    """Where one output tensor goes: its shard file, byte offset there, shape and dtype."""

    file: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class ShardedWriter:
    """Write ``(key, shape, dtype)`` tensors into shards of at most ``shard_size`` bytes under ``folder``.

    Args:
        folder: an existing (temporary) folder.
        tensors: every output key with its shape and dtype, in the order they go into the shards.
        shard_size: bytes per shard (a tensor larger than that gets a shard of its own).
        single_file: write exactly one file of this name, without an index (``--out X.safetensors``).
        metadata: extra ``__metadata__`` strings (``format: pt`` is always set).
    """

    def __init__(self, folder: Path, tensors: Sequence[tuple[str, tuple[int, ...], torch.dtype]], *,
                 shard_size: int = DEFAULT_SHARD_SIZE, single_file: str | None = None,
                 metadata: dict[str, str] | None = None) -> None:
        self.folder = Path(folder)
        groups = [list(tensors)] if single_file else _split(tensors, shard_size)
        n = len(groups)
        names = [single_file] if single_file else \
            (["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
        self.plan: dict[str, TensorPlan] = {}
        self._fds: dict[str, int] = {}
        self.single = bool(single_file) or n == 1
        meta = {"format": "pt", **(metadata or {})}
        for name, group in zip(names, groups):
            self._open_shard(name, group, meta)
        self.written: set[str] = set()
        self.nonfinite: dict[str, None] = {}  # keys written with NaN or Inf (in write order)

    def _open_shard(self, name: str, group: list, meta: dict[str, str]) -> None:
        header: dict = {"__metadata__": meta}
        pos = 0
        for key, shape, dtype in group:
            size = math.prod(shape) * dtype.itemsize
            header[key] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [pos, pos + size]}
            pos += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
        start = 8 + len(raw)
        fd = os.open(self.folder / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._fds[name] = fd
        with self._naming(name):
            _pwrite_all(fd, len(raw).to_bytes(8, "little") + raw, 0)
            os.ftruncate(fd, start + pos)
        for key, shape, dtype in group:
            self.plan[key] = TensorPlan(name, start + header[key]["data_offsets"][0], tuple(shape), dtype)

    @contextmanager
    def _naming(self, name: str) -> Iterator[None]:
        """An ``OSError`` without a file name (``pwrite``, ``fsync`` on a full disk) gets the shard's path."""
        try:
            yield
        except OSError as exc:
            if exc.filename is not None or exc.errno is None:
                raise
            raise OSError(exc.errno, exc.strerror, str(self.folder / name)) from None

    def write(self, key: str, tensor: Tensor) -> None:
        """Cast ``tensor`` to the planned dtype and write it to its place (again if already written)."""
        p = self.plan.get(key)
        if p is None:
            raise KeyError(f"output key {key!r} is not in the planned output")
        if tuple(tensor.shape) != p.shape:
            raise ValueError(f"output key {key!r}: shape {list(tensor.shape)}, planned {list(p.shape)}")
        data = tensor.detach().to(device="cpu", dtype=p.dtype).contiguous().reshape(-1)
        # checked after the cast: a finite float32 value beyond float16's range is written as Inf
        if is_finite(data):
            self.nonfinite.pop(key, None)  # a rewrite (TIES's sign fix) may replace a bad tensor
        else:
            self.nonfinite[key] = None
        if p.nbytes:
            with self._naming(p.file):
                _pwrite_all(self._fds[p.file], memoryview(data.view(torch.uint8).numpy()), p.offset)
        self.written.add(key)

    def read(self, key: str) -> Tensor:
        """Read back a written tensor (planned dtype)."""
        p = self.plan[key]
        buf = bytearray(p.nbytes)
        view, got = memoryview(buf), 0
        while got < p.nbytes:
            got += os.preadv(self._fds[p.file], [view[got:]], p.offset + got)
        return torch.frombuffer(buf, dtype=torch.uint8).view(p.dtype).reshape(p.shape) if p.nbytes else \
            torch.empty(p.shape, dtype=p.dtype)

    def close(self) -> list[str]:
        """Check every key was written and finite, flush the shards, write the index; returns the file names.

        Raises:
            MergeInputError: a tensor holds NaN or Inf (names them; the caller removes the folder).
        """
        missing = [k for k in self.plan if k not in self.written]
        if missing:
            raise RuntimeError(f"merge wrote no tensor for key {missing[0]!r} ({len(missing)} keys missing)")
        check_finite_output(list(self.nonfinite), written=True)
        for name, fd in self._fds.items():
            with self._naming(name):
                os.fsync(fd)  # a full disk may show only here
            os.close(fd)
        names = list(self._fds)
        self._fds = {}
        if not self.single:
            index = {"metadata": {"total_size": sum(p.nbytes for p in self.plan.values())},
                     "weight_map": {k: p.file for k, p in self.plan.items()}}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
            names.append("model.safetensors.index.json")
        return names

    def abort(self) -> None:
        """Close the files without checks (the caller deletes the temporary folder)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


class BackgroundWriter:
    """A :class:`ShardedWriter` fed through a short queue and written by a background thread.

    The cast to the output dtype and the file writes (which release the GIL) overlap the next key's merge.
    ``read`` waits for pending writes; an error in the thread is raised by the next call.
    """

    def __init__(self, writer: ShardedWriter, depth: int = 2) -> None:
        import queue
        import threading

        self.writer, self.error = writer, None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, name="clmerge-write", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self.error is None:
                    self.writer.write(*item)
            except BaseException as exc:  # handed to the merging thread
                self.error = exc
            finally:
                self._queue.task_done()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def write(self, key: str, tensor: Tensor) -> None:
        self._raise()
        self._queue.put((key, tensor))

    def flush(self) -> None:
        self._queue.join()
        self._raise()

    def read(self, key: str) -> Tensor:
        self.flush()
        return self.writer.read(key)

    def stop(self) -> None:
        """Finish pending writes and end the thread (no checks; :meth:`close` or ``abort`` follows)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def close(self) -> list[str]:
        self.stop()
        self._raise()
        return self.writer.close()

    def abort(self) -> None:
        self.stop()
        self.writer.abort()


def _split(tensors: Sequence[tuple[str, tuple[int, ...], torch.dtype]], shard_size: int) -> list[list]:
    groups: list[list] = [[]]
    size = 0
    for item in tensors:
        n = math.prod(item[1]) * item[2].itemsize
        if groups[-1] and size + n > shard_size:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += n
    return groups


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view, done = memoryview(data).cast("B"), 0
    while done < len(view):  # pwrite may write fewer bytes than asked
        done += os.pwrite(fd, view[done:], offset + done)
