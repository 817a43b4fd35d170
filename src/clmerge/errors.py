"""The user-facing error types of clmerge and their exit codes.

Every error a user can cause (a bad flag, value, config key, path or file, a run directory that cannot be
resumed, a training run that diverged) is raised as one of these. The command line prints its message as
one short line on stderr and exits with the class's code; the traceback is shown only with ``--debug`` or
``CLMERGE_DEBUG=1``. Library callers catch them like the built-in exceptions they also derive from.

Exit codes (distinct per kind, so scripts can tell them apart):
    2  UsageError       a bad flag, value or config key
    3  InputError       a missing or malformed input file, model, checkpoint or dataset
    4  RunStateError    a run directory that cannot be resumed, or a config that differs from the run's
    5  OutputError      an output path that cannot be written or would overwrite something
    6  TrainingError    training diverged (non-finite loss)
"""

from __future__ import annotations

import re

__all__ = ["clip", "ClmergeError", "UsageError", "InputError", "RunStateError", "OutputError", "TrainingError",
           "ConfigError", "ConfigFileError"]


class ClmergeError(Exception):
    """Base of every user-facing error; ``exit_code`` is what the command line exits with."""

    exit_code = 1


class UsageError(ClmergeError, ValueError):
    """A bad command-line flag, value or config key (the message names it)."""

    exit_code = 2


class InputError(ClmergeError, ValueError):
    """A missing or malformed input: file, model folder, checkpoint or dataset (the message names it)."""

    exit_code = 3


class ConfigError(UsageError):
    """A config problem, with the dotted key that caused it (a :class:`UsageError`: exit code 2)."""


class ConfigFileError(ConfigError, InputError):
    """A config / recipe / spec file that does not exist or is not a file: an input error (exit code 3),
    still caught as a :class:`ConfigError`."""

    exit_code = InputError.exit_code


class RunStateError(ClmergeError, RuntimeError):
    """A run directory that cannot be resumed as asked (no run there, missing or corrupt checkpoints, or a
    config that differs from the run's)."""

    exit_code = 4


class OutputError(ClmergeError, OSError):
    """An output path that cannot be written, or that would overwrite an input or a foreign file."""

    exit_code = 5


class TrainingError(ClmergeError, RuntimeError):
    """Training diverged (a non-finite loss); the message says at which task/step and what to try."""

    exit_code = 6


def clip(text: object, width: int = 120) -> str:
    """``text`` on one line, cut to ``width`` characters with an ellipsis: every message that echoes user
    input goes through it, so a huge value (a YAML alias bomb's expansion) never makes a huge message."""
    # line breaks and tabs become one space; runs of plain spaces stay (they may be part of a key's name)
    flat = re.sub(r"\s*[^\S ]\s*", " ", str(text)).strip()
    return flat if len(flat) <= width else flat[: width - 1] + "…"
