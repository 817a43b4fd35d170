"""Pre-flight from headers alone (clmerge.merging.preflight): architecture mismatches named as architectures,
vocabulary mismatches without an ``embeddings:`` policy, missing keys; all before any tensor is read."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.merging.io.base import MergeInputError
from clmerge.merging.run import build_recipe, run_merge

LLAMA = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             vocab_size=40)


def llama(folder: Path, seed: int = 0, **over) -> Path:
    import transformers as tf

    torch.manual_seed(seed)
    tf.LlamaForCausalLM(tf.LlamaConfig(**{**LLAMA, **over})).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    import transformers as tf

    d = tmp_path_factory.mktemp("preflight")
    llama(d / "base")
    llama(d / "ft", seed=1)
    llama(d / "deep", seed=2, num_hidden_layers=3)
    llama(d / "wide", seed=3, hidden_size=32, intermediate_size=32)
    llama(d / "vocab", seed=4, vocab_size=44)
    torch.manual_seed(5)
    tf.BertModel(tf.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=32)).save_pretrained(d / "bert")
    shutil.copytree(d / "ft", d / "no_norm")
    sd = load_file(d / "no_norm" / "model.safetensors")
    save_file({k: v for k, v in sd.items() if "post_attention_layernorm" not in k}, d / "no_norm" / "model.safetensors",
              metadata={"format": "pt"})
    return d


def merge(zoo: Path, *experts: str, base: str = "base", **options):
    args = ["merge", "--method", "task_arithmetic", "--base", str(zoo / base), "--out", str(zoo / "out"),
            "--no-hash-inputs"]
    for e in experts:
        args += ["--expert", str(zoo / e)]
    return CliRunner().invoke(app, args)


def test_a_bert_expert_against_a_llama_base_is_named_as_two_architectures(zoo):
    res = merge(zoo, "bert")
    assert res.exit_code == 3
    out = " ".join(res.output.split())
    assert f"models[0] ({zoo / 'bert'}) is a bert (2 layers, hidden size 16), the base ({zoo / 'base'}) is a llama " \
           "(2 layers, hidden size 16) (model type differs)" in out
    assert "LayerNorm" not in out  # not a key-by-key complaint
    assert not (zoo / "out").exists()


@pytest.mark.parametrize("expert, what", [("deep", "is a llama (3 layers, hidden size 16)"),
                                          ("wide", "is a llama (2 layers, hidden size 32)")])
def test_layer_count_and_hidden_size_mismatches_are_named(zoo, expert, what):
    res = merge(zoo, expert)
    out = " ".join(res.output.split())
    assert res.exit_code == 3 and what in out and "the inputs are different architectures" in out


def test_a_vocabulary_mismatch_without_an_embeddings_policy_names_the_rows_and_the_policy(zoo):
    res = merge(zoo, "vocab")
    out = " ".join(res.output.split())
    assert res.exit_code == 3
    assert "shape mismatch of model.embed_tokens.weight" in out and "[44, 16]" in out and "[40, 16]" in out
    assert "set embeddings: union, base or intersection" in out


def test_missing_keys_are_listed_grouped_by_layer(zoo):
    res = merge(zoo, "no_norm")
    out = " ".join(res.output.split())
    assert res.exit_code == 3
    assert "is missing 2 key(s) that the base" in out and "model.layers.{0, 1}.post_attention_layernorm.weight" in out


def test_every_expert_is_named_not_only_the_first_mismatch(zoo):
    res = merge(zoo, "deep", "bert")
    out = " ".join(res.output.split())
    assert "models[0]" in out and "models[1]" in out


def test_pre_flight_reads_no_tensor(zoo, monkeypatch):
    from clmerge.merging.io import base as io_base

    def no_reads(*args, **kwargs):
        raise AssertionError("a tensor was read before the pre-flight refused the merge")

    monkeypatch.setattr(io_base._SafetensorsReader, "read", no_reads)
    for expert in ("bert", "deep", "vocab", "no_norm"):
        recipe = build_recipe(None, "task_arithmetic", str(zoo / "base"), [str(zoo / expert)], [], {})
        with pytest.raises(MergeInputError, match="pre-flight"):
            run_merge(recipe, zoo / "never", hash_inputs=False)


def test_matching_inputs_pass_the_pre_flight(zoo, tmp_path):
    res = CliRunner().invoke(app, ["merge", "--method", "task_arithmetic", "--base", str(zoo / "base"), "--expert",
                                   str(zoo / "ft"), "--out", str(tmp_path / "m"), "--no-hash-inputs"])
    assert res.exit_code == 0, res.output


def _slices(zoo: Path, tmp: Path, second: str):
    import yaml

    recipe = tmp / "slices.yaml"
    recipe.write_text(yaml.safe_dump({"method": "passthrough", "slices": [
        {"sources": [{"model": str(zoo / "base"), "layer_range": [0, 2]}]},
        {"sources": [{"model": str(zoo / second), "layer_range": [1, 2]}]}]}))
    return CliRunner().invoke(app, ["merge", str(recipe), "--out", str(tmp / "out"), "--no-hash-inputs"])


def test_a_slice_recipe_names_another_architecture_but_stacks_models_of_other_depths(zoo, tmp_path):
    res = _slices(zoo, tmp_path, "bert")
    out = " ".join(res.output.split())
    assert res.exit_code == 3 and f"model {zoo / 'bert'} is a bert" in out and "model type differs" in out
    res = _slices(zoo, tmp_path, "deep")  # 3 layers beside 2: a frankenmerge, not a mismatch
    assert res.exit_code == 0, res.output


def test_an_moe_expert_of_another_architecture_is_named_as_such(zoo, tmp_path):
    import yaml

    recipe = tmp_path / "moe.yaml"
    recipe.write_text(yaml.safe_dump({"base_model": str(zoo / "base"), "gate_mode": "random",
                                      "experts": [{"source_model": str(zoo / "ft")},
                                                  {"source_model": str(zoo / "bert")}]}))
    res = CliRunner().invoke(app, ["moe", str(recipe), "--out", str(tmp_path / "moe"), "--no-hash-inputs"])
    out = " ".join(res.output.split())
    assert res.exit_code == 3 and f"experts[1] ({zoo / 'bert'}) is a bert" in out and "is a llama" in out
