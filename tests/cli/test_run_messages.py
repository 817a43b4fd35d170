"""``clmerge run``'s messages come after its checks: "writing the run to DIR" is never printed for a run that
is then refused."""

from __future__ import annotations

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
