"""The installable package: paper configs shipped inside it and found by name, extras for the packages that
merging does not need, one-line errors naming the extra to install."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import save_file
from typer.testing import CliRunner

import clmerge
from clmerge.cli import app
from clmerge.config import load_config
from clmerge.errors import InputError
from clmerge.paper_configs import PAPER_DIR, available_configs, resolve_config_arg
from clmerge.utils.extras import MissingExtraError, require_extra

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
    local = tmp_path / name  # a bare name is the shipped config, even beside a file of that name ...
    local.write_text(yaml.safe_dump({"scenario": {"n_tasks": 2}}))
    assert resolve_config_arg(name) == PAPER_DIR / f"{name}.yaml"
    assert load_config(f"./{name}").scenario.n_tasks == 2  # ... and ./NAME is the file


def test_configs_lists_every_shipped_config_with_method_dataset_and_paper():
    result = CliRunner().invoke(app, ["configs"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == list(available_configs())
    for ln, (name, path) in zip(lines, available_configs().items()):
        data = yaml.safe_load(path.read_text())
        assert f"{data['method']['name']} on {data['scenario']['dataset']}" in ln, ln
        assert re.search(r"\([A-Z][\w-]* et al\.,? [^)]*\d{4}\)$", ln), ln  # the paper: (Authors et al., Venue Year)


# ---- extras: packages that merging does not need ---------------------------------------------------------
OPTIONAL = ["mlxtend", "mnist1d", "sklearn", "matplotlib", "scipy", "optuna", "PIL"]
# a child Python in which every optional package fails to import, as in an install without extras
_BLOCKED = ("import sys; sys.modules.update(dict.fromkeys({mods!r})); sys.argv[0] = 'clmerge'; "
            "from clmerge.cli import main; main()")


def test_pyproject_core_dependencies_hold_no_optional_package_and_dev_pulls_in_every_extra():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    for dist in ("mlxtend", "mnist1d", "scikit-learn", "matplotlib", "scipy", "pillow"):
        assert dist not in core, dist
    extras = project["optional-dependencies"]
    # every extra but wandb and lm-eval (docs/install.md: large dependency trees for one sink, one flag)
    assert extras["all"] == [f"clmerge[{','.join(e for e in extras if e not in ('all', 'dev', 'wandb', 'lm-eval'))}]"]
    assert "clmerge[all]" in extras["dev"]


@pytest.mark.parametrize("module, extra, dist", [("mlxtend.data", "data", "mlxtend"),
                                                 ("sklearn.cluster", "data", "scikit-learn"),
                                                 ("matplotlib", "plots", "matplotlib"),
                                                 ("scipy.optimize", "study", "scipy"),
                                                 ("optuna", "tune", "optuna"),
                                                 ("PIL.Image", "images", "pillow")])
def test_a_missing_extra_is_one_input_error_naming_pip_install(monkeypatch, module, extra, dist):
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setitem(sys.modules, module.split(".")[0], None)
    with pytest.raises(MissingExtraError) as err:
        require_extra(module, what="this feature")
    msg = str(err.value)
    assert err.value.exit_code == InputError.exit_code and "\n" not in msg
    assert msg.startswith(f"this feature needs the package {dist}") and f'pip install "clmerge[{extra}]"' in msg


def test_a_report_without_matplotlib_is_written_with_a_note_naming_the_extra(tmp_path, monkeypatch):
    from clmerge.report import build_report
    from report_helpers import full_metrics as _full_metrics, write_run as _write_run

    run = _write_run(tmp_path / "run", _full_metrics())
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    text = build_report(run).read_text()
    assert "data:image/png" not in text and 'pip install &quot;clmerge[plots]&quot;' in text


def test_law_fits_without_scipy_name_the_study_extra(monkeypatch):
    from clmerge.theory import laws

    monkeypatch.setitem(sys.modules, "scipy", None)
    monkeypatch.delitem(sys.modules, "scipy.optimize", raising=False)
    with pytest.raises(MissingExtraError, match=r'clmerge\[study\]'):
        laws._nnls(np.eye(2), np.ones(2))


def test_merge_and_a_paper_dry_run_import_no_optional_package(tmp_path):
    """What a merge-only install runs: merging two checkpoints, and a shipped config's dry run by name."""
    g = torch.Generator().manual_seed(0)
    for name in ("base", "e1", "e2"):
        save_file({"lin.weight": torch.randn(4, 4, generator=g)}, str(tmp_path / f"{name}.safetensors"))
    code = _BLOCKED.format(mods=OPTIONAL)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    merge = subprocess.run([sys.executable, "-c", code, "merge", "--method", "ties", "--base", "base.safetensors",
                            "--expert", "e1.safetensors", "--expert", "e2.safetensors", "--out", "m"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert merge.returncode == 0, merge.stderr
    assert any((tmp_path / "m").iterdir())
    dry = subprocess.run([sys.executable, "-c", code, "run", "halrp_cifar100_split_lenet", "--dry-run"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr
    assert "dry run ok" in dry.stdout


def test_a_dataset_of_image_files_without_pillow_fails_when_built_naming_the_images_extra(tmp_path, monkeypatch):
    """Checked when the dataset is built, before any training (pillow left the core: merging needs no images)."""
    from clmerge.data.base import FileListData
    from clmerge.data.lookalike import png_pool

    monkeypatch.delitem(sys.modules, "PIL.Image", raising=False)
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(MissingExtraError, match=r'dataset imagenet_r needs the package pillow.*clmerge\[images\]'):
        FileListData([tmp_path / "a.png"], [0], name="imagenet_r")
    with pytest.raises(MissingExtraError, match=r'clmerge\[images\]'):
        png_pool()


def test_hide_prompt_k_means_statistics_without_scikit_learn_fail_at_set_up(monkeypatch):
    """Checked when the method is built, not after the first task has trained."""
    from clmerge.methods.prompts.hide_parts import MultiCentroidStats

    monkeypatch.delitem(sys.modules, "sklearn.cluster", raising=False)
    monkeypatch.setitem(sys.modules, "sklearn", None)
    with pytest.raises(MissingExtraError, match=r'multi_centroid.*clmerge\[data\]'):
        MultiCentroidStats(8, 2, seed=0)
