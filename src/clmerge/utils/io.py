"""Small, safe file helpers: atomic writes, JSON, safetensors, hashing.

Every file clmerge writes goes through :func:`atomic_write_bytes` (temporary file in the same directory,
``fsync``, then ``os.replace``), so a run killed at any moment leaves either the old file or the new one,
never a torn one.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save

from ..errors import OutputError
from . import inpaths

__all__ = [
    "atomic_write_bytes",
    "atomic_write_text",
    "write_json",
    "read_json",
    "save_tensors",
    "load_tensors",
    "sha256_file",
    "sha256_bytes",
    "append_jsonl",
    "append_text",
]


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (tmp file + fsync + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be shared
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def read_json(path: str | Path, *, within: str | Path | None = None) -> Any:
    """The JSON in ``path``, read through the input boundary (:func:`clmerge.utils.inpaths.read_json`: a regular
    file of at most the JSON cap, inside ``within`` when given); a file that is not UTF-8 JSON (or nests too
    deeply to read, or holds ``NaN``/``Infinity``) is an :class:`~clmerge.errors.InputError` naming the file."""
    return inpaths.read_json(path, within=within)


def append_jsonl(path: str | Path, record: dict) -> None:
    """Append one JSON line. A line is written with a single ``write`` so readers never see half a record."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, default=_json_default) + "\n"
    append_text(path, line)


def append_text(path: str | Path, text: str) -> None:
    """Append ``text`` with one ``write``; a symlink at ``path`` is refused (nothing is written through a link
    into another place), as is anything but a regular file."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OutputError(f"{path}: is a symlink; clmerge does not append through links") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OutputError(f"{path}: is not a regular file; clmerge appends only to its own files")
        os.write(fd, text.encode("utf-8"))
    finally:
        os.close(fd)


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor],
                 metadata: dict[str, str] | None = None) -> str:
    """Save a tensor dict as safetensors, atomically; return the sha256 of the bytes written (for a record
    that later loads verify). Tensors are made contiguous and detached first."""
    clean = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    data = save(clean, metadata=metadata)
    atomic_write_bytes(path, data)
    return sha256_bytes(data)


def load_tensors(path: str | Path, *, within: str | Path | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, read through the input boundary (a regular file, inside ``within``
    when given)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such weights file: {path}")
    with inpaths.checked_path(path, within=within) as real:
        try:
            return load_file(real)
        except Exception as exc:  # safetensors raises several error types for corrupt headers
            raise ValueError(f"{path}: not a readable safetensors file ({exc})") from exc


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with inpaths.open_input(path, max_bytes=1 << 62) as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()
