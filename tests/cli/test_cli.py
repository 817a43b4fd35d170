import json

from typer.testing import CliRunner

from clmerge.cli import app

runner = CliRunner()


def test_listings():
    r = runner.invoke(app, ["methods"])
    assert r.exit_code == 0 and "seq_lora" in r.output and "ewc" in r.output
    r = runner.invoke(app, ["datasets"])
    assert r.exit_code == 0 and all(d in r.output for d in ("mnist5k", "digits", "fashion_mnist", "mnist1d",
                                                              "image_folder", "cifar100", "imagenet_r", "cub200"))
    r = runner.invoke(app, ["models"])
    assert r.exit_code == 0 and "vit-tiny-fmnist" in r.output


def test_config_error_exit_code_and_message(tmp_path):
    r = runner.invoke(app, ["run", "--set", "scenario.n_task=2", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2
    assert "n_tasks" in r.output
    assert not (tmp_path / "x").exists()


def test_run_and_report_commands(tmp_path, tiny_cfg):
    import yaml

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_cfg()))
    out = tmp_path / "run"
    r = runner.invoke(app, ["run", str(cfg), "--out", str(out), "--set", "train.epochs=1"])
    assert r.exit_code == 0, r.output
    assert "accuracy matrix" in r.output and "Acc" in r.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["accuracy_matrix"]) == 2
    r = runner.invoke(app, ["report", str(out)])
    assert r.exit_code == 0 and (out / "report.html").exists()
    r = runner.invoke(app, ["report", str(tmp_path / "nothing")])
    assert r.exit_code == 3 and "metrics.json" in r.output  # InputError: docs/cli_errors.md
    r = runner.invoke(app, ["run", "--resume"])
    assert r.exit_code == 2 and "--out" in r.output


def test_the_cli_makes_idle_openmp_threads_sleep_unless_told_otherwise():
    """OMP_WAIT_POLICY=PASSIVE is set before torch loads (a loaded machine ran the default run 4.9x faster);
    an explicit setting wins."""
    import os
    import subprocess
    import sys

    code = "import clmerge.cli, os, sys; print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "PASSIVE"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "ACTIVE"


def test_methods_verbose_lists_options_defaults_and_heads():
    r = runner.invoke(app, ["methods", "--verbose"])
    assert r.exit_code == 0
    lines = r.output.splitlines()
    aper = lines.index(next(line for line in lines if line.startswith("aper ")))
    assert lines[aper + 1].startswith("    variant (default 'adapter'): ")
    assert "    head: classifier=ncm, ncm_metric=cosine" in lines
    assert any(line.startswith("    alpha (default 0.1): subspace reweighting") for line in lines)
    assert "    variant (default" not in runner.invoke(app, ["methods"]).output
