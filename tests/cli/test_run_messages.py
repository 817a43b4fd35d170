"""``clmerge run``'s messages come after its checks: "writing the run to DIR" is never printed for a run that
is then refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml
from typer.testing import CliRunner

from clmerge.cli import app

runner = CliRunner()
WIDE = {"COLUMNS": "200"}


def test_a_refused_run_does_not_say_it_is_writing(tmp_path, tiny_cfg):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_cfg(**{"train.epochs": 1})))
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("seed: 0\n")  # a folder that holds a run: refused, naming --resume
    res = runner.invoke(app, ["run", str(cfg), "--out", str(out)], env=WIDE)
    assert res.exit_code != 0 and "--resume" in res.output
    assert "writing the run to" not in res.output


def test_a_run_with_missing_data_does_not_say_it_is_writing(tmp_path, tiny_cfg):
    cfg = tmp_path / "c.yaml"
    data = tiny_cfg(**{"train.epochs": 1})
    data["scenario"].update(dataset="image_folder", data_root=str(tmp_path / "no_such_folder"))
    cfg.write_text(yaml.safe_dump(data))
    res = runner.invoke(app, ["run", str(cfg), "--out", str(tmp_path / "run")], env=WIDE)
    assert res.exit_code != 0 and "no_such_folder" in res.output
    assert "writing the run to" not in res.output and not (tmp_path / "run").exists()


@pytest.mark.slow  # a clmerge process of its own (imports torch): ~10-30 s
@pytest.mark.skipif(not hasattr(os, "openpty"), reason="no pseudo-terminals here")
def test_clmerge_run_shows_its_bars_under_a_pseudo_terminal_of_size_zero(tmp_path, tiny_cfg):
    """As ``script -qc "clmerge run ..." /dev/null`` runs it: stdout and stderr a pty that reports 0 x 0."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_cfg(**{"train.epochs": 1, "run.progress": True})))
    master, slave = os.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")} | {"HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "clmerge", "run", str(cfg), "--out", str(tmp_path / "run")],
                            stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the pty
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=300) == 0
    shown = b"".join(chunks).decode("utf-8", errors="replace")
    assert "tasks: 100%" in shown and "2/2" in shown and "writing the run to" in shown
