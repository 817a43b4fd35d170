"""What made an output: the clmerge version, the git commit of a source checkout, and the plugins imported.

Every merged model folder (its model card and ``clmerge_recipe.yaml``) and every continual run directory
(``manifest.json``) records :func:`provenance`. The plugins (``--plugin``) are imported here, from the bytes
whose sha256 is recorded (the file is read once, hashed, then compiled: what ran is what was hashed).

A run directory that recorded plugins has them imported again by :func:`open_run_plugins`, the one function
every command that opens a run directory calls (``export``, ``eval``, ``report``, ``run --resume``): one line
``loading plugin PATH (sha256 …)`` per plugin, and a refusal naming the file and both hashes when it changed
since the run, or naming it when it is gone. A plugin is code: importing it runs it with the user's rights
(docs/extending.md).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import InputError, RunStateError, clip
from ..version import VERSION
from . import inpaths

__all__ = ["PluginChanged", "PluginRecord", "git_commit", "load_plugin", "loaded_plugins", "open_run_plugins",
           "provenance", "short_sha"]

def _say(line: str) -> None:
    """One line on stderr (read at call time: a caller may have replaced ``sys.stderr``)."""
    print(line, file=sys.stderr, flush=True)

UNKNOWN = "unknown"


def _source_root() -> Path | None:
    """The repository root when clmerge runs from a source checkout (``<root>/src/clmerge``), else ``None``."""
    pkg = Path(__file__).resolve().parents[1]
    root = pkg.parents[1]
    if pkg.parent.name != "src" or not (root / "pyproject.toml").is_file() or not (root / ".git").exists():
        return None
    return root


def _git_dirs(root: Path) -> tuple[Path, Path]:
    """``(git dir, common dir)`` of the checkout at ``root`` (a worktree's ``.git`` is a file naming its dir)."""
    dot = root / ".git"
    if dot.is_file():
        text = inpaths.read_text(dot, kind="text").strip()
        if not text.startswith("gitdir:"):
            raise ValueError("not a gitdir file")
        gitdir = (root / text.split(":", 1)[1].strip()).resolve()
    else:
        gitdir = dot
    common = gitdir
    if (gitdir / "commondir").is_file():
        common = (gitdir / inpaths.read_text(gitdir / "commondir", kind="text").strip()).resolve()
    return gitdir, common


def _ref(gitdir: Path, common: Path, ref: str) -> str | None:
    for folder in (gitdir, common):
        if (folder / ref).is_file():
            return inpaths.read_text(folder / ref, kind="text").strip()
    if (common / "packed-refs").is_file():
        for line in inpaths.read_text(common / "packed-refs", kind="text").splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == ref:
                return parts[0]
    return None


@functools.cache
def git_commit() -> str:
    """The commit clmerge's source checkout is at (``HEAD``), read from the ``.git`` files (no ``git``
    process); ``"unknown"`` for an installed wheel or anything unreadable. Computed once per process.
    Uncommitted changes are not detected."""
    root = _source_root()
    if root is None:
        return UNKNOWN
    try:
        gitdir, common = _git_dirs(root)
        head = inpaths.read_text(gitdir / "HEAD", kind="text").strip()
        sha = _ref(gitdir, common, head.split(":", 1)[1].strip()) if head.startswith("ref:") else head
    except (OSError, ValueError):
        return UNKNOWN
    if sha is None or len(sha) not in (40, 64) or any(c not in "0123456789abcdef" for c in sha):
        return UNKNOWN
    return sha


def short_sha(sha: str, n: int = 16) -> str:
    """The first ``n`` hex digits of a sha256 (what one-line messages show)."""
    return sha[:n]


# --- plugins ---


@dataclass(frozen=True)
class PluginRecord:
    """One imported plugin: as given (``spec``: a path or a module name), its file and that file's sha256."""

    spec: str
    path: str
    sha256: str

    def as_dict(self) -> dict[str, str]:
        return {"plugin": self.spec, "path": self.path, "sha256": self.sha256}

    @property
    def is_file_spec(self) -> bool:
        return _is_path(self.spec)


# key (resolved path of a file plugin, or a module name) -> (record, module). A file imported twice in one
# process would register its names twice, so each is imported once.
_LOADED: dict[str, tuple[PluginRecord, ModuleType]] = {}


def loaded_plugins() -> list[dict[str, str]]:
    """The plugins imported in this process, in order: ``[{"plugin", "path", "sha256"}]`` (what a run's
    manifest and a merge's model card record)."""
    return [rec.as_dict() for rec, _ in _LOADED.values()]


def provenance() -> dict[str, Any]:
    """``{"clmerge_version", "clmerge_commit", "plugins"}`` of this process."""
    return {"clmerge_version": VERSION, "clmerge_commit": git_commit(), "plugins": loaded_plugins()}


def _is_path(spec: str) -> bool:
    return spec.endswith(".py") or "/" in spec or "\\" in spec


def _import_file(spec: str) -> tuple[PluginRecord, ModuleType]:
    path = Path(spec).expanduser().resolve()
    if str(path) in _LOADED:
        return _LOADED[str(path)]
    if not path.is_file():
        raise InputError(f"--plugin {spec}: no such file ({path}); give a .py file or an importable module name")
    source = inpaths.read_bytes(path, what=f"--plugin {spec}", kind="text")
    record = PluginRecord(spec, str(path), hashlib.sha256(source).hexdigest())
    name = f"clmerge_plugin_{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None:
        raise InputError(f"--plugin {spec}: not a Python module file (expected a .py file)")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pydantic models look their module up while it executes
    try:
        exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102  (the bytes that were hashed)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    _LOADED[str(path)] = (record, module)
    return record, module


def _import_name(spec: str) -> tuple[PluginRecord, ModuleType]:
    if spec in _LOADED:
        return _LOADED[spec]
    try:
        module = importlib.import_module(spec)
    except ModuleNotFoundError as exc:
        if exc.name is not None and spec.split(".")[0] != exc.name and not spec.startswith(exc.name + "."):
            raise  # a module the plugin itself imports is missing: reported as the plugin's failure
        raise InputError(f"--plugin {spec}: no module named {spec!r} on the Python path; give an importable "
                         "module name or a file path such as ./my_plugin.py") from exc
    file = getattr(module, "__file__", None)
    path = str(Path(file).resolve()) if file else ""
    digest = hashlib.sha256(inpaths.read_bytes(path, kind="text")).hexdigest() if file else ""
    record = PluginRecord(spec, path, digest)
    _LOADED[spec] = (record, module)
    return record, module


def _import(spec: str) -> tuple[PluginRecord, ModuleType]:
    """Import one plugin (each at most once per process); its failure is an :class:`InputError` naming it."""
    keep, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no __pycache__ beside the user's files
    try:
        return _import_file(spec) if _is_path(spec) else _import_name(spec)
    except InputError:
        raise
    except SystemExit as exc:  # sys.exit() in a plugin would end clmerge with the plugin's code, silently
        code = exc.code
        said = "no code" if code is None else clip(repr(code), 120)
        raise InputError(f"--plugin {spec}: the plugin called sys.exit ({said}) while it was imported; a "
                         "plugin must only define and register its names") from None
    except Exception as exc:  # noqa: BLE001  (the user's code: any failure is reported with the plugin's name)
        raise InputError(f"--plugin {spec}: importing it failed: {type(exc).__name__}: {exc}") from exc
    finally:
        sys.dont_write_bytecode = keep


def load_plugin(spec: str) -> ModuleType:
    """Import one plugin (a module name or a ``.py`` path), once per process, and record it (path, sha256)."""
    return _import(spec)[1]


# --- plugins recorded by a run directory ---


class PluginChanged(RunStateError):
    """A plugin a run recorded is gone or holds other code than when the run used it (exit code 4)."""


def _recorded(run_dir: Path) -> list[tuple[Path, dict]]:
    """``(manifest, record)`` of every plugin recorded by ``run_dir``'s ``manifest.json``, or, for a folder of
    runs (``--seeds``, ``--orders``), by its runs' manifests one level down."""
    if (run_dir / "manifest.json").is_file():
        manifests = [run_dir / "manifest.json"]
    elif run_dir.is_dir():
        manifests = sorted(p / "manifest.json" for p in run_dir.iterdir() if (p / "manifest.json").is_file())
    else:
        manifests = []
    found: list[tuple[Path, dict]] = []
    for m in manifests:
        try:
            data = inpaths.read_json(m, within=m.parent, what=f"{m.parent}: run file")
        except InputError:
            continue  # an unreadable manifest is named by the command's own checks
        plugins = data.get("plugins") if isinstance(data, dict) else None
        for rec in plugins if isinstance(plugins, list) else []:
            if isinstance(rec, dict) and isinstance(rec.get("sha256"), str) and isinstance(rec.get("path"), str):
                found.append((m, rec))
    return found


def _changed(run_dir: Path, path: str, recorded: str, now: str) -> PluginChanged:
    return PluginChanged(f"{run_dir}: plugin {path} changed since the run used it (sha256 {short_sha(recorded)} "
                         f"recorded, {short_sha(now)} now); restore the file the run used")


def _open_one(run_dir: Path, rec: dict, say: Callable[[str], None]) -> None:
    spec, path, want = str(rec.get("plugin") or rec["path"]), rec["path"], rec["sha256"]
    loaded = [rec for rec, _ in _LOADED.values()]  # already imported (--plugin, or an earlier run directory)
    if any(r.sha256 == want for r in loaded):
        return  # the same code, wherever it lies now
    for r in loaded:
        if r.path == path or (not _is_path(spec) and r.spec == spec):
            raise _changed(run_dir, path, want, r.sha256)
    if _is_path(spec) or not spec:
        if not Path(path).is_file():
            raise PluginChanged(f"{run_dir}: plugin {path} (sha256 {short_sha(want)}), which the run used, is gone; "
                                "restore it, or pass --plugin FILE holding the same code")
        now = hashlib.sha256(inpaths.read_bytes(path, kind="text")).hexdigest()
        if now != want:
            raise _changed(run_dir, path, want, now)
        say(f"loading plugin {path} (sha256 {short_sha(want)}), recorded by {run_dir}")
        record, _ = _import(path)
    else:
        say(f"loading plugin {spec} ({path}, sha256 {short_sha(want)}), recorded by {run_dir}")
        record, _ = _import(spec)
    if record.sha256 != want:  # changed between the check and the import, or a module of another file
        raise _changed(run_dir, record.path or path, want, record.sha256)


def open_run_plugins(run_dir: str | Path, *, say: Callable[[str], None] | None = None) -> list[dict]:
    """Import the plugins a run directory recorded (``manifest.json`` ``"plugins"``), each checked first.

    The one call of every command that opens a run directory (``export``, ``eval``, ``report``, ``run
    --resume``). A plugin already imported in this process with the recorded sha256 (``--plugin``, also from
    another path) is used as it is; otherwise the recorded file is hashed, one line ``loading plugin PATH
    (sha256 …)`` is said, and it is imported. A run without recorded plugins (or written before runs recorded
    them) imports nothing.

    Args:
        say: receives the one line per plugin imported (default: stderr).

    Returns:
        The recorded plugins (``{"plugin", "path", "sha256"}``).

    Raises:
        PluginChanged: a recorded plugin is gone (names it) or holds other code (names it and both hashes);
            nothing was imported from it.
    """
    run_dir = Path(run_dir)
    say = _say if say is None else say
    records = _recorded(run_dir)
    seen: set[str] = set()
    for manifest, rec in records:
        if rec["sha256"] in seen:
            continue
        seen.add(rec["sha256"])
        _open_one(manifest.parent, rec, say)
    return [rec for _, rec in records]


def forget_plugins(keys: Iterable[str] | None = None) -> dict[str, tuple[PluginRecord, ModuleType]]:
    """Drop plugins from this process's record (all when ``keys`` is None); returns what was dropped (tests
    restore it with :func:`restore_plugins`). Their registered names stay registered."""
    keys = list(_LOADED) if keys is None else list(keys)
    return {k: _LOADED.pop(k) for k in keys if k in _LOADED}


def restore_plugins(saved: dict[str, tuple[PluginRecord, ModuleType]]) -> None:
    _LOADED.update(saved)
