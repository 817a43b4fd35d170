"""The input boundary: every file clmerge reads from a folder it was handed, or by a name found inside a file.

One module decides whether an input path may be read, for every command (``merge``, ``eval``, ``report``,
``results``, ``sweep``, ``moe``, ``export``, ``run --resume`` and whatever comes next). Three rules:

1. **Containment.** A path named inside a folder (a shard index's ``weight_map`` entry, a tokenizer or config
   file, a run directory's ``metrics.json``, a sweep's cell) is resolved, symlinks followed, and refused unless
   the result lies inside the resolved folder. A symlink that stays inside is followed; one that leads out
   (``../x``, an absolute path, a link to ``/etc/passwd``) is refused, naming the entry and its target.
   One exception keeps Hugging Face's cache working: a hub snapshot (``models--org--name/snapshots/<rev>/``)
   holds symlinks into the same repository's ``blobs/``, so for such a folder the repository's cache folder is
   the boundary.
2. **Only regular files, never whole when huge.** A FIFO, a device, a socket or a folder where a file is
   expected is refused by name (a FIFO is opened non-blocking, so it cannot hang the command). A symlink loop is
   refused by name. Every read is capped (:data:`LIMITS`): a 3 GiB ``config.json`` is refused from its size
   before a byte is read, and a file that grows or lies about its size is never read past the cap.
3. **Check and open are one step.** :func:`open_input` opens the file first and then checks what it opened
   (the descriptor's real path and its ``fstat``), so nothing can be swapped in between the check and the
   read. Readers that need a path (``safetensors``, ``torch.load``) get ``/proc/self/fd/N`` of the checked
   descriptor from :func:`checked_path`.

Paths the user typed (``--base``, a recipe's models, ``--out`` of ``report``) are the user's own choice: they
are not contained (``within=None``), but rules 2 and 3 still hold. An architecture test
(``tests/test_input_boundary.py``) fails when code outside this module opens a file
directly (``open``, ``read_text``, ``read_bytes``, ``json.load``, ``safe_open``, ``load_file``, ``torch.load``,
YAML loads), so a new command cannot forget the boundary.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from ..errors import InputError, clip

__all__ = ["LIMITS", "InputMissing", "InputTooLarge", "boundary", "inside", "open_input", "read_bytes",
           "read_text", "read_json", "loads_json", "read_jsonl_lines", "checked_path", "real_subdirs"]

MiB = 1 << 20
#: Size caps per kind of file (bytes). Documented in docs/cli_errors.md; a file over its cap is an input error.
LIMITS: dict[str, int] = {
    "json": 64 * MiB,  # config.json, metrics.json, manifest.json, shard indexes, adapter configs
    "yaml": 1 * MiB,  # configs, recipes, sweep and study specs (utils.yaml_io)
    "tokenizer": 256 * MiB,  # tokenizer.json, vocab files, sentencepiece models
    "jsonl": 256 * MiB,  # events.jsonl, a study's results.jsonl, eval texts
    "text": 64 * MiB,  # logs, text data, small list files of a dataset
    "data": 16 * 1024 * MiB,  # a dataset's array or batch file (IDX, CIFAR batches, token arrays)
}


class InputMissing(InputError, FileNotFoundError):
    """An input path that does not exist (an :class:`InputError` that is also a ``FileNotFoundError``)."""


class InputTooLarge(InputError):
    """An input file over its size cap (:data:`LIMITS`)."""


def boundary(folder: str | Path) -> Path:
    """The resolved folder whose inside ``folder``'s entries must stay in (a hub snapshot: its repository)."""
    real = _resolve(Path(folder), str(folder))
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent
    return real


def _resolve(path: Path, what: str) -> Path:
    try:
        return path.resolve(strict=False)
    except RuntimeError:  # Python < 3.13 raises RuntimeError on a loop
        raise InputError(f"{what}: symlink loop at {path}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InputError(f"{what}: symlink loop at {path}") from None
        raise


def _contained(real: Path, folder: Path, entry: str | Path, what: str) -> None:
    root = boundary(folder)
    if not real.is_relative_to(root) or real == root:
        raise InputError(f"{what} -> {clip(entry, 80)}: points outside {folder} (resolves to {clip(real, 120)}); "
                         "clmerge reads only files inside the folder given to it")


def inside(folder: str | Path, entry: str | Path, what: str) -> Path:
    """``folder / entry``, after checking that it resolves (symlinks followed) inside ``folder``.

    Use it to *name* a path; to read the file, use :func:`open_input` (which checks the opened file itself).

    Raises:
        InputError: the entry points outside the folder (message: the entry, where it points, the folder),
            or the path is a symlink loop.
    """
    folder = Path(folder)
    path = folder / entry
    _contained(_resolve(path, what), folder, entry, what)
    return path


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _say(what: str | None, path: Path, problem: str) -> str:
    """``what: path problem``, without naming the path twice when ``what`` is the path."""
    return f"{path}: {problem}" if what in (None, str(path)) else f"{what}: {path} {problem}"


def _open_fd(path: Path, what: str | None) -> int:
    try:
        # O_NONBLOCK: opening a FIFO for reading must not wait for a writer; it is refused after fstat
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise InputMissing(_say(what, path, "no such file")) from None
    except IsADirectoryError:
        raise InputError(_say(what, path, "is a folder, not a file")) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InputError(_say(what, path, "is a symlink loop")) from None
        if exc.errno == errno.ENOTDIR:
            raise InputMissing(_say(what, path, "no such file (a part of the path is a file)")) from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise InputError(_say(what, path, "cannot be read (permission denied)")) from None
        raise


def _fd_real(fd: int, path: Path) -> Path:
    """The real path of an open descriptor (Linux: its /proc link; elsewhere the resolved path, checked to be
    the same file as the descriptor)."""
    link = f"/proc/self/fd/{fd}"
    try:
        return Path(os.readlink(link))
    except OSError:
        real = path.resolve()
        if not os.path.samestat(os.stat(real), os.fstat(fd)):
            raise InputError(f"{path}: changed while it was being opened") from None
        return real


@contextlib.contextmanager
def _checked_fd(path: str | Path, *, within: str | Path | None, what: str | None, kind: str,
                max_bytes: int | None) -> Iterator[tuple[int, int]]:
    """Open ``path``, then check the opened file: regular, inside ``within``, at most the cap. Yields
    ``(fd, cap)``; the descriptor is closed on exit."""
    path = Path(path)
    cap = LIMITS[kind] if max_bytes is None else max_bytes
    fd = _open_fd(path, what)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(_say(what, path, f"is {_kind(st.st_mode)}, not a file"))
        if within is not None:
            entry = path.relative_to(within) if path.is_relative_to(within) else path
            _contained(_fd_real(fd, path), Path(within), entry, what or str(path))
        if st.st_size > cap:
            raise InputTooLarge(_say(what, path, f"is {st.st_size:,} bytes, over the {cap:,}-byte limit for a "
                                                 f"{kind} file (docs/cli_errors.md)"))
        os.set_blocking(fd, True)
        yield fd, cap
    finally:
        os.close(fd)


@contextlib.contextmanager
def open_input(path: str | Path, *, within: str | Path | None = None, what: str | None = None,
               kind: str = "json", max_bytes: int | None = None) -> Iterator[IO[bytes]]:
    """Open an input file for reading (binary), checked in one step: the opened file is regular, lies inside
    ``within`` (when given) and is at most the cap of its ``kind`` (:data:`LIMITS`) or ``max_bytes``.

    Raises:
        InputMissing: no such file.
        InputTooLarge: over the cap.
        InputError: outside ``within``, a symlink loop, a FIFO / device / folder, or unreadable.
    """
    with _checked_fd(path, within=within, what=what, kind=kind, max_bytes=max_bytes) as (fd, _):
        fh = os.fdopen(os.dup(fd), "rb")
        with fh:
            yield fh


def read_bytes(path: str | Path, *, within: str | Path | None = None, what: str | None = None,
               kind: str = "json", max_bytes: int | None = None) -> bytes:
    """The bytes of an input file, read through :func:`open_input` (never more than the cap)."""
    with _checked_fd(path, within=within, what=what, kind=kind, max_bytes=max_bytes) as (fd, cap):
        chunks, total = [], 0
        while block := os.read(fd, min(cap + 1 - total, 1 << 24) or 1):
            chunks.append(block)
            total += len(block)
            if total > cap:  # grew, or lied about its size (a /proc file, a file being appended to)
                raise InputTooLarge(_say(what, path, f"holds more than the {cap:,}-byte limit for a {kind} file"))
        return b"".join(chunks)


def read_text(path: str | Path, *, within: str | Path | None = None, what: str | None = None,
              kind: str = "text", max_bytes: int | None = None, errors: str = "strict") -> str:
    """The UTF-8 text of an input file (see :func:`read_bytes`); not UTF-8 is an :class:`InputError`."""
    data = read_bytes(path, within=within, what=what, kind=kind, max_bytes=max_bytes)
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as exc:
        raise InputError(f"{what or path}: not UTF-8 text (byte {exc.start})") from None


def _strict_float(token: str) -> float:
    raise ValueError(f"{token} is not a JSON number")


def read_json(path: str | Path, *, within: str | Path | None = None, what: str | None = None,
              kind: str = "json", max_bytes: int | None = None, strict: bool = False) -> Any:
    """The JSON in an input file. Invalid UTF-8 or JSON is an :class:`InputError` naming the file; with
    ``strict``, so are ``NaN``/``Infinity`` (Python writes them, JSON has no such numbers)."""
    data = read_bytes(path, within=within, what=what, kind=kind, max_bytes=max_bytes)
    return loads_json(data, what or str(path), strict=strict)


def loads_json(data: bytes | str, source: str, *, strict: bool = False) -> Any:
    """Parse JSON text read from ``source`` (``strict``: no ``NaN``/``Infinity``); errors name ``source``."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return json.loads(text, parse_constant=_strict_float) if strict else json.loads(text)
    except UnicodeDecodeError as exc:
        raise InputError(f"{source}: not UTF-8 text (byte {exc.start})") from None
    except RecursionError:
        raise InputError(f"{source}: not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, and the constants refused above
        raise InputError(f"{source}: not valid JSON ({clip(exc, 160)})") from None


def read_jsonl_lines(path: str | Path, *, within: str | Path | None = None, what: str | None = None,
                     max_bytes: int | None = None) -> list[str]:
    """The lines of a JSON-lines file (``events.jsonl``), decoded with replacement for a torn last line."""
    return read_text(path, within=within, what=what, kind="jsonl", max_bytes=max_bytes,
                     errors="replace").splitlines()


@contextlib.contextmanager
def checked_path(path: str | Path, *, within: str | Path | None = None, what: str | None = None,
                 max_bytes: int | None = None) -> Iterator[str]:
    """A path to hand to a reader that opens files itself (``safetensors``, ``torch.load``), naming exactly the
    file that was checked: ``/proc/self/fd/N`` of the checked descriptor while it is held open (the checked path
    itself where ``/proc`` is missing). Weights files have no size cap unless ``max_bytes`` is given."""
    cap = (1 << 62) if max_bytes is None else max_bytes
    with _checked_fd(path, within=within, what=what, kind="json", max_bytes=cap) as (fd, _):
        proc = f"/proc/self/fd/{fd}"
        yield proc if os.path.exists(proc) else str(path)


def real_subdirs(folder: str | Path) -> tuple[list[Path], list[Path]]:
    """The sub-folders of ``folder`` that are real folders (sorted), and the entries skipped because they are
    symlinks (to anything) or not folders. A symlink loop or a link out of ``folder`` is skipped, never followed.
    """
    kept, links = [], []
    for p in sorted(Path(folder).iterdir()):
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if stat.S_ISLNK(st.st_mode):
            links.append(p)
        elif stat.S_ISDIR(st.st_mode):
            kept.append(p)
    return kept, links
