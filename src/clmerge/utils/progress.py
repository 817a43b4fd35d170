"""Progress output for long loops and phases: tqdm bars on a terminal, plain lines otherwise.

A bar redraws itself with cursor-movement codes (``\\x1b[A``); piped into a file or a CI log those codes pile
up into hundreds of unreadable lines. So every loop in clmerge asks this module instead of calling tqdm:

- ``enabled`` false (``run.progress: false``, ``--no-progress``): nothing at all;
- stderr is a terminal (or the loop runs in a Jupyter notebook): tqdm bars. A pseudo-terminal that reports a
  size of 0 x 0 (``script``, ``docker exec``, some CI runners) gets a bar 80 columns wide: tqdm would draw
  an empty one there;
- stderr is anything else (a file, a pipe, pytest's capture): no bars, and :meth:`Progress.line` writes one
  plain line per epoch or task, e.g. ``task 2/5 epoch 3/5 loss 0.412 (12.3 s)``.

A *phase* (:func:`phase`: a Fisher pass, a subspace, class prototypes, a merge key by key) is quiet when it
is short: its bar appears after :data:`PHASE_DELAY` seconds, and without a terminal it writes a plain line
once it has run that long, then at most one every :data:`LINE_EVERY` seconds or every tenth of the work,
and one when it ends (``pm fisher task 2: 120/300 (40%, 12.0 s, ~18 s left)``).

``enabled=None`` follows the process-wide default, which :func:`progress_enabled` sets for a block (the
continual run sets it from ``run.progress``). ``sys.stderr`` is looked up at each call, not at import, so
redirecting it (tests, ``contextlib``) works.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

__all__ = ["LINE_EVERY", "PHASE_DELAY", "Progress", "phase", "progress_enabled", "progress_mode",
           "stderr_is_terminal"]

PHASE_DELAY = 2.0  # seconds before a phase shows anything
LINE_EVERY = 10.0  # without a terminal: at most one line per this many seconds (or per tenth of the work)
FALLBACK_SIZE = (80, 24)  # columns, rows of a pseudo-terminal that reports 0 x 0

_default = [True]  # the process-wide default of ``enabled=None``


@contextlib.contextmanager
def progress_enabled(flag: bool) -> Iterator[None]:
    """Within the block, ``Progress(enabled=None)`` (every phase) is on or off as ``flag`` says."""
    saved, _default[0] = _default[0], bool(flag)
    try:
        yield
    finally:
        _default[0] = saved


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


def progress_mode(enabled: bool | None, stream: TextIO | None = None) -> str:
    """``"off"`` when progress is disabled, ``"bar"`` on a terminal or in a notebook, ``"lines"`` otherwise."""
    if not (_default[0] if enabled is None else enabled):
        return "off"
    return "bar" if stderr_is_terminal(stream) or (stream is None and _in_notebook()) else "lines"


def bar_size(stream: TextIO | None = None) -> dict[str, int]:
    """tqdm's ``ncols``/``nrows`` for a terminal that reports no size (0 x 0: tqdm would draw nothing);
    empty when the terminal has a size (tqdm then follows it)."""
    stream = sys.stderr if stream is None else stream
    try:
        cols, rows = os.get_terminal_size(stream.fileno())
    except (AttributeError, ValueError, OSError):
        return {}
    out = {}
    if cols <= 0:
        out["ncols"] = int(os.environ.get("COLUMNS", "") or 0) or FALLBACK_SIZE[0]
    if rows <= 0:
        out["nrows"] = int(os.environ.get("LINES", "") or 0) or FALLBACK_SIZE[1]
    return out


class Progress:
    """An iterable that is a tqdm bar on a terminal and the plain iterable otherwise.

    Args:
        iterable: what to loop over (None: count with :meth:`update`).
        desc: the bar's label.
        total: its length, when ``iterable`` has none.
        enabled: the ``run.progress`` setting; false silences bars and lines alike; None: the process-wide
            default (:func:`progress_enabled`).
        leave: keep the finished bar on screen (inner loops pass False).
        delay: show the bar only after this many seconds (tqdm's ``delay``), and no plain line before.
        every: without a terminal, write a plain line by itself at most once per ``every`` seconds or per
            tenth of ``total``, and one at the end (a phase); None: only what :meth:`line` writes.
    """

    def __init__(self, iterable: Iterable | None = None, *, desc: str = "", total: int | None = None,
                 enabled: bool | None = True, leave: bool = True, delay: float = 0.0,
                 every: float | None = None) -> None:
        self.mode = progress_mode(enabled)
        self.desc, self.delay, self.every = desc, delay, every
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.n, self._start = 0, time.monotonic()
        self._last_line, self._last_tenth, self._printed = self._start, 0, False
        self._bar = None
        if self.mode == "bar":
            from tqdm.auto import tqdm  # only a terminal pays for the import

            self._bar = tqdm(iterable, desc=desc, total=self.total, leave=leave, file=sys.stderr, delay=delay,
                             **bar_size())
        self._iterable = iterable

    def __iter__(self) -> Iterator:
        if self._bar is not None:
            yield from self._bar
            return
        try:
            for item in self._iterable:
                yield item
                self.update()
        finally:  # exhausted, or left (break, an error): a phase writes its last line
            if self.every is not None:
                self.close()

    def track(self, iterable: Iterable) -> Iterator:
        """``iterable``'s items, each counted once the loop body is done with it (one phase over several
        loops: every task's batches)."""
        for item in iterable:
            yield item
            self.update()

    def update(self, n: int = 1) -> None:
        """Count ``n`` units of work done (called by the loop itself when iterating)."""
        if self._bar is not None:
            self._bar.update(n)
            return
        self.n += n
        if self.mode == "lines" and self.every is not None:
            self._maybe_line()

    def _maybe_line(self) -> None:
        now = time.monotonic()
        elapsed = now - self._start
        if elapsed < self.delay:
            return
        tenth = int(10 * self.n / self.total) if self.total else 0
        if not self._printed or now - self._last_line >= self.every or tenth > self._last_tenth:
            self._last_line, self._last_tenth, self._printed = now, tenth, True
            print(f"{self.desc}: {self._status(elapsed)}", file=sys.stderr, flush=True)

    def _status(self, elapsed: float) -> str:
        """``120/300 (40%, 12.0 s, ~18 s left)``, or ``120 (12.0 s)`` without a total."""
        if not self.total:
            return f"{self.n} ({elapsed:.1f} s)"
        left = f", ~{elapsed * (self.total - self.n) / self.n:.0f} s left" if 0 < self.n < self.total else ""
        return f"{self.n}/{self.total} ({100 * self.n / self.total:.0f}%, {elapsed:.1f} s{left})"

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
        elif self.mode == "lines" and self.every is not None:
            elapsed = time.monotonic() - self._start
            if self._printed or elapsed >= self.delay:
                print(f"{self.desc}: done, {self.n} in {elapsed:.1f} s", file=sys.stderr, flush=True)
            self.every = None  # closed: a second close writes nothing

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def phase(iterable: Iterable | None = None, desc: str = "", *, total: int | None = None,
          enabled: bool | None = None) -> Progress:
    """A long phase's progress (module docstring): a bar after :data:`PHASE_DELAY` s on a terminal, else
    rate-limited plain lines; ``enabled`` None follows :func:`progress_enabled`. Close it, or use ``with``."""
    return Progress(iterable, desc=desc, total=total, enabled=enabled, leave=False, delay=PHASE_DELAY,
                    every=LINE_EVERY)

