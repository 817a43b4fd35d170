"""The input boundary: no command reads a huge input file whole. A 3 GiB (sparse) ``config.json``, ``metrics.json``,
``events.jsonl``, run ``config.yaml`` or spec is refused from its size, before a byte is read, with one line
naming the file and the limit (docs/cli_errors.md, "Size caps"); the exit code is the command's own for an
unusable input (3; ``--resume``: 4, the run directory cannot be resumed)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import pytest
import yaml
from typer.testing import CliRunner

from clmerge.cli import app

from conftest import tiny_config
from report_helpers import write_matrix_run
from vocab_helpers import tiny_lm

HUGE = 3 << 30
R2 = [[90.0, None], [80.0, 85.0]]


def _sparse(path: Path) -> None:
    path.unlink(missing_ok=True)
    with open(path, "wb") as fh:
        fh.truncate(HUGE)  # no blocks on disk: only a reader that reads it whole would notice


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm")
    tiny_lm(root / "M", seed=0)
    tiny_lm(root / "A", seed=1)
    return root


def _model(name: str) -> Callable[[Path, Path], None]:
    def setup(ws: Path, lm: Path) -> None:
        for m in ("M", "A"):
            shutil.copytree(lm / m, ws / m)
        _sparse(ws / "M" / name)
    return setup


def _runs(name: str) -> Callable[[Path, Path], None]:
    def setup(ws: Path, lm: Path) -> None:
        write_matrix_run(ws / "runs" / "a", "pm", 0, R2)
        if name == "events.jsonl":
            (ws / "runs" / "a" / name).write_text("")
        _sparse(ws / "runs" / "a" / name)
    return setup


def _spec(ws: Path, lm: Path) -> None:
    _sparse(ws / "spec.yaml")


CASES = [
    ("eval-config-json", _model("config.json"), ["eval", "M", "--data", "heldout.txt"], 3, "config.json"),
    ("eval-tokenizer-json", _model("tokenizer.json"), ["eval", "M", "--data", "heldout.txt"], 3, "tokenizer.json"),
    ("merge-config-json", _model("config.json"),
     ["merge", "--method", "task_arithmetic", "--base", "M", "--expert", "A", "--out", "out"], 3, "config.json"),
    ("results-metrics-json", _runs("metrics.json"), ["results", "runs"], 3, "metrics.json"),
    ("results-config-yaml", _runs("config.yaml"), ["results", "runs"], 3, "config.yaml"),
    ("report-metrics-json", _runs("metrics.json"), ["report", "runs/a"], 3, "metrics.json"),
    ("report-events-jsonl", _runs("events.jsonl"), ["report", "runs/a"], 3, "events.jsonl"),
    ("sweep-spec", _spec, ["sweep", "spec.yaml", "--dry-run"], 3, "spec.yaml"),
    ("run-config", lambda ws, lm: _sparse(ws / "big.yaml"), ["run", "./big.yaml", "--dry-run"], 3, "big.yaml"),
]


@pytest.mark.parametrize(("setup", "argv", "code", "name"), [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_a_huge_file_is_refused_from_its_size(tmp_path, monkeypatch, lm, setup, argv, code, name):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "heldout.txt").write_text("w1 w2 w3 w4 w5\n")
    setup(tmp_path, lm)
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == code, res.output
    assert name in res.output and "limit" in res.output and "Traceback" not in res.output, res.output
    assert not (tmp_path / "out").exists()


def test_resume_refuses_a_huge_run_config(tmp_path, monkeypatch):
    """A run directory whose config.yaml is 3 GiB cannot be resumed (exit 4), and nothing is read whole."""
    monkeypatch.chdir(tmp_path)
    cfg = tiny_config()
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    run.mkdir()
    (run / "manifest.json").write_text('{"tasks": []}')
    _sparse(run / "config.yaml")
    res = CliRunner().invoke(app, ["run", "./c.yaml", "--out", str(run), "--resume"])
    assert res.exit_code in (3, 4), res.output
    assert "config.yaml" in res.output and "Traceback" not in res.output, res.output
