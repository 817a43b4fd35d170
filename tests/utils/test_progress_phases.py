"""Long phases' progress (``clmerge.utils.progress.phase``): rate-limited plain lines without a terminal, a
bar after a delay on one, a bar under a pseudo-terminal of size 0 x 0, and the process-wide switch."""

from __future__ import annotations

import io
import os
import re
import select
import sys

import pytest

import clmerge.utils.progress as progress_mod
from clmerge.utils.progress import Progress, bar_size, phase, progress_enabled

LINE = re.compile(r"^fisher: (\d+)/100 \((\d+)%, (\d+\.\d) s(, ~\d+ s left)?\)$")


class Clock:
    """A stand-in for ``time.monotonic``: ``step`` seconds pass per unit of work."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(progress_mod.time, "monotonic", c)
    return c


def _run(clock: Clock, n: int, seconds_each: float, desc: str = "fisher") -> list[str]:
    err = io.StringIO()
    saved, sys.stderr = sys.stderr, err
    try:
        with phase(range(n), desc) as bar:
            for _ in bar:
                clock.now += seconds_each
    finally:
        sys.stderr = saved
    return err.getvalue().splitlines()


def test_a_long_phase_writes_rate_limited_plain_lines(clock):
    lines = _run(clock, 100, 0.5)  # 50 s: lines after 2 s, then each tenth (the 10 s rule never comes first)
    assert all("\r" not in ln and "\x1b" not in ln for ln in lines)
    assert lines[-1] == "fisher: done, 100 in 50.0 s"
    counted = [LINE.match(ln) for ln in lines[:-1]]
    assert all(counted), lines
    assert [int(m.group(1)) for m in counted] == [4, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    assert counted[0].group(4) == ", ~48 s left" and float(counted[0].group(3)) == 2.0


def test_a_slow_phase_writes_a_line_every_ten_seconds_between_tenths(clock):
    lines = _run(clock, 4, 15.0)  # each unit 15 s: every unit is past the 10 s and the tenth marks
    assert len(lines) == 5 and lines[-1] == "fisher: done, 4 in 60.0 s"


def test_a_short_phase_writes_nothing(clock):
    assert _run(clock, 100, 0.01) == []  # 1 s in all: under the 2 s delay


def test_phases_follow_the_process_wide_switch(clock):
    with progress_enabled(False):
        assert _run(clock, 10, 1.0) == []
    assert len(_run(clock, 10, 1.0)) > 1


def test_update_counts_work_without_an_iterable(clock, monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    with phase(desc="merge out: tensors", total=3) as bar:
        for _ in range(3):
            clock.now += 5
            bar.update()
    assert err.getvalue().splitlines() == ["merge out: tensors: 1/3 (33%, 5.0 s, ~10 s left)",
                                           "merge out: tensors: 2/3 (67%, 10.0 s, ~5 s left)",
                                           "merge out: tensors: 3/3 (100%, 15.0 s)",
                                           "merge out: tensors: done, 3 in 15.0 s"]


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="no pseudo-terminals here")
def test_a_bar_shows_under_a_pseudo_terminal_of_size_zero(monkeypatch):
    """``script -qc "clmerge run ..." /dev/null`` gives a pty that reports 0 x 0: tqdm drew an empty bar."""
    master, slave = os.openpty()
    stream = os.fdopen(slave, "w", encoding="utf-8")
    try:
        assert os.get_terminal_size(slave) == (0, 0)  # a fresh pty has no size
        assert bar_size(stream) == {"ncols": 80, "nrows": 24}
        monkeypatch.setattr("sys.stderr", stream)
        monkeypatch.delenv("COLUMNS", raising=False)
        monkeypatch.delenv("LINES", raising=False)
        bar = Progress(range(3), desc="tasks")
        assert bar.mode == "bar"
        list(bar)
        bar.close()
        stream.flush()
        # a pty may hand each write over as its own read: read until nothing more arrives
        data = b""
        while select.select([master], [], [], 0.5)[0]:
            data += os.read(master, 65536)
        shown = data.decode("utf-8", errors="replace")
    finally:
        stream.close()
        os.close(master)
    assert "tasks: 100%" in shown and "3/3" in shown


def test_a_sized_terminal_keeps_its_size():
    class NoFd(io.StringIO):
        def fileno(self) -> int:
            raise OSError("no fd")

    assert bar_size(NoFd()) == {}
