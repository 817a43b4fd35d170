"""The input boundary, the run side: bounds checked before any work, plugins that end the process, the config-name rule,
and run files linked out of a run directory.

Each table row runs the CLI in process (``clmerge run`` with ``--dry-run``, or a real run refused before it
trains) and checks the one-line error: the exit code of its kind (docs/cli_errors.md), the words it must hold
(the key, the value, the limit), at most 3 lines on stderr, no traceback, and the file system left as it was.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.config import PAPER_DIR, SEED_MAX, available_configs

from conftest import tiny_config

USAGE, INPUT, RUN_STATE = 2, 3, 4
SHIPPED = "halrp_cifar100_split_lenet"  # a shipped config name (tests/test_packaging.py uses it too)


@pytest.fixture()
def ws(tmp_path, monkeypatch):
    """A workspace: tiny configs (seq_lora, er), plugins that end the process; cwd is here."""
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_config()))
    (tmp_path / "er.yaml").write_text(yaml.safe_dump(tiny_config(method={"name": "er"})))
    (tmp_path / "exit0_plugin.py").write_text("import sys\nsys.exit(0)\n")
    (tmp_path / "exit_text_plugin.py").write_text("raise SystemExit('plugin says bye')\n")
    (tmp_path / "exit_none_plugin.py").write_text("import sys\nsys.exit()\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _snapshot(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): (p.stat().st_size if p.is_file() else -1) for p in root.rglob("*")}


def _check(result, code: int, words: list[str], before: dict, root: Path) -> None:
    err_lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output, result.output
    assert result.exit_code == code, (result.exit_code, result.output)
    assert 1 <= len(err_lines) <= 3, result.stderr
    assert any(ln.startswith("error: ") for ln in err_lines), result.stderr
    for w in words:
        assert w in result.stderr, (w, result.stderr)
    assert _snapshot(root) == before, "the file system changed"


DRY = ["run", "tiny.yaml", "--dry-run"]
BIG = 10**12

# (id, argv, exit code, words in the message)
BOUND_CASES = [
    # a replay buffer larger than the training set (digits, 4 classes x 40 = 160 examples): refused before the
    # run directory exists and before a row of the buffer is allocated
    ("buffer-1e12", ["run", "er.yaml", "--set", f"method.buffer_size={BIG}", "--out", "r"], USAGE,
     [f"method.buffer_size={BIG}", "160 training examples", "at most 160"]),
    ("buffer-one-over", ["run", "er.yaml", "--set", "method.buffer_size=161", "--out", "r"], USAGE,
     ["method.buffer_size=161", "at most 160"]),
    # scenario.n_tasks: a cap at validation (nothing is read or built), and one task per class at most
    ("n-tasks-1e9-dry", [*DRY, "--set", "scenario.classes_per_task=null", "--set", "scenario.n_tasks=1000000000"],
     USAGE, ["scenario.n_tasks", "1000000000", "10000"]),
    ("n-tasks-1e9-run", ["run", "tiny.yaml", "--set", "scenario.classes_per_task=null", "--set",
                         "scenario.n_tasks=1000000000", "--out", "r"], USAGE, ["scenario.n_tasks", "1000000000"]),
    ("n-tasks-11-of-10-dry", [*DRY, "--set", "scenario.classes_per_task=null", "--set", "scenario.n_tasks=11"],
     USAGE, ["scenario.n_tasks=11", "10 classes", "at most 10"]),
    ("n-tasks-over-class-order", [*DRY, "--set", "scenario.classes_per_task=null", "--set",
                                  "scenario.class_order=[0,1,2]", "--set", "scenario.n_tasks=4"], USAGE,
     ["scenario.n_tasks=4", "3 classes", "at most 3"]),
    # seeds: [0, 2**32 - 1] for every seed key (config.SEED_MAX), refused at validation
    ("seed-2e64", [*DRY, "--set", f"seed={2**64}"], USAGE, ["seed", str(2**64), str(SEED_MAX)]),
    ("seed-2e32", [*DRY, "--set", f"seed={2**32}"], USAGE, ["seed", str(2**32), str(SEED_MAX)]),
    ("seed-negative", [*DRY, "--set", "seed=-1"], USAGE, ["seed", "-1", "greater than or equal to 0"]),
    ("scenario-seed-negative", [*DRY, "--set", "scenario.seed=-1"], USAGE,
     ["scenario.seed", "-1", "greater than or equal to 0"]),
    ("scenario-seed-2e32", [*DRY, "--set", f"scenario.seed={2**32}"], USAGE,
     ["scenario.seed", str(2**32), str(SEED_MAX)]),
    ("seeds-list-2e32", [*DRY, "--seeds", f"0,{2**32}"], USAGE, [f"--seeds={2**32}", str(SEED_MAX)]),
    ("seeds-list-negative", [*DRY, "--seeds=-1,0"], USAGE, ["--seeds=-1", str(SEED_MAX)]),
]


@pytest.mark.parametrize("argv, code, words", [c[1:] for c in BOUND_CASES], ids=[c[0] for c in BOUND_CASES])
def test_a_bound_is_refused_before_any_work(ws, argv, code, words):
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, argv), code, words, before, ws)


def test_the_largest_seed_runs(ws):
    result = CliRunner().invoke(app, [*DRY, "--set", f"seed={SEED_MAX}", "--set", f"scenario.seed={SEED_MAX}"])
    assert result.exit_code == 0, result.output


def test_a_dry_run_holds_a_huge_buffer_to_its_sample_and_says_so(ws):
    """The dry run's data is a sample: the buffer is cut to it (the same draws), never allocated in full."""
    result = CliRunner().invoke(app, ["run", "er.yaml", "--dry-run", "--set", f"method.buffer_size={BIG}"])
    assert result.exit_code == 0, result.output
    assert f"method.buffer_size={BIG} -> " in result.output and "dry run ok" in result.output


# -- plugins that end the process while imported: an input error naming the plugin (exit 3), never exit 0
PLUGIN_CASES = [
    ("plugin-sys-exit-0", ["--plugin", "exit0_plugin.py"], ["--plugin exit0_plugin.py", "sys.exit (0)"]),
    ("plugin-system-exit-text", ["--plugin", "exit_text_plugin.py"],
     ["--plugin exit_text_plugin.py", "'plugin says bye'"]),
    ("plugin-sys-exit-none", ["--plugin", "./exit_none_plugin.py"], ["--plugin ./exit_none_plugin.py", "no code"]),
]


@pytest.mark.parametrize("plugin, words", [c[1:] for c in PLUGIN_CASES], ids=[c[0] for c in PLUGIN_CASES])
def test_a_plugin_that_exits_is_an_input_error_naming_it(ws, plugin, words):
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, [*DRY, *plugin]), INPUT, words, before, ws)


def test_run_help_says_a_plugin_runs_code_and_how_names_resolve():
    result = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "400"})
    flat = " ".join(result.output.split())
    assert "RUNS the plugin's code" in flat
    assert "./NAME" in flat and ".yaml/.yml" in flat


# -- `clmerge run NAME`: a bare name is a shipped config, a path is a path (config.resolve_config_arg)
CONFIG_NAME_CASES = [
    # a local file of a shipped config's name: the shipped config is used (its own key errors), with one note
    ("shipped-name-wins", ["run", SHIPPED, "--set", "optim.lr=abc", "--out", "r"], USAGE,
     ["optim.lr", "using the shipped config", f"./{SHIPPED}"]),
    # ./NAME picks the local file (whose unknown key is then reported)
    ("dot-slash-picks-the-file", ["run", f"./{SHIPPED}", "--out", "r"], USAGE, ["n_taskz"]),
    # a bare name that is no shipped config but a local file: read as that file, and said so
    ("bare-local-file", ["run", "mylocal", "--set", "optim.lr=abc", "--out", "r"], USAGE,
     ["optim.lr", "no shipped config has that name", "./mylocal"]),
]


@pytest.mark.parametrize("argv, code, words", [c[1:] for c in CONFIG_NAME_CASES],
                         ids=[c[0] for c in CONFIG_NAME_CASES])
def test_a_config_name_resolves_by_one_rule(ws, argv, code, words):
    (ws / SHIPPED).write_text(yaml.safe_dump({"scenario": {"n_taskz": 2}}))
    (ws / "mylocal").write_text(yaml.safe_dump(tiny_config()))
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, argv), code, words, before, ws)


def test_a_sweep_base_follows_the_same_rule(ws, caplog):
    from clmerge.sweep.grid import SweepSpec, base_data
    from clmerge.utils.yaml_io import read_yaml

    (ws / SHIPPED).write_text(yaml.safe_dump({"scenario": {"n_taskz": 2}}))
    assert SHIPPED in available_configs()
    with caplog.at_level(logging.WARNING, logger="clmerge.config"):
        data = base_data(SweepSpec(base=SHIPPED))
    assert data == read_yaml(PAPER_DIR / f"{SHIPPED}.yaml")
    assert any("using the shipped config" in r.getMessage() for r in caplog.records)
    assert base_data(SweepSpec(base=f"./{SHIPPED}")) == {"scenario": {"n_taskz": 2}}


# -- run --resume: config.yaml, manifest.json, events.jsonl are the run's own; a link out of the run is refused
@pytest.fixture(scope="module")
def finished_run_dir(tmp_path_factory) -> Path:
    from clmerge.config import parse_config
    from clmerge.engine.run import run_experiment

    out = tmp_path_factory.mktemp("linked") / "run"
    run_experiment(parse_config(tiny_config()), out)
    return out


@pytest.mark.parametrize("name", ["config.yaml", "manifest.json", "events.jsonl"])
def test_resume_refuses_a_run_file_linked_out_of_the_run(ws, finished_run_dir, name):
    """The link points at a byte-identical copy outside: only where it lies is wrong."""
    shutil.copytree(finished_run_dir, ws / "run")
    (ws / "outside").mkdir()
    shutil.move(ws / "run" / name, ws / "outside" / name)
    os.symlink(ws / "outside" / name, ws / "run" / name)
    before = _snapshot(ws)
    result = CliRunner().invoke(app, ["run", "tiny.yaml", "--out", "run", "--resume"])
    _check(result, RUN_STATE, [f"run/{name}", "points outside"], before, ws)
