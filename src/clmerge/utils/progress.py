"""Progress output for long loops: tqdm bars on a terminal, one plain line per unit of work otherwise.

A bar redraws itself with cursor-movement codes (``\\x1b[A``); piped into a file or a CI log those codes pile
up into hundreds of unreadable lines. So every loop in clmerge asks this module instead of calling tqdm:

- ``enabled`` false (``run.progress: false``): nothing at all;
- stderr is a terminal (or the loop runs in a Jupyter notebook): tqdm bars, as before;
- stderr is anything else (a file, a pipe, pytest's capture): no bars, and :meth:`Progress.line` writes one
  plain line per epoch or task, e.g. ``task 2/5 epoch 3/5 loss 0.412 (12.3 s)``.

``sys.stderr`` is looked up at each call, not at import, so redirecting it (tests, ``contextlib``) works.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

__all__ = ["Progress", "progress_mode", "stderr_is_terminal"]


def stderr_is_terminal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default: the current ``sys.stderr``) is an interactive terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _in_notebook() -> bool:
    """A Jupyter kernel: its stderr is no terminal, but it renders tqdm.auto's widget bars."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def progress_mode(enabled: bool, stream: TextIO | None = None) -> str:
    """``"off"`` when progress is disabled, ``"bar"`` on a terminal or in a notebook, ``"lines"`` otherwise."""
    if not enabled:
        return "off"
    return "bar" if stderr_is_terminal(stream) or (stream is None and _in_notebook()) else "lines"


class Progress:
    """An iterable that is a tqdm bar on a terminal and the plain iterable otherwise.

    Args:
        iterable: what to loop over.
        desc: the bar's label.
        total: its length, when ``iterable`` has none.
        enabled: the ``run.progress`` setting; false silences bars and lines alike.
        leave: keep the finished bar on screen (inner loops pass False).
    """

    def __init__(self, iterable: Iterable, *, desc: str = "", total: int | None = None, enabled: bool = True,
                 leave: bool = True) -> None:
        self.mode = progress_mode(enabled)
        self._bar = None
        if self.mode == "bar":
            from tqdm.auto import tqdm  # only a terminal pays for the import

            self._bar = tqdm(iterable, desc=desc, total=total, leave=leave, file=sys.stderr)
        self._iterable = iterable

    def __iter__(self) -> Iterator:
        return iter(self._bar if self._bar is not None else self._iterable)

    def set_postfix(self, **values: Any) -> None:
        """Show ``values`` beside the bar (a no-op without one)."""
        if self._bar is not None:
            self._bar.set_postfix(**values)

    def line(self, text: str) -> None:
        """Write ``text`` as one line on stderr when there is no bar to show it (mode ``"lines"``)."""
        if self.mode == "lines":
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
