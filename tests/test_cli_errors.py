"""Every user error of every subcommand: at most 3 lines on stderr, no traceback, the exit code of its kind
(docs/cli_errors.md), and the file system left exactly as it was (issue 13).

One table: (subcommand, what is wrong, argv, exit code, words the message must hold). Each case runs the CLI
in process on tiny tensors written here; nothing trains except the one divergence case (2 tiny steps).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.cli_support import as_user_error
from clmerge.errors import InputError, OutputError, TrainingError, UsageError
from clmerge.utils import outpaths

from conftest import tiny_config

REPO = Path(__file__).resolve().parents[1]
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
    from clmerge import cli_support

    monkeypatch.delenv("COLUMNS", raising=False)
    assert cli_support.make_console().width == cli_support.FALLBACK_WIDTH == 120
    long_message = "--out " + "/very/long/path" * 20 + ": cannot write here"
    cli_support.print_error(long_message)
    assert capsys.readouterr().err == f"error: {long_message}\n"
    cli_support.print_error("\n".join(f"line {i}" for i in range(6)))
    assert capsys.readouterr().err.count("\n") == 3


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
