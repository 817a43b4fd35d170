"""Per-task checkpoints (atomic safetensors with a recorded sha256) and the run-directory lock.

``checkpoints/task_NNN.safetensors`` holds the model state (``model/`` prefix), the method's tensors
(``method/`` prefix) and, as JSON metadata, the model structure, the method's metadata and the evaluation
rows so far. A resumed run rebuilds the structure, loads the tensors and starts at task NNN + 1.

Integrity: ``manifest.json`` keeps ``"checkpoints": {file name: sha256}``. A checkpoint is written first
(atomically), then recorded (the manifest is rewritten atomically), then older ones are pruned; so the record
is the commit point: a file that is not recorded (a run killed between the two writes) is ignored by resume,
and a recorded file that is missing or whose bytes no longer hash to the record is refused with its name.
Runs written before hashes were recorded (no ``"checkpoints"`` key) load with a one-line warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import ClmergeError, RunStateError, clip
from ..utils import inpaths
from ..utils.inpaths import read_bytes as read_input_bytes, read_text as read_input_text
from ..utils.procs import pid_alive
from ..utils.io import read_json, save_tensors, sha256_bytes, sha256_file, write_json

__all__ = ["save_checkpoint", "latest_checkpoint", "load_checkpoint", "load_head_tensors", "RunLock",
           "lock_holder", "checkpoint_contents", "checkpoint_record", "resume_checkpoint", "verify_sha256",
           "CheckpointIntegrityError", "ResumeError"]

_NAME = re.compile(r"^task_(\d{3,})\.safetensors$")
RECORD_KEY = "checkpoints"  # the manifest key that holds {checkpoint file name: sha256}
log = logging.getLogger("clmerge.engine")


class ResumeError(RunStateError, ValueError):
    """A run (or study) directory that cannot be resumed as asked; also a ValueError, so callers that catch
    bad input keep working."""


class CheckpointIntegrityError(ResumeError):
    """A checkpoint or state file that is missing, unreadable or does not match its recorded sha256."""


def save_checkpoint(run_dir: Path, task: int, model_state: dict[str, torch.Tensor],
                    method_tensors: dict[str, torch.Tensor], meta: dict, keep: int = 1,
                    head_tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``task_NNN.safetensors`` atomically, record its sha256 in ``manifest.json``, then delete all but
    the newest ``keep`` checkpoints.

    ``head_tensors`` (the head suite's statistics, ``engine.heads``) are stored under the ``head/`` prefix."""
    run_dir = Path(run_dir)
    ckdir = run_dir / "checkpoints"
    tensors = {f"model/{k}": v for k, v in model_state.items()}
    tensors.update({f"method/{k}": v for k, v in method_tensors.items()})
    tensors.update({f"head/{k}": v.contiguous() for k, v in (head_tensors or {}).items()})
    path = ckdir / f"task_{task:03d}.safetensors"
    sha = save_tensors(path, tensors, metadata={"clmerge": json.dumps(meta)})
    on_disk = [p for _, p in _numbered(ckdir)]
    stale = [p for p in on_disk if p != path][: max(0, len(on_disk) - keep)]
    record = {k: v for k, v in (checkpoint_record(run_dir) or {}).items() if k not in {p.name for p in stale}}
    record[path.name] = sha
    _write_record(run_dir, record)  # the commit point: only now does resume see this checkpoint
    for old in stale:
        old.unlink(missing_ok=True)
    return path


def _numbered(ckdir: Path) -> list[tuple[int, Path]]:
    if not ckdir.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in ckdir.iterdir() if (m := _NAME.match(p.name)))


def _write_record(run_dir: Path, record: dict[str, str]) -> None:
    manifest_path = run_dir / "manifest.json"
    manifest = _read_manifest(run_dir) if manifest_path.is_file() else {}
    manifest[RECORD_KEY] = dict(sorted(record.items()))
    write_json(manifest_path, manifest)


def _read_manifest(run_dir: Path) -> dict:
    path = Path(run_dir) / "manifest.json"
    try:
        manifest = read_json(path, within=Path(run_dir))
    except (ValueError, OSError) as exc:
        raise CheckpointIntegrityError(f"{path}: unreadable ({exc})") from None
    if not isinstance(manifest, dict):
        raise CheckpointIntegrityError(f"{path}: not a JSON object")
    return manifest


def checkpoint_record(run_dir: Path) -> dict[str, str] | None:
    """``{checkpoint file name: sha256}`` from ``manifest.json``; None for a run written before checkpoints
    were hashed (or with no manifest)."""
    if not (Path(run_dir) / "manifest.json").is_file():
        return None
    record = _read_manifest(run_dir).get(RECORD_KEY)
    if record is None:
        return None
    if not isinstance(record, dict) or not all(isinstance(v, str) for v in record.values()):
        raise CheckpointIntegrityError(f"{Path(run_dir) / 'manifest.json'}: {RECORD_KEY!r} is not a "
                                       "{file: sha256} mapping")
    return record


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint: the newest recorded one, or (runs without a record) the newest on disk."""
    record = checkpoint_record(run_dir)
    found = _numbered(Path(run_dir) / "checkpoints")
    if record is not None:
        found = [(n, p) for n, p in found if p.name in record]
    return found[-1][1] if found else None


def resume_checkpoint(run_dir: Path) -> tuple[Path | None, str | None]:
    """``(checkpoint to resume from, its recorded sha256)``; ``(None, None)`` when no task was recorded.

    Raises:
        CheckpointIntegrityError: the newest recorded checkpoint is missing (every missing one is named).
    """
    run_dir = Path(run_dir)
    record = checkpoint_record(run_dir)
    if record is None:  # a run from before checkpoints were hashed
        ck = latest_checkpoint(run_dir)
        if ck is not None:
            log.warning("warning: %s has no recorded sha256 (written by an older clmerge); loading it "
                        "unverified", ck)
        return ck, None
    named = sorted((int(m.group(1)), n) for n in record if (m := _NAME.match(n)))
    if not named:
        return None, None
    newest = run_dir / "checkpoints" / named[-1][1]
    if not newest.is_file():
        missing = [f"checkpoints/{n}" for _, n in named if not (run_dir / "checkpoints" / n).is_file()]
        raise CheckpointIntegrityError(
            f"{run_dir}: missing {', '.join(missing)} (recorded in manifest.json); nothing was changed: "
            "restore the file(s) to resume, or start a fresh run in another --out")
    return newest, record[named[-1][1]]


def verify_sha256(path: Path, expected: str | None, what: str = "checkpoint", *, data: bytes | None = None,
                  hint: str = "restore it or start a fresh run") -> None:
    """Refuse ``path`` (or its bytes ``data``, already read) when its sha256 differs from ``expected``
    (None: nothing recorded, nothing to check)."""
    if expected is None:
        return
    if data is None and not Path(path).is_file():
        raise CheckpointIntegrityError(f"{path}: missing {what}")
    actual = sha256_bytes(data) if data is not None else sha256_file(path)
    if actual != expected:
        raise CheckpointIntegrityError(f"{path}: sha256 mismatch ({actual[:12]}… on disk, {expected[:12]}… "
                                       f"recorded): the {what} is corrupt; {hint}")


def load_checkpoint(path: Path, sha256: str | None = None) -> tuple[dict[str, torch.Tensor],
                                                                     dict[str, torch.Tensor], dict]:
    """Return (model_state, method_tensors, meta); with ``sha256``, the file is verified first."""
    verify_sha256(path, sha256)
    parts, meta = _load_parts(path)
    return parts["model"], parts["method"], meta


def load_head_tensors(path: Path, sha256: str | None = None) -> dict[str, torch.Tensor]:
    """The head suite's tensors (``head/`` prefix) of a checkpoint; empty for runs without feature heads."""
    verify_sha256(path, sha256)
    return _load_parts(path)[0]["head"]


def _load_parts(path: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    try:  # the run's own file: a regular file inside its checkpoints folder, read as the file checked
        with inpaths.checked_path(path, within=Path(path).parent) as real, safe_open(real, framework="pt") as fh:
            meta = json.loads((fh.metadata() or {})["clmerge"])
            parts: dict[str, dict[str, torch.Tensor]] = {"model": {}, "method": {}, "head": {}}
            for key in fh.keys():
                prefix, _, name = key.partition("/")
                parts[prefix if prefix in ("model", "head") else "method"][name] = fh.get_tensor(key)
    except Exception as exc:  # safetensors and json raise several types for a torn or foreign file
        raise CheckpointIntegrityError(f"{path}: unreadable checkpoint ({clip(exc, 160)})") from exc
    if not isinstance(meta, dict) or not isinstance(meta.get("task"), int):
        raise CheckpointIntegrityError(f"{path}: not a clmerge checkpoint (its metadata has no task number)")
    return parts, meta


@contextlib.contextmanager
def checkpoint_contents(path: Path) -> Iterator[None]:
    """Report a checkpoint whose contents do not fit the run (metadata keys missing or of the wrong type,
    tensors of another model) as a :class:`CheckpointIntegrityError` naming it, not a traceback."""
    try:
        yield
    except ClmergeError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as exc:
        what = f"{type(exc).__name__}: {clip(exc, 160)}"
        raise CheckpointIntegrityError(f"{path}: its contents do not fit this run ({what}); restore it or start "
                                       "a fresh run in another --out") from exc


class RunLock:
    """A lock file naming its owner (pid, host, boot id and the process's start time), so two runs never write
    into one directory at once, and a lock left by a dead run (or one whose pid was since reused by another
    process) is recognised as stale.

    A refusal raised under the lock (a :class:`RunStateError`: every ``--resume`` check) leaves the directory
    as it was: a stale lock that was replaced is put back, byte for byte and with its time stamps.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / ".lock"
        self._stale: tuple[bytes, os.stat_result] | None = None

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(8):  # each pass either takes the lock, refuses, or clears one stale lock
            if self._claim():
                return self
            holder = lock_holder(self.path)
            if holder is not None:
                raise self._in_use(holder)
            self._clear_stale()
        raise RunStateError(f"could not take the lock {self.path}: other runs keep claiming it; retry")

    def _in_use(self, holder: str) -> RunStateError:
        return RunStateError(f"{self.path.parent} is in use by {holder} (its {self.path.name}); wait for it to "
                             f"finish or choose another --out")

    def _claim(self) -> bool:
        """Create the lock file with its full record in one step: the record is written to a private file,
        then hard-linked to ``.lock``, which fails when the name exists. Two runs that start together can
        therefore never both hold the lock, and nobody ever reads a half-written record."""
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(_lock_record(os.getpid())))
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def _clear_stale(self) -> None:
        """Move a stale lock aside (a rename succeeds for one claimant only), keeping its bytes for __exit__.
        If what was moved turns out to be a live run's lock (it replaced the stale one in between), put it
        back and refuse."""
        aside = self.path.with_name(f"{self.path.name}.{os.getpid()}.stale")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another run cleared it first; try to claim again
        holder = lock_holder(aside)
        if holder is not None:
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
            aside.unlink(missing_ok=True)
            raise self._in_use(holder)
        if self._stale is None:
            self._stale = (read_input_bytes(aside, within=aside.parent, kind="text"), aside.stat())
        aside.unlink(missing_ok=True)

    def __exit__(self, exc_type, *exc) -> None:
        if self._stale is not None and exc_type is not None and issubclass(exc_type, RunStateError):
            data, st = self._stale
            self.path.write_bytes(data)
            os.utime(self.path, ns=(st.st_atime_ns, st.st_mtime_ns))
            return
        self.path.unlink(missing_ok=True)


def _boot_id() -> str | None:
    try:
        return read_input_text("/proc/sys/kernel/random/boot_id", kind="text").strip()
    except (OSError, ValueError):  # no /proc (InputMissing is an OSError), or not a readable file
        return None


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (Linux ``/proc/PID/stat`` field 22); None elsewhere."""
    try:
        stat = read_input_text(f"/proc/{pid}/stat", kind="text")
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _lock_record(pid: int) -> dict:
    return {"pid": pid, "host": platform.node(), "boot_id": _boot_id(), "start_ticks": _start_ticks(pid)}


def lock_holder(path: Path) -> str | None:
    """Who holds the lock file ``path`` (``"process 123 on host"``), or None when it is stale: its process is
    gone, the machine rebooted since, or its pid now belongs to a process started later (a reused pid).

    A lock from another host cannot be checked from here and counts as held; one written by an older clmerge
    (a bare pid) is held while that pid runs a process started before the lock was written."""
    try:
        text = read_input_text(path, within=Path(path).parent, kind="text", errors="replace").strip()
    except (OSError, ClmergeError):  # gone, or not a file clmerge wrote: no owner to wait for
        return None
    try:
        rec = json.loads(text) if text.startswith("{") else {"pid": int(text or 0)}
        pid = int(rec.get("pid") or 0)
    except (ValueError, TypeError, AttributeError):
        return None  # unreadable: no owner to wait for
    if not pid or pid == os.getpid():
        return None
    host = rec.get("host")
    if host and host != platform.node():
        return f"process {pid} on {host}"
    if rec.get("boot_id") and rec["boot_id"] != _boot_id() or not pid_alive(pid):
        return None
    now = _start_ticks(pid)
    if rec.get("start_ticks") is not None and now is not None:
        return f"process {pid}" if now == rec["start_ticks"] else None
    return None if _started_after(pid, path) else f"process {pid}"


def _started_after(pid: int, path: Path) -> bool:
    """Whether process ``pid`` started after ``path`` was last written (so it did not write it); Linux only."""
    ticks = _start_ticks(pid)
    try:
        btime = next(int(ln.split()[1]) for ln in read_input_text("/proc/stat", kind="text").splitlines()
                     if ln.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return False
    if ticks is None:
        return False
    return btime + ticks / os.sysconf("SC_CLK_TCK") > path.stat().st_mtime + 1.0


