"""A dry run says what it is about to do before the slow part, and after each task how long is left."""

from __future__ import annotations

import io
import re

import clmerge.utils.progress as progress_mod

from clmerge.config import parse_config
from clmerge.engine.dry_run import dry_run, time_left
from conftest import tiny_config


def test_time_left_counts_the_tasks_and_the_evaluation():
    assert time_left([100.0], 1) == "about 100s for 1 more task(s), then the evaluation and the resume check"
    assert time_left([10.0, 30.0], 2).startswith("about 40s for 2 more task(s)")
    assert time_left([10.0, 30.0], 0) == "next: the evaluation and the resume check"


def test_a_dry_run_announces_itself_and_hints_at_the_time_left(tmp_path, monkeypatch):
    monkeypatch.setattr(progress_mod, "PHASE_DELAY", 0.0)  # every phase would report at once ...
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    lines: list[str] = []
    dry_run(parse_config(tiny_config()), workdir=tmp_path, echo=lines.append)
    assert "evaluation (test)" not in err.getvalue()  # ... but the config says run.progress: false
    first = next(i for i, ln in enumerate(lines) if ln.startswith("building vit-tiny-fmnist (random init)"))
    assert lines[first].endswith("then 2 task(s) of 2 steps, an evaluation, a resume check")
    tasks = [ln for ln in lines if ln.startswith("task ")]
    assert len(tasks) == 2 and first < lines.index(tasks[0])
    assert re.search(r"\(about \d+s for 1 more task\(s\), then the evaluation and the resume check\)$", tasks[0])
    assert tasks[1].endswith("(next: the evaluation and the resume check)")
