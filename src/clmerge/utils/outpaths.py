"""Checks of an output path made before any work, so a refused ``--out`` leaves nothing behind.

A careful CLI (git, cargo) refuses to write where it would destroy something it did not make, and says so
before it starts: :func:`check_writable` (can the path be created at all?) and :func:`check_output_dir`
(a new or empty folder, or one clmerge may write into) raise :class:`~clmerge.errors.OutputError` with a
one-line message naming the flag and the path.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from ..errors import OutputError

__all__ = ["check_writable", "check_output_dir", "check_not_input"]


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


def check_not_input(out: Path, inputs: Iterable[Path], flag: str = "--out") -> None:
    """Refuse an ``out`` that is an input, or holds one (inputs are never overwritten)."""
    real = Path(out).resolve()
    for p in inputs:
        p = Path(p).resolve()
        if real == p or p.is_relative_to(real):
            raise OutputError(f"{flag} {out}: is or contains the input {p}; choose another path")


def check_output_dir(out: Path, *, flag: str = "--out", inputs: Iterable[Path] = (), overwrite: bool = False,
                     ours: Iterable[str] = ()) -> None:
    """Refuse an output folder ``out`` that cannot hold a new result without destroying something.

    Args:
        out: the folder to be written (it may not exist yet).
        flag: the flag that named it (for the message).
        inputs: paths read by the command; ``out`` must not be or contain one.
        overwrite: allow an existing non-empty folder (``--overwrite``).
        ours: file names that mark a folder as clmerge's own output of this kind (writing there is allowed:
            e.g. a previous ``merge-bench`` result in the same folder).

    Raises:
        OutputError: one line naming ``flag`` and ``out``.
    """
    out = Path(out)
    check_not_input(out, inputs, flag)
    if out.exists() and not out.is_dir():
        raise OutputError(f"{flag} {out}: exists and is not a folder")
    names = set(ours)
    if out.is_dir() and not overwrite and any(out.iterdir()) and not any((out / n).exists() for n in names):
        raise OutputError(f"{flag} {out}: already exists and is not empty (pass --overwrite to write into it)")
    check_writable(out, flag)
