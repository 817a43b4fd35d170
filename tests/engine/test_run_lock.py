"""The run-directory lock is taken atomically: of several runs that start on one directory at the same moment,
exactly one holds it, with or without a stale lock left there, and nobody ever sees a half-written record."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time

import pytest

from clmerge.engine import checkpoint
from clmerge.engine.checkpoint import RunLock
from clmerge.errors import RunStateError

N = 4


def _contender(run_dir, barrier, results, hold):
    # Widen the window between looking at the directory and writing the record, as a loaded machine does.
    record = checkpoint._lock_record
    checkpoint._lock_record = lambda pid: (time.sleep(0.2), record(pid))[1]
    barrier.wait()
    try:
        with RunLock(run_dir):
            results.put("held")
            hold.wait(5)  # keep it while the others try
    except RunStateError:
        results.put("refused")


@pytest.mark.parametrize("stale", [False, True], ids=["empty_dir", "stale_lock"])
def test_runs_that_start_together_get_one_lock(tmp_path, stale):
    if stale:  # a dead process's record: its pid is not running
        (tmp_path / ".lock").write_text(json.dumps({"pid": 2**22 + 7, "host": os.uname().nodename}))
    ctx = mp.get_context("fork")
    barrier, results, hold = ctx.Barrier(N), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_contender, args=(tmp_path, barrier, results, hold)) for _ in range(N)]
    for p in procs:
        p.start()
    outcomes = sorted(results.get(timeout=30) for _ in range(N))
    hold.set()
    for p in procs:
        p.join(10)
    assert outcomes == ["held"] + ["refused"] * (N - 1)
    assert not (tmp_path / ".lock").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".lock.")], "temporary lock files left"


def test_a_live_lock_is_never_moved_aside(tmp_path):
    (tmp_path / ".lock").write_text(json.dumps({"pid": os.getppid(), "host": os.uname().nodename}))
    before = (tmp_path / ".lock").read_bytes()
    with pytest.raises(RunStateError, match="in use"):
        RunLock(tmp_path).__enter__()
    assert (tmp_path / ".lock").read_bytes() == before
