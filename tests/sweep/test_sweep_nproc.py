"""``clmerge sweep --nproc N``: each cell as its own torchrun job (clmerge.sweep.runner.run_cell_torchrun),
the same relaunch as ``clmerge run --nproc N``; and the closing hint of a sweep."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.sweep import runner

from conftest import tiny_config

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


class _Done:
    def __init__(self, returncode: int) -> None:
        self.returncode = returncode


def test_a_cell_job_is_clmerge_run_of_its_config_under_torchrun(tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, stdout, **kw):
        calls.append((cmd, Path(cmd[cmd.index("run") + 1]).read_text()))
        stdout.write("job output\n")
        (tmp_path / "c").mkdir()
        (tmp_path / "c" / "metrics.json").write_text(json.dumps({"acc": 50.0, "aaa": 60.0, "forgetting": 1.0}))
        return _Done(0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    got = runner.run_cell_torchrun(tiny_config(seed=3), str(tmp_path / "c"), True, 2)
    cmd, cfg_text = calls[0]
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert cmd[5:8] == ["-m", "clmerge", "run"] and cmd[9:] == ["--out", str(tmp_path / "c"), "--resume"]
    assert yaml.safe_load(cfg_text)["seed"] == 3 and not Path(cmd[8]).exists()  # a temporary file, removed
    assert got == {"acc": 50.0, "aaa": 60.0, "forgetting": 1.0, "val": None}  # no validation score recorded
    assert (tmp_path / ".torchrun" / "c.log").read_text() == "job output\n"  # hidden: no run of `results`


def test_a_failed_cell_job_raises_with_the_last_lines_it_printed(tmp_path, monkeypatch):
    def fake_run(cmd, stdout, **kw):
        stdout.write("noise\nmore noise\nerror: train.batch_size bad\n")
        return _Done(1)

    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match=r"torchrun exited with 1 \(.*c\.log\): more noise \| error: train"):
        runner.run_cell_torchrun(tiny_config(), str(tmp_path / "c"), False, 2)


@pytest.fixture()
def ws(tmp_path, monkeypatch):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_config(**{"train.epochs": 1})))
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({"base": "tiny.yaml", "grid": {"seed": [0]}}))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_sweep_and_run_seeds_end_with_the_commands_that_read_the_runs(ws, monkeypatch):
    import clmerge.sweep

    seen = []
    monkeypatch.setattr(clmerge.sweep, "run_sweep", lambda spec, out, **kw: seen.append(kw["nproc"]))
    for argv in (["sweep", "spec.yaml", "--out", "my sw"], ["run", "tiny.yaml", "--seeds", "0,1", "--out", "my sw"]):
        res = CliRunner().invoke(app, argv)
        assert res.exit_code == 0, res.output
        assert res.output.splitlines()[-1].startswith("next: clmerge results 'my sw' ")
        assert "clmerge report 'my sw' " in res.output.splitlines()[-1]
    res = CliRunner().invoke(app, ["run", "tiny.yaml", "--seeds", "0,1", "--nproc", "2", "--out", "s2"])
    assert res.exit_code == 0 and seen == [1, 1, 2]  # --seeds N --nproc: a torchrun job per seed


def _run(*argv: str) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "clmerge", *argv], env=ENV, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


@pytest.mark.slow  # two 2-process torchrun launches (gloo, CPU) and a resume: ~40-90 s on 2 loaded cores
def test_a_cell_under_torchrun_gives_what_clmerge_run_nproc_gives(ws):
    res = _run("sweep", "spec.yaml", "--out", "sw", "--nproc", "2")
    assert "seed0: done" in res.stdout
    cfg = tiny_config(**{"train.epochs": 1, "seed": 0})
    (ws / "cell.yaml").write_text(yaml.safe_dump(cfg))
    _run("run", "cell.yaml", "--out", "one", "--nproc", "2")
    m_sweep, m_run = (json.loads((ws / d / "metrics.json").read_text()) for d in ("sw/seed0", "one"))
    assert m_sweep["accuracy_matrix"] == m_run["accuracy_matrix"]
    assert m_sweep["til_accuracy_matrix"] == m_run["til_accuracy_matrix"]
    assert json.loads((ws / "sw" / "seed0" / "manifest.json").read_text())["world_size"] == 2
    assert "run directory:" in (ws / "sw" / ".torchrun" / "seed0.log").read_text()  # the job's own output
    res = _run("sweep", "spec.yaml", "--out", "sw", "--nproc", "2", "--resume")  # resume: a finished cell skipped
    assert "1 cells, 1 already done, 0 to run" in res.stdout
