"""A merge reports its progress key by key (``clmerge.utils.progress.phase``): plain lines without a terminal,
one count per distinct tensor written. The phases' 2 s delay is set to 0 here, so a tiny merge reports too."""

from __future__ import annotations

import io
import re

import clmerge.utils.progress as progress_mod
from clmerge.merging.io.output import KeyCounter
from clmerge.merging.recipes import recipe_of
from clmerge.merging.run import run_merge
from clmerge.utils.progress import phase
from vocab_helpers import tiny_lm


def test_a_merge_counts_its_tensors_in_plain_lines(tmp_path, monkeypatch):
    a, b = tiny_lm(tmp_path / "a", seed=0), tiny_lm(tmp_path / "b", seed=1)
    monkeypatch.setattr(progress_mod, "PHASE_DELAY", 0.0)
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    res = run_merge(recipe_of({"method": "linear", "models": [{"model": str(a)}, {"model": str(b)}]}),
                    tmp_path / "out")
    lines = err.getvalue().splitlines()
    counts = [re.match(r"^merge out: tensors: (\d+)/(\d+) ", ln) for ln in lines]
    counts = [(int(m.group(1)), int(m.group(2))) for m in counts if m]
    assert counts and counts[-1] == (res.keys, res.keys) and all(t == res.keys for _, t in counts)
    assert lines[-1].startswith(f"merge out: tensors: done, {res.keys} in ")
    assert "\r" not in err.getvalue()


def test_a_rewritten_key_counts_once():
    class Sink:
        def __init__(self):
            self.written = []

        def write(self, key, tensor):
            self.written.append(key)

        def flush(self):
            return "flushed"

    sink = Sink()
    with phase(desc="x", total=2, enabled=False) as bar:
        counter = KeyCounter(sink, bar)
        for key in ("a", "b", "a"):
            counter.write(key, None)
        assert bar.n == 2 and sink.written == ["a", "b", "a"] and counter.flush() == "flushed"
