"""``clmerge results``: the command on a sweep folder (formats on stdout, --output written atomically)."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest
from typer.testing import CliRunner

from report_helpers import write_seed_run

from clmerge.cli import app


@pytest.fixture()
def sweep(tmp_path, monkeypatch):
    """A folder laid out as ``clmerge sweep`` writes it: sweep.yaml, cells.json, a run directory per cell."""
    for s, (a, b) in enumerate(((80.0, 84.0), (82.0, 85.0), (87.0, 92.0))):
        write_seed_run(tmp_path / "sweep" / f"method.name=seq_lora,seed={s}", "seq_lora", s, a, til_acc=90.0)
        write_seed_run(tmp_path / "sweep" / f"method.name=pm,seed={s}", "pm", s, b, til_acc=91.0)
    write_seed_run(tmp_path / "sweep" / "method.name=pm,seed=3", "pm", 3, None, finished=False)
    (tmp_path / "sweep" / "sweep.yaml").write_text("grid:\n  method.name: [seq_lora, pm]\n")  # the sweep's
    (tmp_path / "sweep" / "cells.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "sweep"


def _ok(argv):
    result = CliRunner().invoke(app, ["results", *argv])
    assert result.exit_code == 0, result.output
    return result


def test_terminal_table_with_paired_differences_and_notes(sweep):
    out = _ok(["sweep", "--vs", "seq_lora", "--metrics", "acc"]).stdout
    assert "83.00 ± 2.08" in out and "+4.00 ± 0.58 (3)" in out and "reference" in out
    assert "skipped (no metrics.json, unfinished)" in out and "method.name=pm,seed=3" in out


def test_csv_on_stdout_parses_and_notes_go_to_stderr(sweep):
    result = _ok(["sweep", "--format", "csv", "--vs", "seq_lora"])
    rows = {r["method.name"]: r for r in csv.DictReader(io.StringIO(result.stdout))}
    assert float(rows["pm"]["d_acc_mean"]) == 4.0 and float(rows["pm"]["d_til_acc_mean"]) == 1.0
    assert "note: skipped" in result.stderr


def test_output_file_is_written_and_parses_back(sweep):
    result = _ok(["sweep", "--format", "json", "--output", "tables/results.json", "--by", "method.name"])
    doc = json.loads((sweep.parent / "tables" / "results.json").read_text())
    assert "wrote tables/results.json" in result.stdout
    seq = next(g for g in doc["groups"] if g["label"] == "seq_lora")
    assert seq["metrics"]["acc"]["se"] == pytest.approx(math.sqrt(13 / 3))
    assert sorted(p.name for p in (sweep.parent / "tables").iterdir()) == ["results.json"]  # no temp file


def test_ignore_lets_runs_that_differ_in_a_key_be_averaged(sweep):
    write_seed_run(sweep / "extra", "pm", 4, 90.0, run={"threads": 2})
    assert CliRunner().invoke(app, ["results", "sweep"]).exit_code == 3
    out = _ok(["sweep", "--ignore", "run.threads", "--format", "md"]).stdout
    assert "| pm | 4 |" in out and "ignored config keys: run.threads" in out
