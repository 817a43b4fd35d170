"""The output guard: one place decides whether a command may write an output path, before any work, so a
refused ``--out`` leaves nothing behind.

A careful CLI (git, cargo) refuses to write where it would destroy something it did not make, and says so
before it starts. Every command's ``--out`` (and ``report``'s page, ``results --output``, ``eval --json``)
goes through :func:`check_output_dir` (a new or empty folder, or one clmerge may write into; a
``.safetensors`` file where the command allows one) and :func:`check_writable` (can the path be created at
all?). Inside a folder the command was handed (a runs folder, a sweep), :func:`child` names a file or folder
to write and refuses one that is a symlink, so a page or a cell is never written through a link into another
place; :func:`slug` turns a value into a safe, bounded, collision-free folder name. All raise
:class:`~clmerge.errors.OutputError` (exit 5) with one line naming the flag and the path.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

from ..errors import OutputError, clip

__all__ = ["check_writable", "check_output_dir", "check_not_input", "child", "slug", "MAX_NAME"]

#: The longest folder name :func:`slug` makes (file systems allow 255 bytes; room is left for suffixes).
MAX_NAME = 120
_SAFE = re.compile(r"[^A-Za-z0-9._+=-]")
_HASHED = re.compile(r"-h[0-9a-f]{12}$")


def check_writable(out: Path, flag: str = "--out") -> None:
    """Refuse ``out`` when it, or the folders it needs, cannot be created (a file in the way, no permission).

    Raises:
        OutputError: names ``flag``, ``out`` and the folder that blocks it.
    """
    out = Path(out)
    ancestors = [out, *out.absolute().parents]
    existing = next(p for p in ancestors if p.exists())
    if existing != out and not existing.is_dir():
        raise OutputError(f"{flag} {out}: {existing} is a file, not a folder")
    # an existing file is replaced by a rename in its folder: that folder must be writable
    target = existing.absolute().parent if existing == out and not out.is_dir() else existing
    if not os.access(target, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {out}: cannot write in {target} (permission denied)")


def check_not_input(out: Path, inputs: Iterable[Path], flag: str = "--out", *, inside_ok: bool = True) -> None:
    """Refuse an ``out`` that is an input, or holds one (inputs are never overwritten); with ``inside_ok=False``
    also one inside an input folder (a merge's output never goes into a model folder it reads)."""
    real = Path(out).resolve()
    for p in inputs:
        p = Path(p).resolve()
        if real == p or (p.is_relative_to(real) and (real.exists() or inside_ok)) or (
                not inside_ok and real.is_relative_to(p)):
            raise OutputError(f"{flag} {out}: is, contains or lies inside the input {p}; choose another path "
                              "(inputs are never overwritten)")


#: Weight formats clmerge reads but never writes: an ``--out`` with one of these suffixes is refused.
OTHER_WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".gguf", ".h5", ".onnx", ".npz", ".pkl")


def check_output_dir(out: Path, *, flag: str = "--out", inputs: Iterable[Path] = (), overwrite: bool = False,
                     ours: Iterable[str] = (), file_suffix: str | None = None, inside_inputs: bool = True) -> str:
    """The one output guard: refuse an output ``out`` that cannot hold a new result without destroying
    something. Returns ``"file"`` (``out`` ends in ``file_suffix``, where the command writes one file) or
    ``"folder"``.

    Args:
        out: the folder (or file) to be written (it may not exist yet).
        flag: the flag that named it (for the message).
        inputs: paths read by the command; ``out`` must not be or contain one.
        overwrite: allow an existing non-empty folder or file (``--overwrite``).
        ours: file names that mark a folder as clmerge's own output of this kind (writing there is allowed:
            e.g. a previous ``merge-bench`` result in the same folder).
        file_suffix: the suffix of a one-file output the command accepts (``.safetensors`` for ``merge``);
            other weight formats' suffixes are then refused.
        inside_inputs: allow ``out`` inside an input folder (``False`` for model merges).

    Raises:
        OutputError: one line naming ``flag`` and ``out``.
    """
    out = Path(out)
    check_not_input(out, inputs, flag, inside_ok=inside_inputs)
    kind = "folder"
    if file_suffix is not None:
        if out.suffix.lower() in OTHER_WEIGHT_SUFFIXES and not out.is_dir():
            raise OutputError(f"{flag} {out}: unsupported file suffix {out.suffix!r} (clmerge writes safetensors); "
                              f"give a folder or {out.with_suffix(file_suffix).name}")
        if out.suffix == file_suffix:
            kind = "file"
            if out.is_dir():
                raise OutputError(f"{flag} {out}: is a folder; give a new folder path or a {file_suffix} file name")
    if kind == "folder" and out.exists() and not out.is_dir():
        raise OutputError(f"{flag} {out}: exists and is not a folder")
    names = set(ours)
    if out.exists() and not overwrite and (kind == "file" or (any(out.iterdir()) and
                                                                not any((out / n).exists() for n in names))):
        raise OutputError(f"{flag} {out}: already exists and is not empty (pass --overwrite to write into it)")
    check_writable(out, flag)
    return kind


def child(folder: Path, name: str, *, flag: str = "--out") -> Path:
    """``folder / name``, a path to write inside a folder the command was handed, after refusing a ``name``
    that is not one plain component (``..``, a separator) or that exists as a symlink (or as anything but a
    regular file or folder): nothing is ever written through a link into another place.

    Raises:
        OutputError: naming the folder, the entry and what it is.
    """
    if name in ("", ".", "..") or "/" in name or os.sep in name or "\0" in name:
        raise OutputError(f"{flag} {folder}: {clip(repr(name), 60)} is not a plain file or folder name")
    path = Path(folder) / name
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise OutputError(f"{flag} {folder}: cannot check {name} ({exc.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise OutputError(f"{flag} {folder}: {name} is a symlink (to {clip(os.readlink(path), 80)}); clmerge does "
                          "not write through links: remove it or choose another folder")
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise OutputError(f"{flag} {folder}: {name} is not a regular file or folder; remove it")
    return path


def slug(value: object, max_len: int = MAX_NAME) -> str:
    """A safe folder name for ``value``: the value itself when it is already one (letters, digits, ``._+=-``,
    not starting with ``.``, at most ``max_len`` characters); otherwise its safe characters, cut, with ``-h``
    and 12 hex digits of its sha256 appended. Two different values never get one name: a changed or cut value
    always carries its hash, and a value that merely looks hashed is hashed again."""
    text = str(value)
    if (text and len(text) <= max_len and not _SAFE.search(text) and not text.startswith(".")
            and not _HASHED.search(text)):
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    keep = _SAFE.sub("_", text).lstrip(".")[: max_len - 15] or "v"
    return f"{keep}-h{digest}"
