"""What ``--resume`` checks before it touches anything: that the directory holds a run, that the config is
the run's (and, if not, which keys differ), that ``events.jsonl`` is the one the checkpoint saw.

Every refusal is a :class:`~clmerge.engine.checkpoint.ResumeError` (a :class:`clmerge.errors.RunStateError`)
raised before the run directory is modified, so a refused ``--resume`` leaves the file system as it was.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..utils import inpaths
from ..utils.inpaths import read_bytes as read_input_bytes
from ..utils.inpaths import InputTooLarge
from ..utils.io import read_json, sha256_bytes
from ..utils.yaml_io import MAX_YAML_BYTES, YamlError, load_yaml
from .checkpoint import ResumeError

log = logging.getLogger("clmerge.engine")

__all__ = ["CONFIG_SHA_KEY", "check_resumable", "check_same_config", "recorded_config_sha256",
           "config_differences", "events_prefix", "events_sha256",
           "finished_tasks_in_events", "summarize_differences", "thread_history", "verify_events", "MAX_LISTED"]

RUN_FILES = ("config.yaml", "manifest.json")  # written when a run starts, before its first task
MAX_LISTED = 3  # differing keys shown in full in a refusal; the rest are counted
# Keys that say how a run computes, not what: a resume may change them (a thread count changes float
# rounding, so thread_history warns and records it; docs/threads.md).
HOW_KEYS = ("run.threads",)


def check_resumable(out: Path) -> None:
    """Refuse a ``--resume`` into ``out`` when it is no run directory (missing, a file, or lacking the files a
    run writes when it starts)."""
    out = Path(out)
    hint = "check the --out path, or drop --resume to start a new run"
    if not out.exists():
        raise ResumeError(f"{out}: no such run directory to resume; {hint}")
    if not out.is_dir():
        raise ResumeError(f"{out}: not a directory, so no run to resume; {hint}")
    missing = [name for name in RUN_FILES if not (out / name).is_file()]
    if missing:
        raise ResumeError(f"{out}: holds no clmerge run to resume (no {' or '.join(missing)}); {hint}")
    for name in (*RUN_FILES, "events.jsonl"):  # a run file is the run's own: a link out of the run is refused
        if os.path.lexists(out / name):
            _inside_run(out, name)


def _inside_run(out: Path, name: str) -> Path:
    """``out / name`` after checking that it resolves inside the run directory (a ResumeError if not)."""
    try:
        return inpaths.inside(out, name, str(out / name))
    except InputError as exc:
        raise ResumeError(f"{exc}; nothing was changed: restore the run's own file to resume") from None


CONFIG_SHA_KEY = "config_sha256"  # manifest.json: sha256 of the config.yaml written with it


def recorded_config_sha256(out: Path) -> str | None:
    """The sha256 of ``config.yaml`` that ``manifest.json`` recorded when the run (re)started; None for a run
    written before it was recorded (or an unreadable manifest: the checkpoint checks name that)."""
    try:
        manifest = read_json(Path(out) / "manifest.json", within=out)
    except (OSError, ValueError):
        return None
    sha = manifest.get(CONFIG_SHA_KEY) if isinstance(manifest, dict) else None
    return sha if isinstance(sha, str) else None


def check_same_config(cfg_file: Path, cfg_text: str, recorded_sha256: str | None = None) -> None:
    """Refuse when the run's stored config was edited since the run wrote it (its sha256 differs from
    ``recorded_sha256``: the checkpoints were made with another config), or differs from the given one,
    naming each differing key with both values (at most :data:`MAX_LISTED`, then a count)."""
    stored_text = _stored_config(cfg_file, recorded_sha256)
    if stored_text == cfg_text:
        return
    try:
        stored = load_yaml(stored_text, source=str(cfg_file)) or {}
    except YamlError as exc:
        raise ResumeError(f"{exc}; cannot check the config") from None
    given = load_yaml(cfg_text) or {}
    diffs = [d for d in config_differences(_with_new_defaults(stored, given), given)
             if d.split(":", 1)[0] not in HOW_KEYS]
    if not diffs:  # the same values written differently, or keys added since at their defaults
        return
    raise ResumeError(f"{cfg_file}: the run was started with a different config ({_count(diffs)} "
                      f"differ{'s' if len(diffs) == 1 else ''}); "
                      "resume with the same config or choose another --out\n" + summarize_differences(diffs))


def _stored_config(cfg_file: Path, recorded_sha256: str | None) -> str:
    try:  # the run's own file: a regular file inside the run directory, at most the YAML cap
        data = read_input_bytes(cfg_file, within=cfg_file.parent, kind="yaml", max_bytes=MAX_YAML_BYTES)
    except InputTooLarge:
        raise ResumeError(f"{cfg_file}: larger than {MAX_YAML_BYTES:,} bytes; not the config this run wrote") from None
    except InputError as exc:
        raise ResumeError(f"{exc}; cannot check the config: restore the run's own config.yaml to resume") from None
    if recorded_sha256 is not None and sha256_bytes(data) != recorded_sha256:
        raise ResumeError(f"{cfg_file}: edited since the run wrote it (its sha256 differs from manifest.json's "
                          f"{CONFIG_SHA_KEY}), so the checkpoints were made with another config; nothing was "
                          "changed: restore the file, or start a fresh run in another --out")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ResumeError(f"{cfg_file}: not UTF-8 text; cannot check the config") from None


def thread_history(manifest_file: Path, threads: int, task: int) -> dict:
    """The manifest's thread entries for a run resumed at ``task`` with ``threads`` torch threads.

    ``threads`` stays the count the run started with; a resume with another count warns once (float sums
    split over threads round differently, and a sensitive run can end elsewhere: docs/threads.md) and appends
    ``{"task": task, "threads": threads}`` to ``threads_resumed``. A run from before counts were recorded
    takes the current count without a warning.
    """
    try:
        stored = read_json(manifest_file, within=Path(manifest_file).parent)
    except (OSError, ValueError):
        stored = {}
    start, history = stored.get("threads"), list(stored.get("threads_resumed", []))
    if not isinstance(start, int):
        return {"threads": threads}
    last = history[-1]["threads"] if history else start
    if threads != last:
        log.warning("warning: resuming with %d torch threads, the run so far used %d: results can differ from "
                    "an uninterrupted run (docs/threads.md)", threads, last)
        history.append({"task": task, "threads": threads})
    return {"threads": start, **({"threads_resumed": history} if history else {})}


def summarize_differences(diffs: list[str]) -> str:
    """One line: the first :data:`MAX_LISTED` differences, then how many more."""
    more = len(diffs) - MAX_LISTED
    return "; ".join(diffs[:MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")


def _count(diffs: list[str]) -> str:
    return f"{len(diffs)} key{'s' if len(diffs) != 1 else ''}"


_ABSENT = object()


def _with_new_defaults(stored: Any, given: Any) -> Any:
    """``stored`` plus every key it lacks, taken from the defaults of the given config's method: a run started
    before a key existed (e.g. ``run.precision``) resumes when the given config keeps that key's default."""
    from ..config import dump_config, parse_config

    try:
        name = (given.get("method") or {}).get("name")
        defaults = load_yaml(dump_config(parse_config({"method": {"name": name}} if name else {})))
    except Exception:  # noqa: BLE001  (an unknown method: no defaults to fill in; the diff shows it)
        return stored
    return _fill(stored, defaults)


def _fill(stored: Any, defaults: Any) -> Any:
    if not (isinstance(stored, dict) and isinstance(defaults, dict)):
        return stored
    out = dict(stored)
    for key, value in defaults.items():
        out[key] = _fill(stored[key], value) if key in stored else value
    return out


def config_differences(stored: Any, given: Any, prefix: str = "") -> list[str]:
    """``["dotted.key: <stored> (run) != <given> (given)", ...]``, one per leaf where the configs differ."""
    if isinstance(stored, dict) and isinstance(given, dict):
        out: list[str] = []
        for key in list(stored) + [k for k in given if k not in stored]:
            out += config_differences(stored.get(key, _ABSENT), given.get(key, _ABSENT), f"{prefix}{key}.")
        return out
    if _same(stored, given):
        return []
    return [f"{prefix.rstrip('.')}: {_show(stored)} (run) != {_show(given)} (given)"]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b and isinstance(a, bool) == isinstance(b, bool)  # True == 1 in Python, not in a config


def _show(value: Any, width: int = 40) -> str:
    if value is _ABSENT:
        return "(absent)"
    text = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= width else text[: width - 1] + "…"


def _event_lines(events: Path) -> list[str]:
    """The lines of ``events.jsonl`` (kept ends); a file that is not UTF-8 text is refused, naming it."""
    try:  # the run's own log: inside the run directory, at most the JSON-lines cap
        data = read_input_bytes(events, within=events.parent, kind="jsonl")
    except InputError as exc:
        raise ResumeError(f"{exc}; nothing was changed: restore the run's own events.jsonl to resume") from None
    try:
        return data.decode("utf-8").splitlines(keepends=True)
    except UnicodeDecodeError as exc:
        raise ResumeError(f"{events}: not UTF-8 text (byte {exc.start}), so not the log this run wrote; nothing "
                          "was changed: restore it to resume") from None


def events_prefix(events: Path, n_lines: int) -> str | None:
    """The first ``n_lines`` lines of ``events.jsonl`` (None when the file is missing or shorter)."""
    if not events.is_file():
        return None if n_lines else ""
    lines = _event_lines(events)
    return "".join(lines[:n_lines]) if len(lines) >= n_lines else None


def events_sha256(events: Path, n_lines: int) -> str | None:
    """The sha256 of the first ``n_lines`` lines of ``events.jsonl`` (what a resume keeps), recorded in each
    checkpoint; None when the file has fewer lines (then nothing is checked on resume)."""
    prefix = events_prefix(events, n_lines)
    return None if prefix is None else sha256_bytes(prefix.encode())


def verify_events(events: Path, n_lines: int, expected_sha256: str | None) -> str:
    """The first ``n_lines`` lines of ``events.jsonl`` (what a resume keeps), checked against the sha256 the
    checkpoint recorded; without a record (older runs), whatever of them exists, as before.

    Raises:
        ResumeError: the file is missing, shorter than the checkpoint saw, or its first lines changed.
    """
    prefix = events_prefix(events, n_lines)
    if expected_sha256 is None:
        lines = _event_lines(events) if events.is_file() else []
        return "".join(lines[:n_lines])
    if prefix is None:
        raise ResumeError(f"{events}: missing or shorter than the {n_lines} lines the last checkpoint "
                            "recorded; nothing was changed: restore it to resume")
    if sha256_bytes(prefix.encode()) != expected_sha256:
        raise ResumeError(f"{events}: its first {n_lines} lines differ from the sha256 the last "
                            "checkpoint recorded; nothing was changed: restore it to resume")
    return prefix


def finished_tasks_in_events(events: Path) -> int:
    """How many ``task_end`` events ``events.jsonl`` holds (0 when missing); torn lines are skipped."""
    if not events.is_file():
        return 0
    count = 0
    for line in _event_lines(events):
        try:
            count += json.loads(line).get("event") == "task_end"
        except (json.JSONDecodeError, AttributeError):
            continue
    return count
