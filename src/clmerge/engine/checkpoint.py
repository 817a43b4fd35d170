"""Per-task checkpoints (atomic safetensors) and the run-directory lock.

``checkpoints/task_NNN.safetensors`` holds the model state (``model/`` prefix), the method's tensors
(``method/`` prefix) and, as JSON metadata, the model structure, the method's metadata and the evaluation
rows so far. A resumed run rebuilds the structure, loads the tensors and starts at task NNN + 1.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..utils.io import save_tensors

__all__ = ["save_checkpoint", "latest_checkpoint", "load_checkpoint", "load_head_tensors", "RunLock"]

_NAME = re.compile(r"^task_(\d{3,})\.safetensors$")


def save_checkpoint(run_dir: Path, task: int, model_state: dict[str, torch.Tensor],
                    method_tensors: dict[str, torch.Tensor], meta: dict, keep: int = 1,
                    head_tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``task_NNN.safetensors`` atomically, then delete all but the newest ``keep`` checkpoints.

    ``head_tensors`` (the head suite's statistics, ``engine.heads``) are stored under the ``head/`` prefix."""
    ckdir = Path(run_dir) / "checkpoints"
    tensors = {f"model/{k}": v for k, v in model_state.items()}
    tensors.update({f"method/{k}": v for k, v in method_tensors.items()})
    tensors.update({f"head/{k}": v.contiguous() for k, v in (head_tensors or {}).items()})
    path = ckdir / f"task_{task:03d}.safetensors"
    save_tensors(path, tensors, metadata={"clmerge": json.dumps(meta)})
    for old in sorted(p for p in ckdir.iterdir() if _NAME.match(p.name))[:-keep]:
        old.unlink()
    return path


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckdir = Path(run_dir) / "checkpoints"
    if not ckdir.is_dir():
        return None
    found = sorted((int(m.group(1)), p) for p in ckdir.iterdir() if (m := _NAME.match(p.name)))
    return found[-1][1] if found else None


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """Return (model_state, method_tensors, meta)."""
    parts, meta = _load_parts(path)
    return parts["model"], parts["method"], meta


def load_head_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The head suite's tensors (``head/`` prefix) of a checkpoint; empty for runs without feature heads."""
    return _load_parts(path)[0]["head"]


def _load_parts(path: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = json.loads((fh.metadata() or {})["clmerge"])
            parts: dict[str, dict[str, torch.Tensor]] = {"model": {}, "method": {}, "head": {}}
            for key in fh.keys():
                prefix, _, name = key.partition("/")
                parts[prefix if prefix in ("model", "head") else "method"][name] = fh.get_tensor(key)
    except (KeyError, json.JSONDecodeError, OSError, Exception) as exc:
        raise ValueError(f"{path}: unreadable checkpoint ({exc})") from exc
    return parts, meta


class RunLock:
    """A lock file holding the owner's pid, so two runs never write into one directory at once."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / ".lock"

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            try:
                pid = int(self.path.read_text().strip() or 0)
            except ValueError:
                pid = 0
            if pid and pid != os.getpid() and _alive(pid):
                raise RuntimeError(f"{self.path.parent} is in use by process {pid}; choose another --out")
        self.path.write_text(str(os.getpid()))
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
