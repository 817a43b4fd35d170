"""The installable package: paper configs shipped inside it and found by name, extras for the packages that
merging does not need, one-line errors naming the extra to install."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import clmerge
from clmerge.cli import app
from clmerge.config import load_config
from clmerge.paper_configs import PAPER_DIR, available_configs, resolve_config_arg

REPO = Path(__file__).resolve().parents[1]


def test_paper_configs_live_in_the_package_and_package_data_ships_them():
    assert PAPER_DIR == Path(clmerge.__file__).resolve().parent / "configs" / "paper"
    assert len(available_configs()) >= 34 and not (REPO / "configs").exists()
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "configs/**/*.yaml" in data["tool"]["setuptools"]["package-data"]["clmerge"]


def test_a_config_resolves_by_name_and_a_path_still_works(tmp_path, monkeypatch):
    name = "halrp_cifar100_split_lenet"
    assert resolve_config_arg(name) == PAPER_DIR / f"{name}.yaml"
    assert load_config(name) == load_config(PAPER_DIR / f"{name}.yaml")
    monkeypatch.chdir(tmp_path)
    local = tmp_path / name  # a file in the working folder wins over the shipped name
    local.write_text(yaml.safe_dump({"scenario": {"n_tasks": 2}}))
    assert resolve_config_arg(name) == Path(name)
    assert load_config(name).scenario.n_tasks == 2


def test_configs_lists_every_shipped_config_with_method_dataset_and_paper():
    result = CliRunner().invoke(app, ["configs"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == list(available_configs())
    for ln, (name, path) in zip(lines, available_configs().items()):
        data = yaml.safe_load(path.read_text())
        assert f"{data['method']['name']} on {data['scenario']['dataset']}" in ln, ln
        assert re.search(r"\([A-Z][\w-]* et al\.,? [^)]*\d{4}\)$", ln), ln  # the paper: (Authors et al., Venue Year)


def test_run_by_name_dry_runs_the_shipped_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["run", "halrp_cifar100_split_lenet", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "dry run ok: halrp on cifar100" in result.stdout
