"""The input boundary: ``eval``, ``moe`` and the tokenizer-merging paths refuse the hostile input folders ``merge`` refuses
(a shard index naming ``../x.safetensors``, config or tokenizer files that are symlinks out of the folder, FIFOs,
symlink loops) with one line naming the file, and exit 3; the tokenizer edge cases of ``embeddings: union``
(an empty vocabulary, tokenizers of different model types) are refused or warned about.

Each case runs the CLI in process (typer's ``CliRunner``) on tiny Llamas built here, and checks the exit code,
that the message names the offending path, and that nothing was written.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from clmerge.cli import app
from vocab_helpers import CORE, tiny_lm

INPUT, OUTPUT = 3, 5


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """Three tiny Llamas with one WordLevel tokenizer each (a base and two fine-tunes) and a held-out text."""
    root = tmp_path_factory.mktemp("pristine")
    for name, seed in (("M", 0), ("A", 1), ("B", 2)):
        tiny_lm(root / name, seed=seed)
    (root / "heldout.txt").write_text("w1 w2 w3 w4 w5\n\nw6 w7 w8 w9\n")
    return root


@pytest.fixture()
def ws(pristine, tmp_path, monkeypatch):
    for p in pristine.iterdir():
        (shutil.copytree if p.is_dir() else shutil.copyfile)(p, tmp_path / p.name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


def _snapshot(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): (os.lstat(p).st_size if p.is_file() or p.is_symlink() else -1)
            for p in root.rglob("*")}


def _check(result, code: int, words: list[str], before: dict, root: Path) -> None:
    msg = result.output
    assert result.exit_code == code, msg
    assert "Traceback" not in msg and msg.count("\n") <= 3, msg
    for w in words:
        assert w in msg, (w, msg)
    assert _snapshot(root) == before, "the failed command changed the file system"


# --- hostile model folders -------------------------------------------------------------------------------------

def _sharded(folder: Path, escape: str | None = None) -> None:
    """Turn ``folder``'s ``model.safetensors`` into one shard and an index; ``escape``: one key's entry."""
    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    wm = {k: "model-00001-of-00001.safetensors" for k in state}
    if escape:
        save_file(state, str(folder.parent / Path(escape).name))
        wm[next(iter(wm))] = escape
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))


def index_escape(ws):
    _sharded(ws / "M", "../x.safetensors")


def _link_out(ws, name: str) -> None:
    (ws / "M" / name).rename(ws / f"outside_{name}")
    (ws / "M" / name).symlink_to(ws / f"outside_{name}")


def tokenizer_link_out(ws):
    _link_out(ws, "tokenizer.json")


def config_link_out(ws):
    _link_out(ws, "config.json")


def _fifo(ws, name: str) -> None:
    (ws / "M" / name).unlink()
    os.mkfifo(ws / "M" / name)


def config_fifo(ws):
    _fifo(ws, "config.json")


def tokenizer_fifo(ws):
    _fifo(ws, "tokenizer.json")


def tokenizer_loop(ws):
    (ws / "M" / "tokenizer.json").unlink()
    (ws / "M" / "tokenizer.json").symlink_to("loop.json")
    (ws / "M" / "loop.json").symlink_to("tokenizer.json")


def generation_config_fifo(ws):
    _fifo(ws, "generation_config.json")


EVAL = ["eval", "M", "--data", "heldout.txt", "--max-length", "8"]
# (id, setup, exit code, words in the message): clmerge eval refuses what merge refuses
EVAL_CASES = [
    ("index-entry-escapes", index_escape, INPUT, ["../x.safetensors", "outside"]),
    ("tokenizer-symlink-out", tokenizer_link_out, INPUT, ["tokenizer.json", "outside"]),
    ("config-symlink-out", config_link_out, INPUT, ["config.json", "outside"]),
    ("config-fifo", config_fifo, INPUT, ["config.json", "FIFO"]),
    ("tokenizer-fifo", tokenizer_fifo, INPUT, ["tokenizer.json", "FIFO"]),
    ("tokenizer-symlink-loop", tokenizer_loop, INPUT, ["tokenizer.json", "symlink loop"]),
]


@pytest.mark.parametrize("setup, code, words", [c[1:] for c in EVAL_CASES], ids=[c[0] for c in EVAL_CASES])
def test_eval_refuses_what_merge_refuses(ws, setup, code, words):
    setup(ws)
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, EVAL), code, words, before, ws)


def test_eval_of_a_sharded_folder_still_works(ws):
    _sharded(ws / "M")
    res = CliRunner().invoke(app, [*EVAL, "--no-progress"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["tokens"] > 0


MERGE = ["merge", "--method", "task_arithmetic", "--base", "M", "--expert", "A", "--expert", "B", "--out", "out"]
# (id, setup, exit code, words): special files and loops in an input model folder are refused by name
MERGE_CASES = [
    ("config-fifo", config_fifo, INPUT, ["config.json", "FIFO"]),
    ("tokenizer-fifo", tokenizer_fifo, INPUT, ["tokenizer.json", "FIFO"]),
    ("generation-config-fifo", generation_config_fifo, INPUT, ["generation_config.json", "FIFO"]),
    ("tokenizer-symlink-loop", tokenizer_loop, INPUT, ["tokenizer.json", "symlink loop"]),
]


@pytest.mark.parametrize("setup, code, words", [c[1:] for c in MERGE_CASES], ids=[c[0] for c in MERGE_CASES])
def test_merge_refuses_special_files_in_an_input_folder(ws, setup, code, words):
    setup(ws)
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, MERGE), code, words, before, ws)


# --- tokenizers under embeddings: union --------------------------------------------------------------------------

def _union(ws, **extra) -> list[str]:
    recipe = {"method": "task_arithmetic", "base": "M", "models": [{"model": "A"}, {"model": "B"}],
              "parameters": {"scaling": 0.5}, "embeddings": "union", **extra}
    (ws / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return ["merge", "recipe.yaml", "--out", "out"]


def _edit_tokenizer(folder: Path, model: dict) -> None:
    data = json.loads((folder / "tokenizer.json").read_text())
    data["model"] = model
    data["added_tokens"] = []
    (folder / "tokenizer.json").write_text(json.dumps(data))


def empty_vocab(ws):
    _edit_tokenizer(ws / "B", {"type": "WordLevel", "vocab": {}, "unk_token": "<unk>"})
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (ws / "B" / name).write_text("{}")


def union_symlink_loop(ws):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (ws / "A" / name).unlink(missing_ok=True)
    (ws / "A" / "tokenizer.json").symlink_to("loop.json")
    (ws / "A" / "loop.json").symlink_to("tokenizer.json")


def union_fifo(ws):
    (ws / "A" / "tokenizer.json").unlink()
    os.mkfifo(ws / "A" / "tokenizer.json")


UNION_CASES = [
    ("empty-vocabulary", empty_vocab, INPUT, ["B", "tokenizer.json", "empty vocabulary"]),
    ("tokenizer-symlink-loop", union_symlink_loop, INPUT, ["A", "tokenizer.json", "symlink loop"]),
    ("tokenizer-fifo", union_fifo, INPUT, ["A", "tokenizer.json", "FIFO"]),
]


@pytest.mark.parametrize("setup, code, words", [c[1:] for c in UNION_CASES], ids=[c[0] for c in UNION_CASES])
def test_union_refuses_unusable_tokenizers(ws, setup, code, words):
    setup(ws)
    argv = _union(ws)
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, argv), code, words, before, ws)


def test_union_of_different_tokenizer_models_warns_naming_both(ws):
    vocab = {w: i for i, w in enumerate(CORE)}
    _edit_tokenizer(ws / "B", {"type": "WordPiece", "unk_token": "<unk>", "continuing_subword_prefix": "##",
                               "max_input_chars_per_word": 100, "vocab": vocab})
    res = CliRunner().invoke(app, _union(ws))
    assert res.exit_code == 0, res.output
    line = next((ln for ln in res.stderr.splitlines() if "WordPiece" in ln), "")
    assert "WordLevel" in line and "'M'" in line and "'B'" in line, res.stderr
    assert (ws / "out" / "model.safetensors").is_file()


def test_union_of_one_tokenizer_model_does_not_warn(ws):
    res = CliRunner().invoke(app, _union(ws))
    assert res.exit_code == 0, res.output
    assert "WordLevel" not in res.stderr, res.stderr


# --- moe: the base's tokenizer is checked before it is read ------------------------------------------------------

def _moe_recipe(ws, gate_mode: str) -> list[str]:
    recipe = {"base_model": "M", "gate_mode": gate_mode, "experts_per_token": 1,
              "experts": [{"source_model": "A", "positive_prompts": ["w1 w2"]},
                          {"source_model": "B", "positive_prompts": ["w3 w4"]}]}
    (ws / "moe.yaml").write_text(yaml.safe_dump(recipe))
    return ["moe", "moe.yaml", "--out", "out"]


@pytest.mark.parametrize("gate_mode", ["cheap_embed", "hidden", "random"])
def test_moe_checks_the_base_tokenizer_before_reading_it(ws, gate_mode, monkeypatch):
    import transformers

    tokenizer_link_out(ws)
    argv = _moe_recipe(ws, gate_mode)
    loaded = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: loaded.append(a) or real(*a, **k))
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, argv), INPUT, ["tokenizer.json", "outside"], before, ws)
    assert not loaded, "the tokenizer was read before its check"


def test_moe_refuses_a_fifo_config(ws):
    config_fifo(ws)
    argv = _moe_recipe(ws, "random")
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, argv), INPUT, ["config.json", "FIFO"], before, ws)


def test_moe_cheap_embed_still_works(ws):
    res = CliRunner().invoke(app, _moe_recipe(ws, "cheap_embed"))
    assert res.exit_code == 0, res.output
    assert (ws / "out" / "tokenizer.json").read_bytes() == (ws / "M" / "tokenizer.json").read_bytes()


# --- output guards: one rule (utils.outpaths) ---------------------------------------------------------------------

def test_tune_out_inside_an_input_folder_is_refused_before_any_trial(ws):
    (ws / "tune.yaml").write_text(yaml.safe_dump({"points": 2, "space": {"parameters.scaling": [0.0, 0.6]},
                                                  "eval": {"data": "heldout.txt", "max_length": 8}}))
    (ws / "recipe.yaml").write_text(yaml.safe_dump({"method": "task_arithmetic", "base": "M",
                                                    "models": [{"model": "A"}], "parameters": {"scaling": 1.0}}))
    before = _snapshot(ws)
    res = CliRunner().invoke(app, ["merge", "recipe.yaml", "--tune", "tune.yaml", "--out", "M/tuned"])
    _check(res, OUTPUT, ["--out M/tuned", "input"], before, ws)


@pytest.mark.parametrize("module", ["clmerge.merging.io.output", "clmerge.merging.io.lora_svd",
                                    "clmerge.merging.tune"])
def test_out_guards_are_the_one_output_guard(module):
    import importlib

    from clmerge.utils import outpaths

    assert importlib.import_module(module).check_output_dir is outpaths.check_output_dir


# (id, argv, exit code, words): merge, extract-lora and tune --out refusals, worded by utils.outpaths
OUT_CASES = [
    ("merge-out-not-empty", MERGE, OUTPUT, ["--out out", "not empty", "--overwrite"]),
    ("merge-out-inside-input", [*MERGE[:-1], "M/sub"], OUTPUT, ["--out M/sub", "inside the input"]),
    ("merge-out-other-format", [*MERGE[:-1], "m.bin"], OUTPUT, ["--out m.bin", "unsupported file suffix"]),
    ("extract-out-is-input", ["extract-lora", "--base", "M", "--tuned", "A", "--rank", "2", "--out", "A"], OUTPUT,
     ["--out A", "the input"]),
]


@pytest.mark.parametrize("argv, code, words", [c[1:] for c in OUT_CASES], ids=[c[0] for c in OUT_CASES])
def test_out_refusals(ws, argv, code, words):
    (ws / "out").mkdir()
    (ws / "out" / "keep").write_text("x")
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, argv), code, words, before, ws)


def weights_fifo(ws):
    _fifo(ws, "model.safetensors")


def shard_fifo(ws):
    _sharded(ws / "M")
    _fifo(ws, "model-00001-of-00001.safetensors")


# (id, setup, words): a weights file or a shard that is a FIFO is refused by name by merge and eval alike
WEIGHTS_CASES = [
    ("weights-fifo", weights_fifo, ["model.safetensors", "FIFO"]),
    ("shard-fifo", shard_fifo, ["model-00001-of-00001.safetensors", "FIFO"]),
]


@pytest.mark.timeout(120, method="thread")  # before the boundary, eval blocked forever on a FIFO shard
@pytest.mark.parametrize("argv", [MERGE, EVAL], ids=["merge", "eval"])
@pytest.mark.parametrize("setup, words", [c[1:] for c in WEIGHTS_CASES], ids=[c[0] for c in WEIGHTS_CASES])
def test_weights_that_are_fifos_are_refused_by_name(ws, setup, words, argv):
    setup(ws)
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, argv), INPUT, words, before, ws)


def test_eval_refuses_an_index_entry_that_leaves_and_reenters_the_folder(ws):
    """``../M/shard`` resolves inside M, but a private staging folder cannot hold a link there: refused, and
    nothing is written beside the staging folder."""
    _sharded(ws / "M")
    index = ws / "M" / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"] = {k: "../M/model-00001-of-00001.safetensors" for k in data["weight_map"]}
    index.write_text(json.dumps(data))
    before = _snapshot(ws)
    _check(CliRunner().invoke(app, EVAL), INPUT, ["weight_map entry", "../M/model-00001-of-00001.safetensors"],
           before, ws)
