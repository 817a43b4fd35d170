"""Hostile input folders and output races of ``clmerge merge``/``extract-lora``/``export``.

Inputs: a path taken from a file (a shard index entry, a tokenizer or config file, an adapter's files, a run
directory's files) must resolve inside its folder; anything else is refused (exit 3), naming the entry, before
the outside file is opened. Outputs: a dotted folder name is a folder; a second writer's result is never
deleted; SIGTERM and a killed process leave no temporary folder for good; a full disk names the path.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from clmerge.merging.io import readers
from clmerge.merging.io.output import OutputTarget
from clmerge.merging.io.peft import adapter_config
from clmerge.cli import app
from clmerge.errors import OutputError

import clmerge

SRC = Path(clmerge.__file__).resolve().parents[1]  # the clmerge under test, for the subprocess


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(4, 4, generator=g), "b.weight": torch.randn(4, 4, generator=g)}


def _sharded(folder: Path, seed: int) -> Path:
    """A model folder: two shards, their index, a config and a tokenizer file."""
    folder.mkdir(parents=True)
    t = _tensors(seed)
    save_file({"a.weight": t["a.weight"]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({"b.weight": t["b.weight"]}, str(folder / "model-00002-of-00002.safetensors"))
    _index(folder, {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"})
    (folder / "config.json").write_text('{"model_type": "x"}')
    (folder / "tokenizer.json").write_text('{"tok": 1}')
    return folder


def _index(folder: Path, weight_map, name: str = "model.safetensors.index.json") -> None:
    (folder / name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture()
def ws(tmp_path, monkeypatch):
    """base, e1, e2 model folders; a valid safetensors file and a secret outside them; cwd is here."""
    for i, name in enumerate(("base", "e1", "e2")):
        _sharded(tmp_path / name, i)
    (tmp_path / "elsewhere").mkdir()
    save_file({"b.weight": torch.ones(4, 4)}, str(tmp_path / "elsewhere" / "x.safetensors"))
    (tmp_path / "secret.txt").write_text("root:x:0:0:secret\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _merge(*extra: str, out: str = "m"):
    argv = ["merge", "--method", "task_arithmetic", "--base", "base", "--expert", "e1", "--expert", "e2",
            "--out", out, *extra]
    return CliRunner().invoke(app, argv)


def _refused(result, *words: str, code: int = 3) -> None:
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.exit_code == code, (result.exit_code, result.output)
    assert "Traceback" not in result.output and 1 <= len(lines) <= 3, result.output
    for w in words:
        assert w in result.stderr, (w, result.stderr)


def _hidden(ws: Path) -> list[str]:
    return sorted(p.name for p in ws.iterdir() if p.name.startswith("."))


@pytest.fixture()
def opened(monkeypatch):
    """The weight files the readers open (ParamSource and torch.load of .bin shards)."""
    seen: list[Path] = []
    real_source, real_load = readers.ParamSource, readers.torch_load_state_dict

    def source(path, *a, **k):
        seen.append(Path(path).resolve())
        return real_source(path, *a, **k)

    def load(path, *a, **k):
        seen.append(Path(path).resolve())
        return real_load(path, *a, **k)

    monkeypatch.setattr(readers, "ParamSource", source)
    monkeypatch.setattr(readers, "torch_load_state_dict", load)
    return seen


# -- shard index entries: relative escape, absolute path, symlinks --------------------------------------------

@pytest.mark.parametrize("entry", ["../elsewhere/x.safetensors", "ABS"])
def test_index_entry_outside_the_folder_is_refused_before_opening(ws, opened, entry):
    entry = str(ws / "elsewhere" / "x.safetensors") if entry == "ABS" else entry
    _index(ws / "e1", {"a.weight": "model-00001-of-00002.safetensors", "b.weight": entry})
    r = _merge()
    _refused(r, "e1", "weight_map entry", entry, "points outside")
    assert (ws / "elsewhere" / "x.safetensors").resolve() not in opened
    assert not (ws / "m").exists() and _hidden(ws) == []


@pytest.mark.parametrize("target", ["valid", "passwd"])
def test_shard_symlinked_out_of_the_folder_is_refused_before_opening(ws, opened, target):
    outside = ws / "elsewhere" / "x.safetensors" if target == "valid" else ws / "secret.txt"
    shard = ws / "e1" / "model-00002-of-00002.safetensors"
    shard.unlink()
    shard.symlink_to(outside)
    r = _merge()
    _refused(r, "model-00002-of-00002.safetensors", "points outside", str(outside))
    assert outside.resolve() not in opened and not (ws / "m").exists()


def test_single_weights_file_symlinked_out_is_refused(ws, opened):
    (ws / "single").mkdir()
    (ws / "single" / "model.safetensors").symlink_to(ws / "elsewhere" / "x.safetensors")
    r = CliRunner().invoke(app, ["merge", "--method", "task_arithmetic", "--base", "base", "--expert", "e1",
                                 "--expert", "single", "--out", "m"])
    _refused(r, "model.safetensors", "points outside")
    assert (ws / "elsewhere" / "x.safetensors").resolve() not in opened


def test_bin_index_with_absolute_entry_is_refused_before_torch_load(ws, opened):
    torch.save({"b.weight": torch.ones(4, 4)}, ws / "elsewhere" / "x.bin")
    (ws / "e1" / "model.safetensors.index.json").unlink()
    torch.save({"a.weight": torch.ones(4, 4)}, ws / "e1" / "pytorch_model-1.bin")
    _index(ws / "e1", {"a.weight": "pytorch_model-1.bin", "b.weight": str(ws / "elsewhere" / "x.bin")},
           "pytorch_model.bin.index.json")
    r = _merge()
    _refused(r, "weight_map entry", "x.bin", "points outside")
    assert (ws / "elsewhere" / "x.bin").resolve() not in opened


def test_symlinks_inside_the_folder_are_followed(ws):
    shard = ws / "e1" / "model-00002-of-00002.safetensors"
    (ws / "e1" / "blobs").mkdir()
    shard.rename(ws / "e1" / "blobs" / "b")
    shard.symlink_to("blobs/b")
    r = _merge()
    assert r.exit_code == 0, r.output


def test_hub_cache_snapshot_links_into_its_blobs_are_followed(ws):
    """A hub snapshot's files are links into ``../../blobs``: the repository's cache folder is the boundary."""
    repo = ws / "hub" / "models--org--e1"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in (ws / "e1").iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        f.rename(blob)
        (snap / f.name).symlink_to(Path("../../blobs") / blob.name)
    r = CliRunner().invoke(app, ["merge", "--method", "task_arithmetic", "--base", "base", "--expert", str(snap),
                                 "--expert", "e2", "--out", "m"])
    assert r.exit_code == 0, r.output


def test_weight_map_that_is_a_list_is_a_one_line_input_error(ws):
    (ws / "e1" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a", "b"]}))
    _refused(_merge(), "e1", "model.safetensors.index.json", "weight_map")


# -- files copied into the output: tokenizer, config ----------------------------------------------------------

@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "generation_config.json"])
def test_copied_file_symlinked_out_is_refused_and_not_copied(ws, name, monkeypatch):
    (ws / "base" / name).unlink(missing_ok=True)
    (ws / "base" / name).symlink_to(ws / "secret.txt")
    merged = []
    from clmerge.merging import pipeline

    real = pipeline._merge_into
    monkeypatch.setattr(pipeline, "_merge_into", lambda *a: merged.append(1) or real(*a))
    r = _merge()
    _refused(r, name, "points outside", "secret.txt")
    assert merged == [], "refused only after the merge ran"
    assert not (ws / "m").exists() and _hidden(ws) == []


@pytest.mark.parametrize("entry", ["relative", "absolute"])
def test_tokenizer_from_folder_symlink_out_is_refused(ws, entry):
    (ws / "tok").mkdir()
    target = ws / "secret.txt" if entry == "absolute" else Path("../secret.txt")
    (ws / "tok" / "tokenizer.json").symlink_to(target)
    r = _merge("--tokenizer-from", "tok")
    _refused(r, "tokenizer.json", "points outside")
    assert not (ws / "m").exists()


# -- adapter folders ------------------------------------------------------------------------------------------

def _adapter(folder: Path) -> Path:
    folder.mkdir()
    g = torch.Generator().manual_seed(3)
    save_file({"base_model.model.a.lora_A.weight": torch.randn(2, 4, generator=g),
               "base_model.model.a.lora_B.weight": torch.randn(4, 2, generator=g)},
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config(r=2, alpha=2, targets=["a"])))
    return folder


def _adapter_merge():
    return CliRunner().invoke(app, ["merge", "--method", "task_arithmetic", "--base", "base", "--expert", "ad",
                                    "--expert", "e2", "--out", "m"])


def test_adapter_folder_merges(ws):
    _adapter(ws / "ad")
    r = _adapter_merge()
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("name", ["adapter_model.safetensors", "adapter_config.json"])
@pytest.mark.parametrize("how", ["absolute", "relative"])
def test_adapter_file_symlinked_out_is_refused(ws, name, how):
    ad = _adapter(ws / "ad")
    (ad / name).rename(ws / "elsewhere" / name)
    (ad / name).symlink_to(ws / "elsewhere" / name if how == "absolute" else Path("../elsewhere") / name)
    _refused(_adapter_merge(), name, "points outside")


def test_adapter_config_that_is_a_list_is_a_one_line_input_error(ws):
    ad = _adapter(ws / "ad")
    (ad / "adapter_config.json").write_text("[1, 2]")
    _refused(_adapter_merge(), "adapter_config.json", "JSON object")


# -- run directories ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["config.yaml", "manifest.json", "checkpoints"])
def test_export_refuses_run_files_that_lead_out(ws, name):
    run = ws / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    (ws / "elsewhere" / name).mkdir() if name == "checkpoints" else (ws / "elsewhere" / name).write_text("{}")
    (run / name).unlink(missing_ok=True)
    (run / name).symlink_to(ws / "elsewhere" / name)
    r = CliRunner().invoke(app, ["export", "run", "--format", "hf", "--out", "x"])
    _refused(r, name, "points outside")


# -- output folders -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("out", ["merged-v1.5", "Llama-3.1-8B-merged"])
def test_merge_out_folder_name_with_a_dot(ws, out):
    r = _merge(out=out)
    assert r.exit_code == 0, r.output
    assert (ws / out / "model.safetensors").is_file() and (ws / out / "tokenizer.json").is_file()


def test_extract_lora_out_folder_name_with_a_dot(ws):
    save_file(_tensors(0), str(ws / "b.safetensors"))
    save_file(_tensors(1), str(ws / "t.safetensors"))
    r = CliRunner().invoke(app, ["extract-lora", "--base", "b.safetensors", "--tuned", "t.safetensors", "--rank",
                                 "2", "--out", "lora-v1.5"])
    assert r.exit_code == 0, r.output
    assert (ws / "lora-v1.5" / "adapter_config.json").is_file()


@pytest.mark.parametrize("out", ["m", "m.safetensors"])
def test_output_that_appears_meanwhile_is_kept_and_the_merge_refused(ws, monkeypatch, out):
    """Two merges into the same new --out: the second to finish exits 5 and deletes nothing."""
    from clmerge.merging import pipeline

    real = pipeline._merge_into

    def other_writer_finishes_first(*a):
        real(*a)
        if out.endswith(".safetensors"):
            (ws / out).write_bytes(b"the other merge")
        else:
            (ws / out).mkdir()
            (ws / out / "model.safetensors").write_bytes(b"the other merge")

    monkeypatch.setattr(pipeline, "_merge_into", other_writer_finishes_first)
    r = _merge(out=out)
    _refused(r, out, "appeared", code=5)
    kept = ws / out if out.endswith(".safetensors") else ws / out / "model.safetensors"
    assert kept.read_bytes() == b"the other merge" and _hidden(ws) == []


def test_output_target_replaces_what_existed_before(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "old").write_text("x")
    with OutputTarget(out, "folder") as t:
        (t.tmp / "new").write_text("y")
        t.commit()
    assert sorted(p.name for p in out.iterdir()) == ["new"] and _hidden(tmp_path) == []


def test_output_target_refuses_a_folder_that_appeared(tmp_path):
    out = tmp_path / "m"
    with pytest.raises(OutputError, match="appeared"), OutputTarget(out, "folder") as t:
        out.mkdir()
        (out / "theirs").write_text("x")
        t.commit()
    assert (out / "theirs").read_text() == "x" and _hidden(tmp_path) == []


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temp_folder_of_a_dead_process_is_removed(ws):
    stale = ws / f".m.{_dead_pid()}.abcd1234.tmp"
    live = ws / f".m.{os.getppid()}.efgh5678.tmp"
    for d in (stale, live):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x" * 100)
    r = _merge()
    assert r.exit_code == 0, r.output
    assert not stale.exists() and live.exists()
    assert f"removed {stale}" in r.stderr


_KILLABLE = """
import sys, time
from pathlib import Path
from clmerge.merging import pipeline
from clmerge.cli import main

real = pipeline._merge_into
def slow(*a):
    real(*a)
    Path("started").write_text("1")
    time.sleep(60)
pipeline._merge_into = slow
sys.argv = ["clmerge", "merge", "--method", "task_arithmetic", "--base", "base", "--expert", "e1",
            "--expert", "e2", "--out", "m"]
main()
"""


@pytest.mark.slow
def test_sigterm_during_a_merge_leaves_no_temporary_folder(ws):
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _KILLABLE], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (ws / "started").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert (ws / "started").exists(), proc.communicate()[1]
    assert any(n.startswith(".m.") for n in _hidden(ws))  # the merge is mid-way: its temp folder exists
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=30)[1]
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err)
    assert "Traceback" not in err
    assert _hidden(ws) == [] and not (ws / "m").exists()


def test_full_disk_names_the_path_being_written(ws, monkeypatch):
    from clmerge.merging.io import writer

    def full(*a):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer.os, "pwrite", full)
    r = _merge()
    _refused(r, "--out m", "model.safetensors", os.strerror(errno.ENOSPC), code=5)
    assert _hidden(ws) == [] and not (ws / "m").exists()


def test_extract_lora_keeps_an_output_that_appeared_meanwhile(ws, monkeypatch):
    from clmerge.merging.io import extract

    save_file(_tensors(0), str(ws / "b.safetensors"))
    save_file(_tensors(1), str(ws / "t.safetensors"))
    real = extract.write_adapter

    def other_writer_finishes_first(tmp, *a, **k):
        real(tmp, *a, **k)
        (ws / "x").mkdir()
        (ws / "x" / "theirs").write_text("kept")

    monkeypatch.setattr(extract, "write_adapter", other_writer_finishes_first)
    r = CliRunner().invoke(app, ["extract-lora", "--base", "b.safetensors", "--tuned", "t.safetensors", "--rank",
                                 "2", "--out", "x"])
    _refused(r, "--out x", "appeared", code=5)
    assert sorted(p.name for p in (ws / "x").iterdir()) == ["theirs"] and _hidden(ws) == []
