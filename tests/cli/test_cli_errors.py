"""Every user error of every subcommand: at most 3 lines on stderr, no traceback, the exit code of its kind
(docs/cli_errors.md), and the file system left exactly as it was.

One table: (subcommand, what is wrong, argv, exit code, words the message must hold). Each case runs the CLI
in process on tiny tensors written here; nothing trains except the one divergence case (2 tiny steps).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import save_file
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.cli.base import as_user_error
from clmerge.errors import InputError, OutputError, TrainingError, UsageError
from clmerge.utils import outpaths

from conftest import tiny_config

REPO = Path(__file__).resolve().parents[2]
STUDY_SPEC = REPO / "benchmarks" / "study_smoke.yaml"
USAGE, INPUT, OUTPUT = UsageError.exit_code, InputError.exit_code, 5


class _Evil:  # a pickled object other than tensors: torch.load(weights_only=True) must refuse it
    def __reduce__(self):
        return (print, ("unpickled!",))


@pytest.fixture()
def ws(tmp_path, monkeypatch):
    """A workspace: tiny weights, broken files, a foreign file and folder, a tiny run config; cwd is here."""
    g = torch.Generator().manual_seed(0)
    for name in ("base", "e1", "e2"):
        save_file({"lin.weight": torch.randn(4, 4, generator=g), "lin.bias": torch.randn(4, generator=g)},
                  str(tmp_path / f"{name}.safetensors"))
    (tmp_path / "corrupt.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    torch.save({"w": torch.zeros(2), "x": _Evil()}, tmp_path / "evil.pt")
    (tmp_path / "foreign.safetensors").write_bytes(b"someone else's file")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "study").mkdir()
    (tmp_path / "study" / "fits.json").write_text("{}")
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_config()))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _snapshot(root: Path) -> dict[str, int]:
    """Every path under ``root`` (hidden ones too) with its size: what "unchanged" compares."""
    return {str(p.relative_to(root)): (p.stat().st_size if p.is_file() else -1) for p in root.rglob("*")}


MERGE = ["merge", "--method", "ties", "--base", "base.safetensors", "--expert", "e1.safetensors",
         "--expert", "e2.safetensors"]
RUN = ["run", "tiny.yaml"]

# (id, argv, exit code, words in the message)
CASES = [
    # run: config values and keys, data and scenario errors, output paths
    ("run-bad-value", [*RUN, "--set", "optim.lr=abc", "--out", "r"], USAGE, ["optim.lr"]),
    ("run-unknown-key", [*RUN, "--set", "scenario.n_taskz=2", "--out", "r"], USAGE, ["n_taskz"]),
    ("run-scenario", [*RUN, "--set", "scenario.classes_per_task=null", "--set", "scenario.n_tasks=11",
                      "--out", "r"], USAGE, ["11 tasks"]),
    ("run-no-data", [*RUN, "--set", "scenario.dataset=cifar100", "--set", "scenario.classes_per_task=null",
                     "--set", "scenario.data_root=nodata", "--out", "r"], INPUT, ["cifar100", "data not found"]),
    ("run-missing-config", ["run", "nope.yaml", "--out", "r"], INPUT, ["nope.yaml"]),
    ("run-config-is-dir", ["run", "empty_dir", "--out", "r"], INPUT, ["empty_dir"]),
    ("run-out-is-file", [*RUN, "--out", "foreign.safetensors"], OUTPUT, ["not a folder"]),
    ("run-out-under-file", [*RUN, "--out", "foreign.safetensors/r"], OUTPUT, ["is a file"]),
    ("run-out-foreign-dir", [*RUN, "--out", "full"], OUTPUT, ["--overwrite"]),
    ("run-resume-no-out", [*RUN, "--resume"], USAGE, ["--out"]),
    # merge: hyperparameters, inputs, outputs
    ("merge-density-abc", [*MERGE, "--set", "density=abc", "--out", "m"], USAGE, ["density", "abc"]),
    ("merge-scaling-nan", [*MERGE, "--set", "scaling=nan", "--out", "m"], USAGE, ["scaling", "nan"]),
    ("merge-unknown-key", [*MERGE, "--set", "densty=0.2", "--out", "m"], USAGE, ["densty"]),
    ("merge-out-pt", [*MERGE, "--out", "m.pt"], OUTPUT, ["m.pt", "m.safetensors"]),
    ("merge-out-is-input", [*MERGE, "--out", "e1.safetensors"], OUTPUT, ["input"]),
    ("merge-out-foreign-file", [*MERGE, "--out", "foreign.safetensors"], OUTPUT, ["--overwrite"]),
    ("merge-out-existing-dir", [*MERGE, "--out", "full"], OUTPUT, ["--overwrite"]),
    ("merge-out-under-file", [*MERGE, "--out", "foreign.safetensors/m"], OUTPUT, ["foreign.safetensors"]),
    ("merge-missing-input", ["merge", "--method", "ties", "--base", "base.safetensors", "--expert",
                             "nope.safetensors", "--expert", "e1.safetensors", "--out", "m"], INPUT, ["nope"]),
    ("merge-corrupt-input", ["merge", "--method", "ties", "--base", "base.safetensors", "--expert",
                             "corrupt.safetensors", "--expert", "e1.safetensors", "--out", "m"], INPUT,
     ["corrupt.safetensors"]),
    ("merge-dir-without-weights", ["merge", "--method", "ties", "--base", "empty_dir", "--expert",
                                   "e1.safetensors", "--expert", "e2.safetensors", "--out", "m"], INPUT,
     ["empty_dir"]),
    ("merge-pickle", ["merge", "--method", "ties", "--base", "base.safetensors", "--expert", "evil.pt",
                      "--expert", "e1.safetensors", "--out", "m"], INPUT, ["arbitrary Python objects"]),
    ("merge-unknown-method", ["merge", "--method", "nope", "--expert", "e1.safetensors", "--out", "m"], USAGE,
     ["nope"]),
    ("merge-bad-flag", [*MERGE, "--threads", "abc", "--out", "m"], USAGE, ["--threads"]),
    ("merges-bad-flag", ["merges", "--bogus"], USAGE, ["--bogus"]),
    # merge-bench
    ("bench-suite", ["merge-bench", "--suite", "nope", "--out", "b"], USAGE, ["--suite"]),
    ("bench-seeds", ["merge-bench", "--seeds", "a,b", "--out", "b"], USAGE, ["--seeds"]),
    ("bench-out-foreign", ["merge-bench", "--out", "full"], OUTPUT, ["--overwrite"]),
    # export / extract-lora
    ("export-no-run", ["export", "nope", "--format", "hf", "--out", "x"], INPUT, ["nope"]),
    ("export-format", ["export", "empty_dir", "--format", "onnx", "--out", "x"], USAGE, ["--format"]),
    ("export-out-foreign", ["export", "empty_dir", "--format", "hf", "--out", "full"], OUTPUT, ["full"]),
    ("extract-missing", ["extract-lora", "--base", "nope.safetensors", "--tuned", "e1.safetensors", "--rank",
                         "2", "--out", "x"], INPUT, ["nope"]),
    ("extract-corrupt", ["extract-lora", "--base", "base.safetensors", "--tuned", "corrupt.safetensors",
                         "--rank", "2", "--out", "x"], INPUT, ["corrupt"]),
    ("extract-rank", ["extract-lora", "--base", "base.safetensors", "--tuned", "e1.safetensors", "--rank", "0",
                      "--out", "x"], USAGE, ["--rank"]),
    ("extract-regex", ["extract-lora", "--base", "base.safetensors", "--tuned", "e1.safetensors", "--rank", "2",
                       "--include", "(", "--out", "x"], USAGE, ["--include"]),
    ("extract-out-is-input", ["extract-lora", "--base", "base.safetensors", "--tuned", "e1.safetensors",
                              "--rank", "2", "--out", "base.safetensors"], OUTPUT, ["input"]),
    # study / predict / advise
    ("study-missing-spec", ["study", "nope.yaml", "--out", "s"], INPUT, ["nope.yaml"]),
    ("merge-missing-recipe", ["merge", "nope.yaml", "--out", "m"], INPUT, ["nope.yaml"]),
    ("study-unknown-key", ["study", str(STUDY_SPEC), "--set", "nope.key=1", "--out", "s"], USAGE, ["nope"]),
    ("predict-no-fits", ["predict", "empty_dir"], INPUT, ["fits.json"]),
    ("predict-bad-value", ["predict", "study", "lr=abc"], USAGE, ["lr=abc"]),
    ("advise-no-results", ["advise", "empty_dir"], INPUT, ["results.jsonl"]),
    # pretrain / report
    ("pretrain-preset", ["pretrain", "--preset", "nope", "--out", "p"], USAGE, ["nope"]),
    ("pretrain-out-foreign", ["pretrain", "--out", "full"], OUTPUT, ["--overwrite"]),
    ("report-no-run", ["report", "nope"], INPUT, ["metrics.json"]),
]


def _check(result, code, words, before, root):
    err_lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output, result.output
    assert 1 <= len(err_lines) <= 3, result.stderr
    assert any(ln.startswith("error: ") for ln in err_lines), result.stderr
    assert result.exit_code == code, (result.exit_code, result.stderr)
    for w in words:
        assert w in result.stderr, (w, result.stderr)
    assert "weights_only=False" not in result.stderr and "will likely succeed" not in result.stderr
    assert _snapshot(root) == before, "the file system changed"


@pytest.mark.parametrize("argv, code, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_user_error_is_short_typed_and_leaves_nothing(ws, argv, code, words):
    before = _snapshot(ws)
    result = CliRunner().invoke(app, argv)
    _check(result, code, words, before, ws)


@pytest.mark.parametrize("command", [
    [*RUN, "--out", "ro/r"],
    [*MERGE, "--out", "ro/m"],
    ["merge-bench", "--out", "ro/b"],
    ["pretrain", "--out", "ro/p"],
    ["extract-lora", "--base", "base.safetensors", "--tuned", "e1.safetensors", "--rank", "2", "--out", "ro/x"],
    ["study", str(STUDY_SPEC), "--out", "ro/s"],
], ids=["run", "merge", "merge-bench", "pretrain", "extract-lora", "study"])
def test_unwritable_out_is_refused_before_any_work(ws, command, monkeypatch):
    (ws / "ro").mkdir()
    os.chmod(ws / "ro", 0o500)
    try:
        if os.access(ws / "ro", os.W_OK):  # root writes anywhere: deny it in the check itself
            real_access = os.access
            monkeypatch.setattr(outpaths.os, "access", lambda p, mode: real_access(p, mode) and
                                not (Path(p).resolve() == (ws / "ro").resolve() and mode & os.W_OK))
        before = _snapshot(ws)
        result = CliRunner().invoke(app, command)
        _check(result, OUTPUT, ["permission denied"], before, ws)
    finally:
        os.chmod(ws / "ro", 0o700)


def test_overwrite_lets_merge_replace_a_foreign_file(ws):
    result = CliRunner().invoke(app, [*MERGE, "--out", "foreign.safetensors", "--overwrite"])
    assert result.exit_code == 0, result.output
    assert (ws / "foreign.safetensors").read_bytes()[:8] != b"someone "


def test_overwrite_lets_extract_lora_replace_a_folder(ws):
    argv = ["extract-lora", "--base", "base.safetensors", "--tuned", "e1.safetensors", "--rank", "2", "--out", "full"]
    assert CliRunner().invoke(app, argv).exit_code == OUTPUT
    result = CliRunner().invoke(app, [*argv, "--overwrite"])
    assert result.exit_code == 0, result.output
    assert (ws / "full" / "adapter_config.json").exists() and not (ws / "full" / "keep.txt").exists()
    assert sorted(p.name for p in ws.iterdir() if p.name.startswith(".")) == []  # no temporary folder left


def test_divergence_is_a_one_line_training_error(ws):
    result = CliRunner().invoke(app, [*RUN, "--set", "optim.lr=1e30", "--set", "train.epochs=1", "--out", "r"])
    err_lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.exit_code == TrainingError.exit_code, result.output
    assert len(err_lines) == 1 and "loss is" in err_lines[0] and "optim.lr" in err_lines[0], result.stderr
    assert "Traceback" not in result.output


def test_debug_flag_and_env_show_the_traceback(ws, monkeypatch):
    result = CliRunner().invoke(app, ["--debug", *MERGE, "--set", "density=abc", "--out", "m"])
    assert isinstance(result.exception, UsageError) and result.exit_code == 1
    monkeypatch.setenv("CLMERGE_DEBUG", "1")
    result = CliRunner().invoke(app, ["report", "nope"])
    assert isinstance(result.exception, InputError)
    monkeypatch.delenv("CLMERGE_DEBUG")
    result = CliRunner().invoke(app, ["report", "nope"])  # --debug of one call does not stick
    assert result.exit_code == INPUT and result.exception is None or isinstance(result.exception, SystemExit)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, "-m", "clmerge", "--debug", "report", "nope"], cwd=ws, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "metrics.json" in proc.stderr


def test_os_errors_map_to_their_kind():
    """An OSError on a user's path that escapes a command: missing or wrong kind -> input (3); no permission
    or an existing path -> output (5); the message names the path, in one line."""
    cases = [(PermissionError(13, "Permission denied", "/x/out"), OutputError, "/x/out: permission denied"),
             (FileNotFoundError(2, "No such file or directory", "in.yaml"), InputError, "in.yaml: no such file"),
             (IsADirectoryError(21, "Is a directory", "d"), InputError, "d: is a directory"),
             (NotADirectoryError(20, "Not a directory", "f/x"), InputError, "f/x: not a directory"),
             (FileExistsError("out already holds a run"), OutputError, "out already holds a run"),
             (ValueError("--x: bad"), UsageError, "--x: bad")]
    for exc, kind, text in cases:
        user = as_user_error(exc)
        assert type(user) is kind and str(user).startswith(text), (exc, user)


def test_consoles_are_120_wide_off_a_terminal_and_errors_never_hard_wrap(monkeypatch, capsys):
    from clmerge.cli import base as cli_support

    monkeypatch.delenv("COLUMNS", raising=False)
    assert cli_support.make_console().width == cli_support.FALLBACK_WIDTH == 120
    long_message = "--out " + "/very/long/path" * 20 + ": cannot write here"
    cli_support.print_error(long_message)
    assert capsys.readouterr().err == f"error: {long_message}\n"
    cli_support.print_error("\n".join(f"line {i}" for i in range(6)))
    assert capsys.readouterr().err.count("\n") == 3


# -- input folders that name files outside themselves (docs/merging_checkpoints.md) ---------------------------

def _model_dir(ws: Path, name: str, weight_map=None) -> Path:
    """A one-shard model folder whose index maps every key to ``weight_map`` (default: its own shard)."""
    folder = ws / name
    folder.mkdir()
    save_file({"lin.weight": torch.zeros(4, 4), "lin.bias": torch.zeros(4)}, str(folder / "shard.safetensors"))
    wm = {"lin.weight": "shard.safetensors", "lin.bias": "shard.safetensors"} if weight_map is None else weight_map
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return folder


def _escape_relative(ws):
    _model_dir(ws, "bad", {"lin.weight": "../e1.safetensors", "lin.bias": "shard.safetensors"})


def _escape_absolute(ws):
    _model_dir(ws, "bad", {"lin.weight": str(ws / "e1.safetensors"), "lin.bias": "shard.safetensors"})


def _escape_symlink(ws):
    folder = _model_dir(ws, "bad")
    (folder / "shard.safetensors").unlink()
    (folder / "shard.safetensors").symlink_to(ws / "e1.safetensors")


def _weight_map_list(ws):
    _model_dir(ws, "bad", ["shard.safetensors"])


def _tokenizer_symlink(ws):
    (_model_dir(ws, "bad") / "tokenizer.json").symlink_to(ws / "foreign.safetensors")


def _adapter_config_list(ws):
    (ws / "bad").mkdir()
    (ws / "bad" / "adapter_config.json").write_text("[]")


PATH_MERGE = ["merge", "--method", "task_arithmetic", "--expert", "e1.safetensors", "--expert",
              "e2.safetensors", "--out", "m"]
# (id, setup, argv, exit code, words in the message)
PATH_CASES = [
    ("index-entry-relative", _escape_relative, [*PATH_MERGE, "--base", "bad"], INPUT,
     ["weight_map entry", "../e1.safetensors", "outside"]),
    ("index-entry-absolute", _escape_absolute, [*PATH_MERGE, "--base", "bad"], INPUT,
     ["weight_map entry", "e1.safetensors", "outside"]),
    ("shard-symlink-out", _escape_symlink, [*PATH_MERGE, "--base", "bad"], INPUT, ["shard.safetensors", "outside"]),
    ("weight-map-list", _weight_map_list, [*PATH_MERGE, "--base", "bad"], INPUT,
     ["model.safetensors.index.json", "weight_map"]),
    ("tokenizer-symlink-out", _tokenizer_symlink, [*PATH_MERGE, "--base", "bad"], INPUT,
     ["tokenizer.json", "outside"]),
    ("adapter-config-list", _adapter_config_list, ["merge", "--method", "task_arithmetic", "--base",
                                                   "base.safetensors", "--expert", "bad", "--expert",
                                                   "e1.safetensors", "--out", "m"], INPUT,
     ["adapter_config.json", "JSON object"]),
]


@pytest.mark.parametrize("setup, argv, code, words", [c[1:] for c in PATH_CASES], ids=[c[0] for c in PATH_CASES])
def test_input_folder_naming_files_outside_is_a_one_line_input_error(ws, setup, argv, code, words):
    setup(ws)
    before = _snapshot(ws)
    result = CliRunner().invoke(app, argv)
    _check(result, code, words, before, ws)
# --- merge numerics and checkpoint contents: non-finite outputs, unsupported dtypes, keys listed but absent ---

@pytest.fixture()
def ws_numerics(ws):
    """``ws`` plus a float8 expert, an expert with values beyond float16, and a sharded folder whose index
    lists a key that no shard holds."""
    import json

    g = torch.Generator().manual_seed(1)
    save_file({"lin.weight": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
               "lin.bias": torch.randn(4, generator=g)}, str(ws / "f8.safetensors"))
    save_file({"lin.weight": torch.full((4, 4), 1e6), "lin.bias": torch.randn(4, generator=g)},
              str(ws / "big.safetensors"))
    (ws / "shd").mkdir()
    save_file({"lin.weight": torch.randn(4, 4, generator=g)}, str(ws / "shd" / "a.safetensors"))
    save_file({"other": torch.randn(4, generator=g)}, str(ws / "shd" / "b.safetensors"))
    (ws / "shd" / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"lin.weight": "a.safetensors", "lin.bias": "b.safetensors"}}))
    return ws


TA = ["merge", "--method", "task_arithmetic", "--base", "base.safetensors", "--expert", "e1.safetensors"]
NUMERICS_CASES = [
    ("merge-output-inf", [*TA, "--expert", "e2.safetensors", "--set", "scaling=1e39", "--out", "m"], INPUT,
     ["NaN or Inf", "'lin.weight'", "'lin.bias'", "scaling"]),
    ("merge-output-overflows-out-dtype", [*TA, "--expert", "big.safetensors", "--set", "scaling=1.0",
                                          "--out-dtype", "float16", "--out", "m.safetensors"], INPUT,
     ["NaN or Inf", "'lin.weight'", "float16"]),
    ("merge-float8-expert", [*MERGE[:-2], "--expert", "f8.safetensors", "--out", "m"], INPUT,
     ["f8.safetensors", "'lin.weight'", "F8_E4M3", "BF16"]),
    ("merge-key-listed-not-stored", [*MERGE[:-2], "--expert", "shd", "--out", "m"], INPUT,
     ["shd", "'lin.bias'", "index"]),
    ("extract-float8", ["extract-lora", "--base", "base.safetensors", "--tuned", "f8.safetensors", "--rank", "2",
                        "--out", "x"], INPUT, ["f8.safetensors", "F8_E4M3"]),
]


@pytest.mark.parametrize("argv, code, words", [c[1:] for c in NUMERICS_CASES], ids=[c[0] for c in NUMERICS_CASES])
def test_merge_numerics_and_contents_errors(ws_numerics, argv, code, words):
    before = _snapshot(ws_numerics)
    result = CliRunner().invoke(app, argv)
    _check(result, code, words, before, ws_numerics)
# run --plugin: a missing file, an unknown module name, a module that fails on import (its own block)
PLUGIN_CASES = [
    ("plugin-missing-file", [*RUN, "--plugin", "./nope_plugin.py", "--out", "r"], INPUT,
     ["--plugin ./nope_plugin.py", "no such file"]),
    ("plugin-unknown-module", [*RUN, "--plugin", "clmerge_no_such_plugin_mod", "--out", "r"], INPUT,
     ["--plugin clmerge_no_such_plugin_mod", "no module named"]),
    ("plugin-raises", [*RUN, "--plugin", "broken_plugin.py", "--out", "r"], INPUT,
     ["--plugin broken_plugin.py", "importing it failed", "ZeroDivisionError"]),
    ("plugin-syntax", [*RUN, "--plugin", "syntax_plugin.py", "--out", "r"], INPUT,
     ["--plugin syntax_plugin.py", "SyntaxError"]),
]


@pytest.mark.parametrize("argv, code, words", [c[1:] for c in PLUGIN_CASES], ids=[c[0] for c in PLUGIN_CASES])
def test_plugin_error_is_short_typed_and_leaves_nothing(ws, argv, code, words):
    (ws / "broken_plugin.py").write_text("x = 1 / 0\n")
    (ws / "syntax_plugin.py").write_text("def (:\n")
    before = _snapshot(ws)
    result = CliRunner().invoke(app, argv)
    _check(result, code, words, before, ws)
# `clmerge run NAME`: a shipped config by name; a bare unknown name is a usage error with the nearest name,
# a missing path an input error that names the shipped config of the same stem
CONFIG_NAME_CASES = [
    ("run-unknown-config-name", ["run", "sd_lora_imagenet_r_11", "--out", "r"], USAGE,
     ["sd_lora_imagenet_r_11", "did you mean 'sd_lora_imagenet_r_10'?"]),
    ("run-unknown-config-word", ["run", "zzzz", "--out", "r"], USAGE, ["zzzz", "clmerge configs"]),
    ("run-old-config-path", ["run", "configs/paper/pm_cifar100_10.yaml", "--out", "r"], INPUT,
     ["configs/paper/pm_cifar100_10.yaml", "clmerge run pm_cifar100_10"]),
]


@pytest.mark.parametrize("argv, code, words", [c[1:] for c in CONFIG_NAME_CASES],
                         ids=[c[0] for c in CONFIG_NAME_CASES])
def test_config_name_errors_are_short_typed_and_leave_nothing(ws, argv, code, words):
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, argv), code, words, before, ws)


def test_a_run_on_a_bundled_dataset_without_its_extra_names_pip_install(ws, monkeypatch):
    """tiny.yaml uses the scikit-learn digits: without the data extra, one input-error line naming it."""
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.delitem(sys.modules, "sklearn.datasets", raising=False)
    before = _snapshot(ws)
    words = ["digits", "scikit-learn", 'pip install "clmerge[data]"']
    _check(CliRunner().invoke(app, [*RUN, "--out", "r"]), INPUT, words, before, ws)
# -- a method owns its head: the statistics methods (simplecil, ranpac_rp) refuse the linear head
METHOD_HEAD_CASES = [
    ("run: the ranpac_rp default with the linear head", ["run", "--set", "head.classifier=linear", "--out", "r"],
     USAGE, ["head.classifier=linear", "'ranpac_rp' trains no linear head", "ncm or ranpac"]),
    ("run: simplecil with head.compare",
     ["run", "--set", "method.name=simplecil", "--set", "head.compare=true", "--out", "r"],
     USAGE, ["head.compare=true", "'simplecil'"]),
]


@pytest.mark.parametrize("argv, code, words", [c[1:] for c in METHOD_HEAD_CASES],
                         ids=[c[0] for c in METHOD_HEAD_CASES])
def test_a_method_head_error_is_short_typed_and_leaves_nothing(ws, argv, code, words):
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, argv), code, words, before, ws)
# -- adapter methods (aper, ease) need a transformer backbone; aper predicts with its prototypes
MLP = {"model": {"name": "mlp", "pretrained": False}}
ADAPTER_METHOD_CASES = [  # (what, method, config overrides, exit code, words): tiny_config with the method
    ("run: aper on a backbone without transformer blocks", "aper", MLP, USAGE,
     ["model.name", "transformer backbone", "'MLPNet'"]),
    ("run: ease on a backbone without transformer blocks", "ease", MLP, USAGE,
     ["model.name", "transformer backbone", "'MLPNet'"]),
    ("run: aper with the linear head", "aper", {"head": {"classifier": "linear"}}, USAGE,
     ["head.classifier=linear", "'aper'"]),
    ("run: aper with an unknown variant", "aper", {"method": {"name": "aper", "variant": "lora"}}, USAGE,
     ["variant", "lora"]),
    ("run: ease with a feature head", "ease", {"head": {"classifier": "ncm"}}, USAGE,
     ["head.classifier=ncm", "'ease'", "EaseClassifier"]),
]


@pytest.mark.parametrize("method, overrides, code, words", [c[1:] for c in ADAPTER_METHOD_CASES],
                         ids=[c[0] for c in ADAPTER_METHOD_CASES])
def test_an_adapter_method_error_is_short_typed_and_leaves_nothing(ws, method, overrides, code, words):
    (ws / "adapter_method.yaml").write_text(yaml.safe_dump({**tiny_config(method={"name": method}), **overrides}))
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, ["run", "adapter_method.yaml", "--out", "r"]), code, words, before, ws)


# ---------------------------------------------------------------------------------------------------------
# Hostile inputs: YAML bombs, corrupt run files, silent acceptance, locks and resume integrity. Each case gets
# the `ws` workspace plus the hostile files below and a copy of one finished 2-task run (`run/`, two
# checkpoints kept) and of an unfinished one (`half/`: task 0 only); checked like the table above, and every
# error line is short (a message echoing a huge input is clipped).
MAX_LINE = 2000


def _alias_bomb(levels: int = 9, width: int = 9) -> str:
    """A few hundred bytes that expand to width**levels nodes ("billion laughs")."""
    lines = ["a0: &a0 [" + ", ".join(["x"] * width) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def finished_run_dir(tmp_path_factory) -> Path:
    from clmerge.config import parse_config
    from clmerge.engine.run import run_experiment

    out = tmp_path_factory.mktemp("hostile") / "run"
    run_experiment(parse_config(tiny_config(**{"run.keep_checkpoints": 2})), out)
    return out


@pytest.fixture()
def hostile(ws, finished_run_dir):
    import json
    import shutil

    bomb = _alias_bomb()
    (ws / "bomb.yaml").write_text(yaml.safe_dump(tiny_config()) + bomb)
    (ws / "bomb_recipe.yaml").write_text("method: ties\nmodels: [e1.safetensors, e2.safetensors]\n" + bomb)
    (ws / "bomb_spec.yaml").write_text("name: s\n" + bomb)
    (ws / "deep_recipe.yaml").write_text("method: ties\nmodels: " + "[" * 50_000 + "]" * 50_000 + "\n")
    (ws / "huge.yaml").write_text("# " + "x" * (2 << 20) + "\n")
    shutil.copytree(finished_run_dir, ws / "run")
    shutil.copytree(finished_run_dir, ws / "half")  # killed after task 0: task 1's checkpoint never recorded
    (ws / "half" / "checkpoints" / "task_001.safetensors").unlink()
    (ws / "half" / "metrics.json").unlink()
    manifest = json.loads((ws / "half" / "manifest.json").read_text())
    del manifest["checkpoints"]["task_001.safetensors"]
    (ws / "half" / "manifest.json").write_text(json.dumps(manifest))
    return ws


def _corrupt(ws: Path, rel: str, data: bytes) -> None:
    (ws / "run" / rel).write_bytes(data)


def _forged_checkpoint(ws: Path, meta: str) -> None:
    """A readable checkpoint with foreign metadata, recorded with its true sha256 (so only its contents are
    wrong)."""
    import hashlib
    import json

    path = ws / "run" / "checkpoints" / "task_001.safetensors"
    save_file({"model/x": torch.zeros(2)}, str(path), metadata={"clmerge": meta})
    manifest = json.loads((ws / "run" / "manifest.json").read_text())
    manifest["checkpoints"][path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    (ws / "run" / "manifest.json").write_text(json.dumps(manifest))


def _bomb_in_an_older_run(ws: Path) -> None:
    """The run's config.yaml replaced by an alias bomb, in a run written before config hashes were recorded."""
    import json

    _corrupt(ws, "config.yaml", _alias_bomb().encode())
    manifest = json.loads((ws / "run" / "manifest.json").read_text())
    manifest.pop("config_sha256", None)
    (ws / "run" / "manifest.json").write_text(json.dumps(manifest))


def _edit_config(ws: Path) -> None:
    """A hand edit of the run's config.yaml (another class order), then passed back as the config."""
    cfg = ws / "run" / "config.yaml"
    cfg.write_text(cfg.read_text().replace("shuffle_classes: true", "shuffle_classes: false"))


RUN_STATE = 4
RESUME = ["run", "run/config.yaml", "--out", "run", "--resume"]
# (id, how to spoil the workspace (or None), argv, exit code, words in the message)
HOSTILE_CASES = [
    ("yaml-bomb-config", None, ["run", "bomb.yaml", "--out", "r"], INPUT, ["bomb.yaml", "aliases"]),
    ("yaml-bomb-recipe", None, ["merge", "bomb_recipe.yaml", "--out", "m"], INPUT, ["bomb_recipe.yaml", "aliases"]),
    ("yaml-bomb-study", None, ["study", "bomb_spec.yaml", "--out", "s"], INPUT, ["bomb_spec.yaml", "aliases"]),
    ("yaml-deep-recipe", None, ["merge", "deep_recipe.yaml", "--out", "m"], INPUT, ["deep_recipe.yaml", "deeper"]),
    ("yaml-huge-config", None, ["run", "huge.yaml", "--out", "r"], INPUT, ["huge.yaml", "larger than"]),
    ("yaml-bomb-set", None, [*RUN, "--set", "scenario.options=" + "[&a [x,x,x,x,x,x,x,x,x,x], " + ", ".join(
        f"&a{i} [{', '.join(['*a' if i == 0 else f'*a{i - 1}'] * 10)}]" for i in range(6)) + "]", "--out", "r"],
     USAGE, ["--set scenario.options", "aliases"]),
    ("yaml-bomb-run-config", _bomb_in_an_older_run, ["run", "tiny.yaml", "--out", "run", "--resume"], RUN_STATE,
     ["run/config.yaml", "aliases"]),
    ("yaml-bomb-study-dir", lambda ws: (ws / "sd").mkdir() or (ws / "sd" / "study.yaml").write_text(_alias_bomb()),
     ["study", str(STUDY_SPEC), "--out", "sd", "--resume"], RUN_STATE, ["sd/study.yaml", "aliases"]),
    ("data-option-wrong-type", None, [*RUN, "--set", "scenario.dataset=image_folder", "--set",
                                      "scenario.data_root=empty_dir", "--set", "scenario.options.subdir=5",
                                      "--out", "r"], USAGE, ["subdir", "string"]),
    # corrupt run files: resume / report / export give one line
    ("report-corrupt-metrics", lambda ws: _corrupt(ws, "metrics.json", b"{garbage"), ["report", "run"], INPUT,
     ["metrics.json"]),
    ("report-metrics-not-utf8", lambda ws: _corrupt(ws, "metrics.json", b"\xff\xfe{}"), ["report", "run"], INPUT,
     ["metrics.json"]),
    ("resume-events-not-utf8", lambda ws: _corrupt(ws, "events.jsonl", b"\xff\xfe garbage\n"), RESUME,
     RUN_STATE, ["events.jsonl", "UTF-8"]),
    ("resume-corrupt-manifest", lambda ws: _corrupt(ws, "manifest.json", b"{garbage"), RESUME, RUN_STATE,
     ["manifest.json"]),
    ("export-corrupt-checkpoint", lambda ws: _corrupt(ws, "checkpoints/task_001.safetensors", b"{garbage"),
     ["export", "run", "--format", "hf", "--out", "x"], RUN_STATE, ["task_001.safetensors"]),
    ("resume-foreign-checkpoint-meta", lambda ws: _forged_checkpoint(ws, '{"task": 1}'), RESUME, RUN_STATE,
     ["task_001.safetensors", "do not fit"]),
    ("export-foreign-checkpoint-meta", lambda ws: _forged_checkpoint(ws, "[]"),
     ["export", "run", "--format", "hf", "--out", "x"], RUN_STATE, ["task_001.safetensors"]),
    ("resume-foreign-checkpoint-tensors",
     lambda ws: _forged_checkpoint(ws, '{"task": 1, "state": {"events_lines": 0}, "structure": {}, "method": {}}'),
     RESUME, RUN_STATE, ["task_001.safetensors", "do not fit"]),
    # accepted without a word before
    ("bench-epochs-negative", None, ["merge-bench", "--epochs", "-1", "--out", "b"], USAGE, ["--epochs"]),
    ("bench-lr-nan", None, ["merge-bench", "--lr", "nan", "--out", "b"], USAGE, ["--lr"]),
    ("bench-corrupt-seed-result", lambda ws: (ws / "b" / "seed0").mkdir(parents=True) or
     (ws / "b" / "seed0" / "results.json").write_text("{garbage"),
     ["merge-bench", "--seeds", "0,1", "--random-init", "--out", "b"], INPUT, ["seed0/results.json"]),
    ("study-workers-negative", None, ["study", str(STUDY_SPEC), "--workers", "-1", "--out", "s"], USAGE,
     ["--workers"]),
    ("study-backend-unknown", None, ["study", str(STUDY_SPEC), "--backend", "nope", "--out", "s"], USAGE,
     ["--backend"]),
    ("export-unfinished-run", None, ["export", "half", "--format", "hf", "--out", "x"], RUN_STATE,
     ["task 1", "missing", "--resume"]),
    # resume integrity
    ("resume-hand-edited-config", _edit_config, RESUME, RUN_STATE, ["config.yaml", "edited", "manifest.json"]),
]


@pytest.mark.parametrize("spoil, argv, code, words", [c[1:] for c in HOSTILE_CASES],
                         ids=[c[0] for c in HOSTILE_CASES])
def test_hostile_input_is_short_typed_and_leaves_nothing(hostile, spoil, argv, code, words):
    if spoil is not None:
        spoil(hostile)
    before = _snapshot(hostile)
    result = CliRunner().invoke(app, argv)
    _check(result, code, words, before, hostile)
    assert all(len(ln) <= MAX_LINE for ln in result.stderr.splitlines()), "an error line is not clipped"


@pytest.fixture()
def other_process():
    """A live process unrelated to any run (its pid is what a stale lock may hold after pid reuse)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_lock_held_by_a_live_run_refuses_with_the_run_state_code(hostile, other_process):
    (hostile / "run" / ".lock").write_text(str(other_process.pid))  # written after its process started: held
    before = _snapshot(hostile)
    result = CliRunner().invoke(app, RESUME)
    _check(result, RUN_STATE, [f"process {other_process.pid}", ".lock"], before, hostile)


@pytest.mark.parametrize("form", ["bare-pid", "record"])
def test_a_stale_lock_whose_pid_was_reused_does_not_block_resume(hostile, other_process, form):
    """The lock's pid now belongs to an unrelated live process started after the lock was written."""
    import json
    import time

    lock = hostile / "run" / ".lock"
    if form == "bare-pid":  # written by an older clmerge: only the file's time tells the pid was reused
        lock.write_text(str(other_process.pid))
        os.utime(lock, (time.time() - 3600, time.time() - 3600))
    else:
        from clmerge.engine.checkpoint import _lock_record

        record = _lock_record(other_process.pid)
        if record["start_ticks"] is None:
            pytest.skip("no /proc start times on this system")
        lock.write_text(json.dumps(record | {"start_ticks": record["start_ticks"] - 100}))
    result = CliRunner().invoke(app, RESUME)
    assert result.exit_code == 0, result.output
    assert not lock.exists()


def test_a_refused_resume_leaves_a_stale_lock_in_place(hostile):
    """Nothing in the run directory changes on a refusal, a stale lock (of a dead process) included."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (hostile / "run" / ".lock").write_text(str(dead.pid))
    _corrupt(hostile, "checkpoints/task_001.safetensors", b"{garbage")  # refused under the lock
    before = _snapshot(hostile)
    lock_bytes = (hostile / "run" / ".lock").read_bytes()
    result = CliRunner().invoke(app, RESUME)
    _check(result, RUN_STATE, ["task_001.safetensors"], before, hostile)
    assert (hostile / "run" / ".lock").read_bytes() == lock_bytes


def test_the_command_printed_after_ctrl_c_resumes_the_run(ws, monkeypatch):
    """Interrupted after task 0 of a run started with --set overrides: the printed command works as printed."""
    import shlex

    from clmerge.engine import run as run_module

    real_save = run_module.save_checkpoint

    def save_then_interrupt(*args, **kwargs):
        path = real_save(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "save_checkpoint", save_then_interrupt)
    result = CliRunner().invoke(app, [*RUN, "--set", "train.epochs=1", "--set", "seed=3", "--out", "r"])
    assert result.exit_code == 130, result.output
    command = result.stderr.split("continue with: ")[1].strip()
    words = shlex.split(command)
    assert words[:2] == ["clmerge", "run"] and "--resume" in words, command
    monkeypatch.setattr(run_module, "save_checkpoint", real_save)
    resumed = CliRunner().invoke(app, words[1:])
    assert resumed.exit_code == 0, resumed.output


def test_an_error_line_is_cut_at_the_line_limit(capsys):
    from clmerge.cli import base as cli_support

    cli_support.print_error("x" * 50_000)
    err = capsys.readouterr().err
    assert len(err) < cli_support.MAX_LINE + 20 and err.rstrip().endswith("…")


# -- thread counts: a count far above the cores used to crash the OpenMP runtime (a traceback, then a
# segmentation fault), so these run in a subprocess, where the old crash fails the case instead of pytest.
THREAD_CASES = [
    ("run-threads-huge", [*RUN, "--set", "run.threads=100000", "--out", "r"], ["run.threads", "at most"]),
    ("merge-threads-huge", [*MERGE, "--threads", "100000", "--out", "m"], ["--threads", "at most", "100000"]),
    ("pretrain-threads-huge", ["pretrain", "--threads", "100000", "--out", "p"], ["--threads", "at most"]),
]


@pytest.mark.parametrize("argv, words", [c[1:] for c in THREAD_CASES], ids=[c[0] for c in THREAD_CASES])
def test_thread_count_out_of_range_is_one_usage_error(ws, argv, words):
    before = _snapshot(ws)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "clmerge", *argv], cwd=ws, env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == USAGE, (proc.returncode, proc.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert _snapshot(ws) == before, "the file system changed"


# -- one vocabulary on the command line (docs/cli.md): an old and a new spelling of one option together --
VOCABULARY_CASES = [
    ("study-workers-and-jobs", ["study", str(STUDY_SPEC), "--out", "s", "--workers", "2", "--jobs", "3"], USAGE,
     ["--workers", "--jobs"]),
    ("study-jobs-negative", ["study", str(STUDY_SPEC), "--out", "s", "--jobs", "-1"], USAGE, ["--jobs"]),
    ("predict-not-fits", ["predict", "study", "lr=0.03"], INPUT, ["fits.json", "laws"]),
    ("predict-unknown-method", ["predict", "old_study", "--method", "avreaging"], USAGE,
     ["avreaging", "weight_average"]),
]


@pytest.mark.parametrize("argv, code, words", [c[1:] for c in VOCABULARY_CASES],
                         ids=[c[0] for c in VOCABULARY_CASES])
def test_vocabulary_errors_are_short_typed_and_leave_nothing(ws, argv, code, words):
    (ws / "old_study").mkdir()  # fits written under the study's old method name
    (ws / "old_study" / "fits.json").write_bytes((REPO / "benchmarks/theory/interaction/fits.json").read_bytes())
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, argv), code, words, before, ws)


# The SVD merges (TSV-M, TSV-C, Iso-C, Iso-CTS): out-of-range hyperparameters are usage errors, nothing written.
SVD_MERGE = ["merge", "--base", "base.safetensors", "--expert", "e1.safetensors", "--expert", "e2.safetensors",
             "--out", "m"]
SVD_MERGE_CASES = [
    ("iso-cts-fraction", [*SVD_MERGE, "--method", "iso_cts", "--set", "common_space_fraction=1.5"], USAGE,
     ["common_space_fraction", "[0, 1]", "1.5"]),
    ("tsv-m-svd", [*SVD_MERGE, "--method", "tsv_m", "--set", "svd=fast"], USAGE, ["svd", "randomized", "fast"]),
    ("tsv-c-rank-ratio", [*SVD_MERGE, "--method", "tsv_c", "--task", "all", "--set", "rank_ratio=2"], USAGE,
     ["rank_ratio", "[0, 1]"]),
    ("tsv-c-no-task", [*SVD_MERGE, "--method", "tsv_c"], USAGE, ["--task"]),
    ("tsv-c-task-range", [*SVD_MERGE, "--method", "tsv_c", "--task", "2"], USAGE, ["--task", "out of range"]),
]


@pytest.mark.parametrize("argv, code, words", [c[1:] for c in SVD_MERGE_CASES],
                         ids=[c[0] for c in SVD_MERGE_CASES])
def test_svd_merge_error_is_short_typed_and_leaves_nothing(ws, argv, code, words):
    before = _snapshot(ws)
    result = CliRunner().invoke(app, argv)
    _check(result, code, words, before, ws)


# KnOTS and WUDI: out-of-range or unknown hyperparameters are usage errors, nothing written.
KNOTS_WUDI_CASES = [
    ("knots-merge", [*SVD_MERGE, "--method", "knots", "--set", "merge=magmax"], USAGE,
     ["merge", "ties, dare, ta", "'magmax'"]),
    ("knots-density", [*SVD_MERGE, "--method", "knots", "--set", "density=0"], USAGE, ["density", "(0, 1]"]),
    ("knots-drop-rate", [*SVD_MERGE, "--method", "knots", "--set", "merge=dare", "--set", "drop_rate=1"], USAGE,
     ["drop_rate", "[0, 1)"]),
    ("wudi-optimizer", [*SVD_MERGE, "--method", "wudi", "--set", "optimizer=lbfgs"], USAGE,
     ["optimizer", "adam, sgd", "'lbfgs'"]),
    ("wudi-steps", [*SVD_MERGE, "--method", "wudi", "--set", "steps=-1"], USAGE, ["steps", ">= 0", "-1"]),
    ("wudi-steps-float", [*SVD_MERGE, "--method", "wudi", "--set", "steps=1.5"], USAGE, ["steps", "integer", "1.5"]),
    ("wudi-lr", [*SVD_MERGE, "--method", "wudi", "--set", "lr=0"], USAGE, ["lr", "> 0"]),
]


@pytest.mark.parametrize("argv, code, words", [c[1:] for c in KNOTS_WUDI_CASES],
                         ids=[c[0] for c in KNOTS_WUDI_CASES])
def test_knots_wudi_error_is_short_typed_and_leaves_nothing(ws, argv, code, words):
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, argv), code, words, before, ws)
# -- clmerge results (tables across runs): a sweep folder "sw" of two seeds; "mixed" holds runs of one method
# whose configs differ in optim.lr; "unfinished" holds only a run without metrics.json; "twice" the same seed
RESULTS_CASES = [
    ("results-unknown-metric", ["results", "sw", "--metrics", "acc,accuracy"], USAGE,
     ["--metrics", "'accuracy'", "known: acc, aaa"]),
    ("results-unknown-format", ["results", "sw", "--format", "xlsx"], USAGE, ["--format xlsx", "md, csv"]),
    ("results-unknown-by-key", ["results", "sw", "--by", "method.nmae"], USAGE, ["--by", "method.nmae"]),
    ("results-empty-by", ["results", "sw", "--by", ","], USAGE, ["--by"]),
    ("results-unknown-vs", ["results", "sw", "--vs", "sd_lora"], USAGE, ["--vs sd_lora", "'seq_lora'"]),
    ("results-missing-dir", ["results", "nope"], INPUT, ["nope", "no such folder"]),
    ("results-no-runs", ["results", "empty_dir"], INPUT, ["empty_dir", "no run directory"]),
    ("results-dir-is-file", ["results", "tiny.yaml"], INPUT, ["tiny.yaml", "not a folder"]),
    ("results-only-unfinished", ["results", "unfinished"], INPUT, ["no finished run", "unfinished"]),
    ("results-configs-differ", ["results", "mixed"], INPUT,
     ["'seq_lora'", "optim.lr", "mixed/a", "mixed/b", "--ignore"]),
    ("results-same-seed-twice", ["results", "twice"], INPUT, ["twice/a", "twice/b", "seed=0", "twice"]),
    ("results-bad-metrics-json", ["results", "badjson"], INPUT, ["badjson/a/metrics.json", "not valid JSON"]),
    ("results-output-is-dir", ["results", "sw", "--output", "full"], OUTPUT, ["--output full", "folder"]),
    ("results-output-is-input", ["results", "sw", "--output", "sw/s0/metrics.json"], OUTPUT,
     ["--output", "input"]),
    ("results-output-under-file", ["results", "sw", "--output", "foreign.safetensors/t.md"], OUTPUT,
     ["--output", "is a file"]),
]


def _results_runs(ws: Path) -> None:
    from report_helpers import write_seed_run

    for s in (0, 1):
        write_seed_run(ws / "sw" / f"s{s}", "seq_lora", s, 80.0 + s)
    write_seed_run(ws / "mixed" / "a", "seq_lora", 0, 80.0)
    write_seed_run(ws / "mixed" / "b", "seq_lora", 1, 80.0, optim={"lr": 0.1})
    write_seed_run(ws / "unfinished" / "a", "seq_lora", 0, None, finished=False)
    write_seed_run(ws / "twice" / "a", "seq_lora", 0, 80.0)
    write_seed_run(ws / "twice" / "b", "seq_lora", 0, 80.0)
    (write_seed_run(ws / "badjson" / "a", "seq_lora", 0, 80.0) / "metrics.json").write_text("{not json")


@pytest.mark.parametrize("argv, code, words", [c[1:] for c in RESULTS_CASES], ids=[c[0] for c in RESULTS_CASES])
def test_results_errors_are_short_typed_and_leave_nothing(ws, argv, code, words):
    _results_runs(ws)
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, argv), code, words, before, ws)


# -- clmerge report on a sweep directory: the folders of the results block above (their runs have no accuracy
# matrix); nothing is written, not even the runs' own pages, when the page cannot be made
REPORT_SWEEP_CASES = [
    ("report-sweep-no-matrix", ["report", "sw"], INPUT, ["sw/s0/metrics.json", "accuracy_matrix"]),
    ("report-sweep-configs-differ", ["report", "mixed"], INPUT, ["optim.lr", "--ignore"]),
    ("report-sweep-unknown-vs", ["report", "sw", "--vs", "sd_lora"], USAGE, ["--vs sd_lora", "'seq_lora'"]),
    ("report-sweep-unknown-by", ["report", "sw", "--by", "method.nmae"], USAGE, ["--by", "method.nmae"]),
    ("report-sweep-unknown-metric", ["report", "sw", "--metrics", "accuracy"], USAGE, ["--metrics", "'accuracy'"]),
    ("report-sweep-no-runs", ["report", "empty_dir"], INPUT, ["empty_dir", "no run directory"]),
    ("report-sweep-only-unfinished", ["report", "unfinished"], INPUT, ["no finished run"]),
    ("report-run-with-vs", ["report", "sw/s0", "--vs", "seq_lora"], USAGE, ["--vs", "only for a sweep directory"]),
]


@pytest.mark.parametrize("argv, code, words", [c[1:] for c in REPORT_SWEEP_CASES],
                         ids=[c[0] for c in REPORT_SWEEP_CASES])
def test_sweep_report_errors_are_short_typed_and_leave_nothing(ws, argv, code, words):
    _results_runs(ws)
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, argv), code, words, before, ws)


def test_sweep_report_in_an_unwritable_folder_writes_no_run_page_either(ws, monkeypatch):
    from report_helpers import write_matrix_run

    for s in (0, 1):
        write_matrix_run(ws / "ro" / f"seed{s}", "seq_lora", s, [[90.0, None], [50.0, 80.0 + s]])
    real_access = os.access  # deny writing in "ro" in the check itself (root writes anywhere)
    monkeypatch.setattr(outpaths.os, "access", lambda p, mode: real_access(p, mode) and
                        not (Path(p).resolve() == (ws / "ro").resolve() and mode & os.W_OK))
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, ["report", "ro"]), OUTPUT, ["ro/report.html", "permission denied"], before, ws)
# merge with mergekit's other methods: a wrong number of models or a bad value (their own block)
ONE_EXPERT = ["--base", "base.safetensors", "--expert", "e1.safetensors"]
MERGEKIT_METHOD_CASES = [
    ("nuslerp-three-experts", ["merge", "--method", "nuslerp", *ONE_EXPERT, "--expert", "e2.safetensors",
                               "--expert", "base.safetensors", "--out", "m"], USAGE, ["nuslerp", "two experts", "3"]),
    ("nuslerp-three-weights", ["merge", "--method", "nuslerp", *ONE_EXPERT, "--expert", "e2.safetensors",
                               "--set", "weights=[1,2,3]", "--out", "m"], USAGE, ["weights", "3", "2 experts"]),
    ("nearswap-two-experts", ["merge", "--method", "nearswap", *ONE_EXPERT, "--expert", "e2.safetensors",
                              "--out", "m"], USAGE, ["nearswap", "exactly one expert"]),
    ("nearswap-t-zero", ["merge", "--method", "nearswap", *ONE_EXPERT, "--set", "t=0", "--out", "m"], USAGE,
     ["t must be > 0"]),
    ("arcee-fusion-two-experts", ["merge", "--method", "arcee_fusion", *ONE_EXPERT, "--expert", "e2.safetensors",
                                  "--out", "m"], USAGE, ["arcee_fusion", "exactly one expert"]),
    ("sce-topk-above-one", ["merge", "--method", "sce", *ONE_EXPERT, "--set", "select_topk=1.5", "--out", "m"],
     USAGE, ["select_topk", "1.5"]),
    ("della-linear-epsilon", ["merge", "--method", "della_linear", *ONE_EXPERT, "--set", "epsilon=1.2",
                              "--out", "m"], USAGE, ["epsilon", "1.2"]),
]


@pytest.mark.parametrize("argv, code, words", [c[1:] for c in MERGEKIT_METHOD_CASES],
                         ids=[c[0] for c in MERGEKIT_METHOD_CASES])
def test_mergekit_method_errors_are_short_typed_and_leave_nothing(ws, argv, code, words):
    before = _snapshot(ws)
    result = CliRunner().invoke(app, argv)
    _check(result, code, words, before, ws)


def test_multislerp_of_balanced_opposites_is_a_one_line_error_naming_the_key(ws):
    w = {"lin.weight": torch.ones(4, 4), "lin.bias": torch.ones(4)}
    save_file(w, str(ws / "pos.safetensors"))
    save_file({k: -v for k, v in w.items()}, str(ws / "neg.safetensors"))
    before = _snapshot(ws)
    argv = ["merge", "--method", "multislerp", *[a for f in ("pos", "neg", "pos", "neg")
                                                 for a in ("--expert", f"{f}.safetensors")], "--out", "m"]
    _check(CliRunner().invoke(app, argv), USAGE, ["multislerp", "'lin.", "weights"], before, ws)
# -- rehearsal methods (er, der, derpp): their buffer and loss options are checked before any work
REHEARSAL_CASES = [
    ("run: der with an empty buffer", ["run", "--set", "method.name=der", "--set", "method.buffer_size=0",
                                       "--out", "r"],
     USAGE, ["method.buffer_size", "greater than or equal to 1", "got 0"]),
    ("run: der with an unknown logit padding",
     ["run", "--set", "method.name=der", "--set", "method.logit_padding=pad", "--out", "r"],
     USAGE, ["method.logit_padding", "'zero' or 'mask'", "got 'pad'"]),
    ("run: der given derpp's beta", ["run", "--set", "method.name=der", "--set", "method.beta=0.5", "--out", "r"],
     USAGE, ["method.beta", "'der'", "alpha"]),
]


@pytest.mark.parametrize("argv, code, words", [c[1:] for c in REHEARSAL_CASES],
                         ids=[c[0] for c in REHEARSAL_CASES])
def test_a_rehearsal_option_error_is_short_typed_and_leaves_nothing(ws, argv, code, words):
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, argv), code, words, before, ws)


# -- sweep and run --seeds: spec errors, output folders (docs/sweeps.md) ----------------------------------------

RUN_STATE = 4
SWEEP_SPECS = {
    "sweep.yaml": {"base": "tiny.yaml", "grid": {"seed": [0, 1]}},
    "unknown-key.yaml": {"base": "tiny.yaml", "grids": {"seed": [0]}},
    "not-a-list.yaml": {"base": "tiny.yaml", "grid": {"seed": 0}},
    "bad-value.yaml": {"base": "tiny.yaml", "grid": {"optim.lr": [0.1, "abc"]}},
    "bad-key.yaml": {"base": "tiny.yaml", "set": {"optim.lrr": 0.1}},
    "missing-base.yaml": {"base": "nope.yaml", "grid": {"seed": [0]}},
    "in-both.yaml": {"base": "tiny.yaml", "set": {"seed": 1}, "grid": {"seed": [0]}},
}

# (id, argv, exit code, words in the message)
SWEEP_CASES = [
    ("sweep-missing-spec", ["sweep", "nope.yaml", "--out", "s"], INPUT, ["nope.yaml"]),
    ("sweep-unknown-key", ["sweep", "unknown-key.yaml", "--out", "s"], USAGE, ["grids", "unknown key"]),
    ("sweep-grid-not-a-list", ["sweep", "not-a-list.yaml", "--out", "s"], USAGE, ["grid.seed", "list"]),
    ("sweep-bad-cell-value", ["sweep", "bad-value.yaml", "--out", "s"], USAGE, ["lrabc", "optim.lr"]),
    ("sweep-bad-set-key", ["sweep", "bad-key.yaml", "--out", "s"], USAGE, ["lrr"]),
    ("sweep-bad-cell-dry-run", ["sweep", "bad-value.yaml", "--dry-run"], USAGE, ["optim.lr"]),
    ("sweep-missing-base", ["sweep", "missing-base.yaml", "--out", "s"], INPUT, ["nope.yaml"]),
    ("sweep-key-in-both", ["sweep", "in-both.yaml", "--out", "s"], USAGE, ["seed", "both"]),
    ("sweep-no-out", ["sweep", "sweep.yaml"], USAGE, ["--out"]),
    ("sweep-backend", ["sweep", "sweep.yaml", "--backend", "nope", "--out", "s"], USAGE, ["--backend"]),
    ("sweep-out-foreign-dir", ["sweep", "sweep.yaml", "--out", "full"], OUTPUT, ["full", "--overwrite"]),
    ("sweep-out-is-file", ["sweep", "sweep.yaml", "--out", "foreign.safetensors"], OUTPUT, ["not a folder"]),
    ("sweep-resume-no-sweep", ["sweep", "sweep.yaml", "--out", "empty_dir", "--resume"], RUN_STATE,
     ["sweep.yaml", "empty_dir"]),
    ("sweep-plugin-with-jobs", ["sweep", "sweep.yaml", "--plugin", "x", "--jobs", "2", "--out", "s"], USAGE,
     ["--plugin", "--jobs"]),
    ("run-seeds-not-integers", [*RUN, "--seeds", "a,b", "--out", "r"], USAGE, ["--seeds", "0,1,2"]),
    ("run-seeds-repeated", [*RUN, "--seeds", "1,1", "--out", "r"], USAGE, ["--seeds", "distinct"]),
    ("run-seeds-with-orders", [*RUN, "--seeds", "0,1", "--orders", "2", "--out", "r"], USAGE, ["--orders"]),
    ("run-seeds-resume-no-out", [*RUN, "--seeds", "0,1", "--resume"], USAGE, ["--out"]),
    ("run-seeds-out-foreign-dir", [*RUN, "--seeds", "0,1", "--out", "full"], OUTPUT, ["full"]),
]


@pytest.mark.parametrize("argv, code, words", [c[1:] for c in SWEEP_CASES], ids=[c[0] for c in SWEEP_CASES])
def test_sweep_user_error_is_short_typed_and_leaves_nothing(ws, argv, code, words):
    for name, spec in SWEEP_SPECS.items():
        (ws / name).write_text(yaml.safe_dump(spec))
    before = _snapshot(ws)
    result = CliRunner().invoke(app, argv)
    _check(result, code, words, before, ws)


def test_sweep_refuses_an_unwritable_out_before_any_work(ws, monkeypatch):
    (ws / "sweep.yaml").write_text(yaml.safe_dump(SWEEP_SPECS["sweep.yaml"]))
    test_unwritable_out_is_refused_before_any_work(ws, ["sweep", "sweep.yaml", "--out", "ro/s"], monkeypatch)


# -- log sinks (run.log): a sink whose package is missing, before the run directory exists
@pytest.mark.parametrize("sink", ["tensorboard", "wandb"])
def test_a_log_sink_without_its_package_is_one_input_error_line(ws, monkeypatch, sink):
    monkeypatch.setitem(sys.modules, sink, None)  # as if not installed
    before = _snapshot(ws)
    words = [f"run.log: {sink}", f'pip install "clmerge[{sink}]"']
    _check(CliRunner().invoke(app, [*RUN, "--set", f"run.log=[{sink}]", "--out", "r"]), INPUT, words, before, ws)



# -- data sources: an option the source does not take (builders swallow the engine's generic arguments with
# `**_`, so a misspelt option used to vanish without a word)
def test_an_unknown_data_option_is_one_usage_line_naming_it(ws):
    before = _snapshot(ws)
    argv = [*RUN, "--set", "scenario.options.test_fractoin=0.5", "--out", "r"]
    words = ["scenario.options.test_fractoin", "test_fraction"]
    _check(CliRunner().invoke(app, argv), USAGE, words, before, ws)


# -- worker pools of a mistyped size are refused before anything forks (at most 4 x the CPUs)
@pytest.mark.parametrize("argv", [["sweep", "sweep.yaml", "--jobs", "100000", "--out", "s"],
                                  ["study", str(STUDY_SPEC), "--jobs", "100000", "--out", "s"],
                                  [*RUN, "--nproc", "100000", "--out", "r"]],
                         ids=["sweep", "study", "run-nproc"])
def test_a_huge_jobs_count_is_one_usage_line(ws, argv):
    (ws / "sweep.yaml").write_text(yaml.safe_dump(SWEEP_SPECS["sweep.yaml"]))
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, argv), USAGE, [argv[-3], "100000", "CPUs"], before, ws)


def test_pretrain_with_zero_epochs_is_refused_not_ignored(ws):
    """``--epochs 0`` used to fall back to the preset's epochs without a word and train for minutes."""
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, ["pretrain", "--epochs", "0", "--out", "p"]), USAGE, ["--epochs", "greater than or equal to 1"], before, ws)
# -- merging models whose vocabularies differ (recipe keys embeddings, fill, chat_template_from)
def _vocab_ws(ws: Path) -> None:
    """Recipes for the vocabulary cases; tokbase / tokexp: folders with a tokenizer (and no embedding matrix),
    notok: a model folder without one."""
    from vocab_helpers import tiny_tokenizer

    for name in ("tokbase", "tokexp", "notok"):
        (ws / name).mkdir()
        (ws / name / "model.safetensors").write_bytes((ws / "e1.safetensors").read_bytes())
        if name != "notok":
            tiny_tokenizer(["<unk>", "<s>", "</s>", "a"]).save_pretrained(ws / name)
    files = {"models": ["e1.safetensors", "e2.safetensors"], "method": "weight_average"}
    recipes = {"emb_value": {**files, "embeddings": "everything"},
               "fill_value": {**files, "embeddings": "union", "fill": "random"},
               "no_tok_file": {**files, "embeddings": "union"},
               "fill_alone": {**files, "fill": "zero"},
               "no_tok_folder": {"method": "task_arithmetic", "base": "tokbase", "models": ["notok"],
                                 "embeddings": "union"},
               "no_matrix": {"method": "task_arithmetic", "base": "tokbase", "models": ["tokexp"],
                             "embeddings": "union"},
               "chat_other": {"method": "task_arithmetic", "base": "tokbase", "models": ["tokexp"],
                              "embeddings": "union", "chat_template_from": "elsewhere"},
               "tok_other": {"method": "task_arithmetic", "base": "tokbase", "models": ["tokexp"],
                             "embeddings": "base", "tokenizer_from": "elsewhere"}}
    for name, recipe in recipes.items():
        (ws / f"{name}.yaml").write_text(yaml.safe_dump(recipe))


VOCAB_CASES = [
    ("vocab-unknown-embeddings", "emb_value", USAGE, ["emb_value.yaml", "embeddings", "'union'"]),
    ("vocab-unknown-fill", "fill_value", USAGE, ["fill", "'present'"]),
    ("vocab-fill-without-embeddings", "fill_alone", USAGE, ["fill", "only with embeddings"]),
    ("vocab-weights-file-has-no-tokenizer", "no_tok_file", INPUT, ["e1.safetensors", "has no tokenizer"]),
    ("vocab-folder-without-tokenizer", "no_tok_folder", INPUT, ["notok", "no tokenizer in notok"]),
    ("vocab-no-embedding-matrix", "no_matrix", INPUT, ["tokbase", "no embedding matrix", "embed_tokens"]),
    ("vocab-chat-template-not-an-input", "chat_other", USAGE, ["chat_template_from", "'elsewhere'"]),
    ("vocab-tokenizer-from-not-an-input", "tok_other", USAGE, ["tokenizer_from", "'elsewhere'"]),
]


@pytest.mark.parametrize("recipe, code, words", [c[1:] for c in VOCAB_CASES], ids=[c[0] for c in VOCAB_CASES])
def test_vocabulary_merge_error_is_short_typed_and_leaves_nothing(ws, recipe, code, words):
    _vocab_ws(ws)
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, ["merge", f"{recipe}.yaml", "--out", "m"]), code, words, before, ws)
# --- merge recipes with layer slices (each error names the slice, exit code 3) and stages (its own block) ---

def _layers_file(path: Path, n: int, width: int = 4) -> None:
    g = torch.Generator().manual_seed(n + width)
    sd = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(width, 4, generator=g) for i in range(n)}
    sd["model.embed_tokens.weight"] = torch.randn(8, 4, generator=g)
    save_file(sd, str(path))


def _slice_recipe(name: str, *sources: list, method: str = "passthrough") -> list[str]:
    Path(name).write_text(yaml.safe_dump({"method": method,
                                          "slices": [{"sources": list(s)} for s in sources]}))
    return ["merge", name, "--out", "m"]


def _src(model: str, a: int, b: int) -> dict:
    return {"model": model, "layer_range": [a, b]}


SLICE_CASES = [
    ("slice-range-past-end", lambda: _slice_recipe("r.yaml", [_src("l2.safetensors", 0, 2)],
                                                   [_src("l2.safetensors", 1, 3)]),
     INPUT, ["slices[1].sources[0]", "layer_range [1, 3]", "2 layers"]),
    ("slice-range-empty", lambda: _slice_recipe("r.yaml", [_src("l2.safetensors", 1, 1)]),
     INPUT, ["slices[0].sources[0]", "layer_range [1, 1]"]),
    ("slice-unknown-model", lambda: _slice_recipe("r.yaml", [_src("l2.safetensors", 0, 1)],
                                                  [_src("nope_model", 0, 1)]),
     INPUT, ["slices[1].sources[0]", "nope_model"]),
    ("slice-shape-mismatch", lambda: _slice_recipe("r.yaml", [_src("l2.safetensors", 0, 1)],
                                                   [_src("wide.safetensors", 0, 1)]),
     INPUT, ["slices[1].sources[0]", "wide.safetensors", "[6, 4]", "[4, 4]"]),
    ("slice-uneven-sources", lambda: _slice_recipe("r.yaml", [_src("l2.safetensors", 0, 2),
                                                               _src("l3.safetensors", 0, 3)],
                                                  method="weight_average"),
     INPUT, ["slices[0]", "different numbers of layers"]),
    ("slice-passthrough-two-sources", lambda: _slice_recipe("r.yaml", [_src("l2.safetensors", 0, 2),
                                                                        _src("l3.safetensors", 0, 2)]),
     INPUT, ["slices[0]", "passthrough", "weight_average"]),
    ("slice-nan-input", lambda: _slice_recipe("r.yaml", [_src("l2.safetensors", 0, 1)],
                                              [_src("nan.safetensors", 1, 2)]),
     INPUT, ["slices[1]", "'model.layers.1.mlp.up_proj.weight'", "nan.safetensors", "NaN"]),
    ("stage-unknown-name", lambda: _stage_recipe("st.yaml", "s2"),
     INPUT, ["the final merge", "models[0].model", "'s2'", "earlier stage (s1)"]),
    ("stage-unnamed", lambda: _stage_recipe("st.yaml", "s1", name=None),
     USAGE, ["stages[0]", "needs a name"]),
]


def _stage_recipe(path: str, ref: str, **stage: Any) -> list[str]:
    first = {"name": "s1", "method": "task_arithmetic", "base": "base.safetensors", "models": ["e1.safetensors"],
             **stage}
    Path(path).write_text(yaml.safe_dump({"stages": [{k: v for k, v in first.items() if v is not None}],
                                          "method": "ties", "base": "base.safetensors",
                                          "models": [ref, "e2.safetensors"]}))
    return ["merge", path, "--out", "m"]


@pytest.mark.parametrize("make, code, words", [c[1:] for c in SLICE_CASES], ids=[c[0] for c in SLICE_CASES])
def test_slice_recipe_errors_name_the_slice(ws, make, code, words):
    _layers_file(ws / "l2.safetensors", 2)
    _layers_file(ws / "l3.safetensors", 3)
    _layers_file(ws / "wide.safetensors", 2, width=6)
    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(4, 4),
               "model.layers.1.mlp.up_proj.weight": torch.full((4, 4), float("nan")),
               "model.embed_tokens.weight": torch.zeros(8, 4)}, str(ws / "nan.safetensors"))
    argv = make()
    before = _snapshot(ws)
    result = CliRunner().invoke(app, argv)
    _check(result, code, words, before, ws)


# --- clmerge moe: recipe keys, prompts, inputs (its own block) ---

def _moe_recipe(**over: Any) -> list[str]:
    data = {"base_model": "base.safetensors", "gate_mode": "random",
            "experts": [{"source_model": "e1.safetensors"}, {"source_model": "e2.safetensors"}], **over}
    Path("moe.yaml").write_text(yaml.safe_dump(data))
    return ["moe", "moe.yaml", "--out", "m"]


MOE_CASES = [
    ("moe-unknown-key", lambda: _moe_recipe(gate_mod="hidden"), USAGE, ["gate_mod", "gate_mode"]),
    ("moe-no-prompts", lambda: _moe_recipe(gate_mode="hidden"), USAGE, ["experts[0].positive_prompts", "random"]),
    ("moe-too-many-per-token", lambda: _moe_recipe(experts_per_token=3), USAGE, ["experts_per_token", "2 experts"]),
    ("moe-base-without-config", lambda: _moe_recipe(), INPUT, ["base_model base.safetensors", "config.json"]),
    ("moe-missing-expert", lambda: _moe_recipe(base_model="llama", experts=[{"source_model": "nope"},
                                                                             {"source_model": "e1.safetensors"}]),
     INPUT, ["experts[0].source_model", "nope"]),
]


@pytest.mark.parametrize("make, code, words", [c[1:] for c in MOE_CASES], ids=[c[0] for c in MOE_CASES])
def test_moe_errors_are_one_line_and_leave_nothing(ws, make, code, words):
    (ws / "llama").mkdir()
    (ws / "llama" / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 1}))
    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)}, str(ws / "llama" / "model.safetensors"))
    argv = make()
    before = _snapshot(ws)
    result = CliRunner().invoke(app, argv)
    _check(result, code, words, before, ws)
# -- sweep select: / link: blocks (a key chosen on validation; docs/sweeps.md) -----------------------------------

_SEL_BASE = {"base": "tiny.yaml", "set": {"scenario.val_fraction": 0.2}, "grid": {"method.name": ["seq_lora"],
                                                                                   "seed": [0, 1]}}
_SEL = {"key": "optim.lr", "values": [1e-3, 1e-2]}
SELECT_SPECS = {
    "sel-unknown.yaml": {**_SEL_BASE, "select": {**_SEL, "metrics": "acc"}},
    "sel-not-mapping.yaml": {**_SEL_BASE, "select": ["optim.lr"]},
    "sel-no-key.yaml": {**_SEL_BASE, "select": {"values": [1e-3]}},
    "sel-key-in-grid.yaml": {**_SEL_BASE, "grid": {"optim.lr": [0.1], "seed": [0]}, "select": _SEL},
    "sel-empty-values.yaml": {**_SEL_BASE, "select": {**_SEL, "values": []}},
    "sel-extend-one-value.yaml": {**_SEL_BASE, "select": {**_SEL, "values": [1e-3], "extend": 1}},
    "sel-extend-not-numbers.yaml": {**_SEL_BASE, "select": {**_SEL, "values": ["a", "b"], "extend": 1}},
    "sel-extend-negative.yaml": {**_SEL_BASE, "select": {**_SEL, "extend": -1}},
    "sel-metric.yaml": {**_SEL_BASE, "select": {**_SEL, "metric": "test_acc"}},
    "sel-seeds.yaml": {**_SEL_BASE, "select": {**_SEL, "seeds": [0, 0]}},
    "sel-per-not-grid.yaml": {**_SEL_BASE, "select": {**_SEL, "per": ["optim.name"]}},
    "sel-no-val.yaml": {**_SEL_BASE, "set": {}, "select": _SEL},
    "link-not-grid.yaml": {**_SEL_BASE, "link": {"scenario.seed": "optim.lr"}},
    "link-in-set.yaml": {**_SEL_BASE, "link": {"scenario.val_fraction": "seed"}},
}

# (id, spec file, words in the message): each a usage error (exit 2) before anything runs
SELECT_CASES = [
    ("select-unknown-key", "sel-unknown.yaml", ["select", "'metrics'", "unknown key"]),
    ("select-not-a-mapping", "sel-not-mapping.yaml", ["select: expected a mapping"]),
    ("select-no-key", "sel-no-key.yaml", ["select.key", "dotted config key"]),
    ("select-key-in-grid", "sel-key-in-grid.yaml", ["select.key", "optim.lr", "grid"]),
    ("select-empty-values", "sel-empty-values.yaml", ["select.values", "non-empty list"]),
    ("select-extend-one-value", "sel-extend-one-value.yaml", ["select.values", "extend", "two positive numbers"]),
    ("select-extend-not-numbers", "sel-extend-not-numbers.yaml", ["select.values", "positive numbers"]),
    ("select-extend-negative", "sel-extend-negative.yaml", ["select.extend", ">= 0"]),
    ("select-metric", "sel-metric.yaml", ["select.metric", "test_acc", "acc"]),
    ("select-seeds-repeated", "sel-seeds.yaml", ["select.seeds", "distinct integers"]),
    ("select-per-not-a-grid-key", "sel-per-not-grid.yaml", ["select.per", "optim.name", "method.name"]),
    ("select-no-validation-split", "sel-no-val.yaml", ["scenario.val_fraction", "select"]),
    ("link-leader-not-in-grid", "link-not-grid.yaml", ["link.scenario.seed", "optim.lr", "grid key"]),
    ("link-follower-in-set", "link-in-set.yaml", ["link", "scenario.val_fraction", "neither grid nor set"]),
]


@pytest.mark.parametrize("dry_run", [False, True], ids=["out", "dry-run"])
@pytest.mark.parametrize("spec, words", [c[1:] for c in SELECT_CASES], ids=[c[0] for c in SELECT_CASES])
def test_sweep_select_spec_error_is_one_usage_line_and_leaves_nothing(ws, spec, words, dry_run):
    for name, data in SELECT_SPECS.items():
        (ws / name).write_text(yaml.safe_dump(data))
    before = _snapshot(ws)
    result = CliRunner().invoke(app, ["sweep", spec, *(["--dry-run"] if dry_run else ["--out", "s"])])
    _check(result, USAGE, words, before, ws)


# ---- clmerge eval and clmerge merge --tune ----------------------------------------------------------------
TUNE_OK = "space:\n  parameters.scaling: [0, 1]\neval: {data: held.txt}\n"
EVAL_TUNE_CASES = [
    ("eval-missing-data", ["eval", "empty_dir", "--data", "nope.txt"], INPUT, ["--data", "nope.txt"]),
    ("eval-not-a-model", ["eval", "empty_dir", "--data", "held.txt"], INPUT, ["empty_dir", "config.json"]),
    ("eval-bad-jsonl", ["eval", "empty_dir", "--data", "bad.jsonl"], INPUT, ["bad.jsonl", "line 1", '"text"']),
    ("eval-stride", ["eval", "empty_dir", "--data", "held.txt", "--max-length", "4", "--stride", "8"], USAGE,
     ["--stride", "--max-length"]),
    ("eval-json-under-file", ["eval", "empty_dir", "--data", "held.txt", "--json", "foreign.safetensors/r.json"],
     OUTPUT, ["--json"]),
    ("tune-missing-file", ["merge", "recipe.yaml", "--tune", "nope.yaml", "--out", "m"], INPUT, ["nope.yaml"]),
    ("tune-with-method", [*MERGE, "--tune", "tune.yaml", "--out", "m"], USAGE, ["--tune", "--method"]),
    ("tune-no-out", ["merge", "recipe.yaml", "--tune", "tune.yaml"], USAGE, ["--tune", "--out"]),
    ("tune-bad-range", ["merge", "recipe.yaml", "--tune", "range.yaml", "--out", "m"], USAGE,
     ["range.yaml", "parameters.scaling", "low < high"]),
    ("tune-bad-path", ["merge", "recipe.yaml", "--tune", "path.yaml", "--out", "m"], USAGE,
     ["models[5]"]),
    ("tune-bad-hparam", ["merge", "recipe.yaml", "--tune", "density.yaml", "--out", "m"], USAGE, ["density"]),
    ("tune-missing-heldout", ["merge", "recipe.yaml", "--tune", "noheld.yaml", "--out", "m"], INPUT,
     ["gone.txt"]),
    ("tune-out-foreign", ["merge", "recipe.yaml", "--tune", "tune.yaml", "--out", "full", "--overwrite"], OUTPUT,
     ["full", "no tune"]),
    ("tune-jobs", ["merge", "recipe.yaml", "--tune", "tune.yaml", "--jobs", "100000", "--out", "m"], USAGE,
     ["--jobs"]),
]


@pytest.mark.parametrize("argv, code, words", [c[1:] for c in EVAL_TUNE_CASES], ids=[c[0] for c in EVAL_TUNE_CASES])
def test_eval_and_tune_errors_are_one_line_and_leave_nothing(ws, argv, code, words):
    (ws / "held.txt").write_text("w1 w2 w3\n\nw4 w5\n")
    (ws / "bad.jsonl").write_text('{"txt": "w1"}\n')
    (ws / "recipe.yaml").write_text(yaml.safe_dump({"method": "task_arithmetic", "base": "base.safetensors",
                                                    "models": ["e1.safetensors"]}))
    for name, text in {"tune.yaml": TUNE_OK, "range.yaml": TUNE_OK.replace("[0, 1]", "[1, 0]"),
                       "path.yaml": TUNE_OK.replace("parameters.scaling", "models[5].parameters.weight"),
                       "density.yaml": TUNE_OK.replace("scaling: [0, 1]", "density: [0, 1]"),
                       "noheld.yaml": TUNE_OK.replace("held.txt", "gone.txt")}.items():
        (ws / name).write_text(text)
    before = _snapshot(ws)
    result = CliRunner().invoke(app, argv)
    _check(result, code, words, before, ws)


# -- --device: a CUDA device that is not visible, or a device name that is not one (CUDA hidden here, so these
# cases hold on a GPU machine too)
EXTRACT = ["extract-lora", "--base", "base.safetensors", "--tuned", "e1.safetensors", "--rank", "2"]
DEVICE_CASES = [
    ("merge --device cuda without CUDA", [*MERGE, "--out", "m", "--device", "cuda"], USAGE,
     ["--device cuda", "no CUDA device is visible"]),
    ("merge --device cuda:1 without CUDA", [*MERGE, "--out", "m", "--device", "cuda:1"], USAGE,
     ["--device cuda:1", "no CUDA device is visible"]),
    ("merge --device tpu", [*MERGE, "--out", "m", "--device", "tpu"], USAGE, ["--device 'tpu'", "cpu, cuda"]),
    ("merge --adapter-out peft --device cuda", [*MERGE, "--out", "m", "--adapter-out", "peft", "--device", "cuda"],
     USAGE, ["--device cuda", "no CUDA device is visible"]),
    ("extract-lora --device cuda without CUDA", [*EXTRACT, "--out", "x", "--device", "cuda"], USAGE,
     ["--device cuda", "no CUDA device is visible"]),
]


@pytest.mark.parametrize("argv, code, words", [c[1:] for c in DEVICE_CASES], ids=[c[0] for c in DEVICE_CASES])
def test_a_device_error_is_short_typed_and_leaves_nothing(ws, argv, code, words, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
# ---------------------------------------------------------------------------------------------------------
# Pretrained weights that cannot be loaded (the PILOT-protocol configs load ViT-B/16 IN21K from a hub id or a
# folder): offline and uncached, or a folder without the model, is one input error naming model.source.
PRETRAINED_SOURCE_CASES = [
    ("run: shipped PILOT config offline", ["run", "simplecil_cifar100_10", "--out", "r"],
     INPUT, ["model.source=google/vit-base-patch16-224-in21k", "HF_HUB_OFFLINE=1", "fix:"]),
    ("run: model.source is a folder without the model",
     ["run", "simplecil_imagenet_r_10", "--set", "model.source=empty_dir", "--out", "r"],
     INPUT, ["model.source=empty_dir", "config.json"]),
]


@pytest.mark.parametrize("argv, code, words", [c[1:] for c in PRETRAINED_SOURCE_CASES],
                         ids=[c[0] for c in PRETRAINED_SOURCE_CASES])
def test_unloadable_pretrained_weights_are_one_input_error(ws, monkeypatch, argv, code, words):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
# continual merging: opcm / dop hyperparameters and merge-bench --continual's method names (their own block)
CONTINUAL_MERGE_CASES = [
    ("opcm-alpha-one", ["merge", "--method", "opcm", "--base", "base.safetensors", "--expert", "e1.safetensors",
                        "--expert", "e2.safetensors", "--set", "alpha=1.0", "--out", "m"], USAGE, ["alpha", "[0, 1)"]),
    ("dop-space-unknown", ["merge", "--method", "dop", "--base", "base.safetensors", "--expert", "e1.safetensors",
                           "--expert", "e2.safetensors", "--set", "space=w", "--out", "m"], USAGE, ["space", "'uv'"]),
    ("bench-continual-method", ["merge-bench", "--continual", "--method", "ties", "--out", "b"], USAGE,
     ["--method 'ties'", "continual", "opcm"]),
]


@pytest.mark.parametrize("argv, code, words", [c[1:] for c in CONTINUAL_MERGE_CASES],
                         ids=[c[0] for c in CONTINUAL_MERGE_CASES])
def test_continual_merge_errors_are_short_typed_and_leave_nothing(ws, argv, code, words):
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, argv), code, words, before, ws)


# -- sweep --nproc (a torchrun job per cell) and report --by: bounds, combinations, per-cell batch sizes, and
# `report DIR --by ","` refused as `results` refuses it
def _nproc_cases() -> list:
    from clmerge.utils.threads import max_threads

    return [
        ("sweep-nproc-huge", ["sweep", "sweep.yaml", "--nproc", "100000", "--out", "s"], USAGE, ["--nproc", "100000"]),
        ("sweep-jobs-times-nproc", ["sweep", "sweep.yaml", "--jobs", str(max_threads()), "--nproc", "2", "--out", "s"],
         USAGE, [f"--jobs {max_threads()} x --nproc 2", str(2 * max_threads())]),
        ("sweep-nproc-ray", ["sweep", "sweep.yaml", "--nproc", "2", "--backend", "ray", "--out", "s"], USAGE,
         ["--nproc", "--backend ray"]),
        ("sweep-plugin-with-nproc", ["sweep", "sweep.yaml", "--plugin", "x", "--nproc", "2", "--out", "s"], USAGE,
         ["--plugin", "--nproc"]),
        ("sweep-nproc-batch", ["sweep", "batch1.yaml", "--nproc", "2", "--out", "s"], USAGE,
         ["cell seed0", "train.batch_size=1", "--nproc 2"]),
        ("sweep-nproc-batch-dry-run", ["sweep", "batch1.yaml", "--nproc", "2", "--dry-run"], USAGE,
         ["cell seed0", "train.batch_size=1"]),
        ("run-seeds-nproc-batch-dry-run", [*RUN, "--seeds", "0", "--nproc", "2", "--set", "train.batch_size=1",
                                           "--dry-run"], USAGE, ["train.batch_size=1"]),
        ("run-seeds-nproc-batch", [*RUN, "--seeds", "0,1", "--nproc", "2", "--set", "train.batch_size=1", "--out",
                                   "r"], USAGE, ["train.batch_size=1", "--nproc 2"]),
    ]


@pytest.mark.parametrize("case", _nproc_cases(), ids=lambda c: c[0])
def test_sweep_nproc_errors_are_short_typed_and_leave_nothing(ws, case):
    _, argv, code, words = case
    (ws / "sweep.yaml").write_text(yaml.safe_dump(SWEEP_SPECS["sweep.yaml"]))
    (ws / "batch1.yaml").write_text(yaml.safe_dump({**SWEEP_SPECS["sweep.yaml"], "set": {"train.batch_size": 1}}))
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, argv), code, words, before, ws)


@pytest.mark.parametrize("by", [",", " , ", ""])
def test_report_on_a_sweep_refuses_an_empty_by_as_results_does(ws, by):
    _results_runs(ws)
    before = _snapshot(ws)
    report, results = (CliRunner().invoke(app, [cmd, "sw", "--by", by]) for cmd in ("report", "results"))
    _check(report, USAGE, ["--by", "at least one config key"], before, ws)
    assert report.stderr == results.stderr


# merge-bench --suite clip-*: a tiny random CLIP and one dataset's look-alike test split in the workspace
CLIP_BENCH = ["merge-bench", "--suite", "clip-ta8", "--datasets", "mnist", "--out", "cb"]
CLIP_BENCH_CASES = [
    ("clip-no-clip", [*CLIP_BENCH], USAGE, ["--clip"]),
    ("clip-no-data", [*CLIP_BENCH, "--clip", "clip", "--data-root", "nodata"], INPUT,
     [str(Path("nodata") / "mnist" / "test"), "<label"]),
    ("clip-missing-model", [*CLIP_BENCH, "--clip", "noclip", "--data-root", "data"], INPUT, ["noclip"]),
    ("clip-missing-expert-hub", [*CLIP_BENCH, "--clip", "clip", "--data-root", "data"], INPUT,
     ["tanganke/clip-vit-base-patch32_mnist"]),
    ("clip-missing-expert-folder", [*CLIP_BENCH, "--clip", "clip", "--data-root", "data", "--experts",
                                    "ckpts/{dataset}"], INPUT, ["ckpts/mnist"]),
    ("clip-expert-other-architecture", [*CLIP_BENCH, "--clip", "clip", "--data-root", "data", "--experts",
                                        "wide/{dataset}"], INPUT, ["wide/mnist", "same architecture"]),
    ("clip-bad-class-folder", [*CLIP_BENCH, "--clip", "clip", "--data-root", "baddata"], INPUT, ["cats", "mnist"]),
    ("clip-dataset-not-in-suite", ["merge-bench", "--suite", "clip-ta8", "--datasets", "cifar10",
                                   "--clip", "clip", "--out", "cb"], USAGE,
     ["cifar10", "clip-ta8"]),
    ("clip-bad-hp", [*CLIP_BENCH, "--clip", "clip", "--data-root", "data", "--hp", "scaling=1"], USAGE,
     ["METHOD.KEY=VALUE"]),
    ("clip-unknown-method", [*CLIP_BENCH, "--clip", "clip", "--data-root", "data", "--method", "tsvm"], USAGE,
     ["tsvm", "tsv_m"]),
    ("clip-hp-value", [*CLIP_BENCH, "--clip", "clip", "--data-root", "data", "--hp", "ties.scaling=abc"], USAGE,
     ["ties.scaling", "abc"]),
    ("clip-hp-key", [*CLIP_BENCH, "--clip", "clip", "--data-root", "data", "--hp", "ties.densty=0.2"], USAGE,
     ["densty", "density"]),
    ("clip-pattern", [*CLIP_BENCH, "--clip", "clip", "--data-root", "data", "--experts", "ckpts"], USAGE,
     ["{dataset}"]),
]


@pytest.fixture()
def ws_clip(ws, monkeypatch):
    from clip_helpers import tiny_clip
    from clmerge.data.clip_tasks import write_clip_lookalike

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tiny_clip(ws / "clip", ["mnist"])
    write_clip_lookalike(ws / "data", ["mnist"], per_class=1)
    write_clip_lookalike(ws / "baddata", ["mnist"], per_class=1, max_classes=2)
    (ws / "baddata" / "mnist" / "test" / "cats").mkdir()
    tiny_clip(ws / "wideclip", ["mnist"], patch_size=4)  # same parameter names, other shapes
    from transformers import CLIPVisionModel

    CLIPVisionModel.from_pretrained(ws / "wideclip").save_pretrained(ws / "wide" / "mnist")
    return ws


@pytest.mark.parametrize("argv, code, words", [c[1:] for c in CLIP_BENCH_CASES], ids=[c[0] for c in CLIP_BENCH_CASES])
def test_clip_bench_error_is_short_typed_and_leaves_nothing(ws_clip, argv, code, words):
    before = _snapshot(ws_clip)
    result = CliRunner().invoke(app, argv)
    _check(result, code, words, before, ws_clip)


# merge-bench options that the chosen suite would silently ignore
IGNORED_SUITE_OPTION_CASES = [
    ("clip-continual", [*CLIP_BENCH, "--clip", "clip", "--continual"], USAGE, ["--continual", "clip-ta8"]),
    ("clip-seeds", [*CLIP_BENCH, "--clip", "clip", "--seeds", "0,1,2"], USAGE, ["--seeds", "clip-ta8"]),
    ("suite8-clip", ["merge-bench", "--suite", "8", "--clip", "clip", "--out", "cb"], USAGE, ["--clip", "--suite 8"]),
    ("suite8-hp", ["merge-bench", "--suite", "8", "--hp", "ties.density=0.2", "--out", "cb"], USAGE, ["--hp"]),
    ("suite8-device", ["merge-bench", "--suite", "8", "--device", "cuda", "--out", "cb"], USAGE, ["--device"]),
]


@pytest.mark.parametrize("name,args,code,needles", IGNORED_SUITE_OPTION_CASES, ids=[c[0] for c in IGNORED_SUITE_OPTION_CASES])
def test_merge_bench_refuses_an_option_its_suite_would_ignore(ws, name, args, code, needles):
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, args), code, needles, before, ws)


# a study spec's thread count is bounded like run.threads (a huge count crashes OpenMP inside every job)
STUDY_THREADS_CASES = [
    ("study-threads-huge", ["study", str(STUDY_SPEC), "--set", "threads=100000", "--out", "s"], USAGE,
     ["threads", "at most", "100000"]),
]


@pytest.mark.parametrize("name,args,code,needles", STUDY_THREADS_CASES, ids=[c[0] for c in STUDY_THREADS_CASES])
def test_study_refuses_a_thread_count_beyond_the_machine(ws, name, args, code, needles):
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, args), code, needles, before, ws)


# -- mergekit configs read as they are: a key or value clmerge does not support is refused by name (exit 2) --
_MK = {"base_model": "base.safetensors", "models": [{"model": m, "parameters": {"weight": 1.0}}
                                                    for m in ("e1.safetensors", "e2.safetensors")]}
MERGEKIT_CASES = [
    ("mergekit-method-without-equivalent", {**_MK, "merge_method": "ram"}, ["mk.yml", "merge_method: ram"]),
    ("mergekit-modules", {**_MK, "merge_method": "ties", "modules": {}}, ["mk.yml", "modules"]),
    ("mergekit-per-model-density", {**_MK, "merge_method": "della", "models": [
        {"model": "e1.safetensors", "parameters": {"weight": 1, "density": 0.3}},
        {"model": "e2.safetensors", "parameters": {"weight": 1, "density": 0.5}}]},
     ["mk.yml", "models[1].parameters.density", "same value"]),
    ("mergekit-literal-chat-template", {**_MK, "merge_method": "ties", "chat_template": "chatml"},
     ["mk.yml", "chat_template"]),
]


@pytest.mark.parametrize("config, words", [c[1:] for c in MERGEKIT_CASES], ids=[c[0] for c in MERGEKIT_CASES])
def test_mergekit_config_refusal_is_one_line_and_leaves_nothing(ws, config, words):
    (ws / "mk.yml").write_text(yaml.safe_dump(config))
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, ["merge", "mk.yml", "--out", "m"]), USAGE, words, before, ws)
