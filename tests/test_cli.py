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
