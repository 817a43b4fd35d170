"""The base types of checkpoint I/O: an in-memory dict or one weights file as a lazy source, and the input error.

This module imports nothing from the rest of :mod:`clmerge.merging`: readers, PEFT adapters and writers build on it.

A source has ``keys()``, ``meta(key) -> (shape, dtype)``, ``get(key)``, ``name`` (how errors refer to it),
``files`` (the weight files it reads) and ``folder`` (the model folder, or ``None``). Safetensors are read one
tensor at a time with plain reads; ``.bin`` / ``.pt`` files only with ``torch.load(weights_only=True)``.
Every read goes through the input boundary (:mod:`clmerge.utils.inpaths`): the opened file is checked (a regular
file, inside its model folder when it came from one), and readers that open paths themselves get the checked
descriptor's ``/proc/self/fd/N`` (:func:`~clmerge.utils.inpaths.checked_path`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ...errors import InputError
from ...utils import inpaths
from ...utils.dtypes import ST_DTYPES

__all__ = ["ST_DTYPES", "MergeInputError", "ParamSource", "is_source", "torch_load_state_dict"]



#: No size cap for weights files (they are read tensor by tensor, never whole).
NO_CAP = 1 << 62


class MergeInputError(InputError):
    """Inputs to a merge disagree or are malformed (message names the key and the files); exit code 3."""


class ParamSource:
    """A read-only view of one parameter set: a dict, a safetensors file (lazy) or a ``.bin``/``.pt`` file.

    Args:
        obj: a ``dict[str, Tensor]`` or a path.
        name: how errors refer to this input (default: the path, or ``"<dict>"``).
        within: the model folder the path was found in (a folder's weights file, a shard index's entry): the
            file must resolve inside it (``None``: a path the user named).
    """

    def __init__(self, obj: Mapping[str, Tensor] | str | Path, name: str | None = None, *,
                 within: str | Path | None = None) -> None:
        self._dict: Mapping[str, Tensor] | None = None
        self._handle = None
        self._reader: _SafetensorsReader | None = None
        self.files: list[Path] = []
        self.folder: Path | None = None
        if isinstance(obj, Mapping):
            self._dict = obj
            self.name = name or "<dict>"
        else:
            path = Path(obj)
            self.name = name or str(path)
            self.files = [path]
            if not path.exists():
                raise FileNotFoundError(f"no such weights file: {path}")
            if path.suffix == ".safetensors":
                from safetensors import safe_open

                with inpaths.checked_path(path, within=within) as checked:
                    try:
                        self._handle = safe_open(checked, framework="pt")  # validates the header
                    except Exception as exc:  # safetensors raises several types for corrupt headers
                        raise MergeInputError(f"{path}: not a readable safetensors file ({exc})") from exc
                self._reader = _SafetensorsReader(path, within)
            elif path.suffix in (".bin", ".pt", ".pth", ".ckpt"):
                self._dict = torch_load_state_dict(path, within=within)
            else:
                raise MergeInputError(f"{path}: not a weights file (expected .safetensors, .bin, .pt or .pth)")
        self._meta = self._read_meta()

    def _read_meta(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if self._dict is not None:
            return {k: (tuple(v.shape), v.dtype) for k, v in self._dict.items()}
        meta = {}
        for k in self._handle.keys():
            sl = self._handle.get_slice(k)
            meta[k] = (tuple(sl.get_shape()), ST_DTYPES.get(sl.get_dtype(), sl.get_dtype()))
        return meta

    def keys(self) -> list[str]:
        """Parameter names, in the input's order."""
        return list(self._meta)

    def meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        """``(shape, dtype)`` of ``key`` without reading its data."""
        return self._meta[key]

    def get(self, key: str) -> Tensor:
        """The tensor ``key`` (read from disk now for a lazy file). Never modify it in place."""
        return self._dict[key] if self._dict is not None else self._reader.read(key)


class _SafetensorsReader:
    """Reads one tensor of a safetensors file with ``readinto`` into fresh memory (no memory map).

    A mapped file's pages count in the process's resident memory while mapped, so reading every key of
    ``T`` mapped experts would look like ``T`` models resident; plain reads keep the resident set at what
    the merge holds. Format: 8-byte little-endian header length, a JSON header with ``dtype``, ``shape``,
    ``data_offsets`` per tensor, then the data.
    """

    def __init__(self, path: Path, within: str | Path | None = None) -> None:
        import json

        self.path, self.within = path, within
        with self._open() as f:
            n = int.from_bytes(f.read(8), "little")
            try:
                self.header = {k: v for k, v in json.loads(f.read(n)).items() if k != "__metadata__"}
            except (ValueError, AttributeError) as exc:  # safe_open accepted it: only a file changed meanwhile
                raise MergeInputError(f"{path}: not a readable safetensors file ({exc})") from None
        self.data_start = 8 + n

    def _open(self) -> Any:
        """The file, opened and checked again (regular, inside its folder) for every read."""
        return inpaths.open_input(self.path, within=self.within, max_bytes=NO_CAP)

    def read(self, key: str) -> Tensor:
        info = self.header[key]
        dtype = ST_DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        size = end - begin
        if size == 0:
            return torch.empty(info["shape"], dtype=dtype)
        buf = _anonymous_buffer(size)
        with self._open() as f:
            f.seek(self.data_start + begin)
            view, got = memoryview(buf.numpy() if isinstance(buf, Tensor) else buf), 0
            while got < size:  # readinto may return short counts
                n = f.readinto(view[got:])
                if not n:
                    raise MergeInputError(f"{self.path}: truncated data for key {key!r}")
                got += n
            view.release()
        out = torch.frombuffer(buf, dtype=torch.uint8) if not isinstance(buf, Tensor) else buf
        return out.view(dtype).reshape(info["shape"])


def _anonymous_buffer(size: int) -> Any:
    """A private anonymous memory map of ``size`` bytes (a tensor where mmap flags are unavailable).

    Its own mapping is unmapped as soon as the tensor over it is freed, so reading key after key does not
    leave holes in the malloc heap between the (kept) outputs: the resident set stays at what is alive.
    """
    import mmap

    if hasattr(mmap, "MAP_ANONYMOUS") and hasattr(mmap, "MAP_PRIVATE"):
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.empty(size, dtype=torch.uint8)


def _unreadable_pickle(path: Path, exc: Exception) -> str:
    """Why a ``.bin`` / ``.pt`` file was refused, without torch's hint to unpickle it anyway."""
    text = str(exc)
    if "unsupported global" in text.lower():  # a pickled object other than tensors and containers
        return (f"{path}: holds arbitrary Python objects, not only tensors; clmerge refuses to unpickle them (that "
                f"can run code). Ask for a .safetensors file, or convert it where you trust its source")
    # torch's first line repeats the weights_only=False advice: keep only the reason after it
    reason = text.split("WeightsUnpickler error:", 1)[-1] if "WeightsUnpickler error:" in text else text
    lines = [ln.strip() for ln in reason.splitlines() if ln.strip() and "weights_only" not in ln]
    return f"{path}: not a readable PyTorch weights file ({(lines[0] if lines else type(exc).__name__)[:160]})"


def torch_load_state_dict(path: Path, *, mmap: bool = False, within: str | Path | None = None) -> dict[str, Tensor]:
    """A state dict from a ``.bin`` / ``.pt`` file, ``weights_only=True`` (one-line errors), read through the
    input boundary (``within``: the model folder the file must lie in).

    Args:
        mmap: map the file instead of reading it (zip-format files only; the legacy format is read): for
            shapes and dtypes without reading the data.
    """
    with inpaths.checked_path(path, within=within) as checked:
        try:
            try:
                obj = torch.load(checked, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError:
                if not mmap:
                    raise
                obj = torch.load(checked, map_location="cpu", weights_only=True)  # legacy format: no mmap
        except Exception as exc:  # torch's message advises weights_only=False: never repeat that advice
            raise MergeInputError(_unreadable_pickle(path, exc)) from exc
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise MergeInputError(f"{path}: expected a dict of tensors (a state_dict)")
    return dict(obj)


def is_source(obj: Any) -> bool:
    """Whether ``obj`` already is a lazy source (has ``keys``, ``meta`` and ``get``; a dict is not)."""
    return not isinstance(obj, Mapping) and all(hasattr(obj, a) for a in ("keys", "meta", "get"))
