"""Processes: whether a process id still names a running process (the one pid check of clmerge)."""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs: this process, or one that signal 0 reaches or that belongs to another
    user (``PermissionError``). A pid out of range (``OverflowError``) or gone (``ProcessLookupError``) is not."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except OSError:  # another user's process
        return True
    return True
