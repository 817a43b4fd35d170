"""MoE assembly (``clmerge moe``): a Mixtral from a dense Llama base and dense experts loads and routes tokens."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from checkpoint_helpers import folder_state, llama_config, save_variants
from typer.testing import CliRunner

from clmerge.cli import app

VOCAB = ["<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(3, 64)]
# three experts, each with its own words: a prompt of expert k's words should be routed to expert k
WORDS = [VOCAB[3:13], VOCAB[20:30], VOCAB[40:50]]


def _save_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    import transformers as tf

    tmp = tmp_path_factory.mktemp("moe")
    cfg = llama_config()
    cfg.hidden_size, cfg.num_hidden_layers = 32, 2
    paths = save_variants(tmp, cfg, ["base", "e0", "e1", "e2"], auto=tf.AutoModelForCausalLM)
    _save_tokenizer(paths[0])
    return tmp, paths


def _prompts(k):
    """Six prompts of expert k's words, all ending in its last word (as prompts of one domain share words)."""
    w = WORDS[k]
    return [" ".join([*w[i:i + 3], w[9]]) for i in range(0, 6)]


def _moe(tmp, paths, mode, name="moe", **extra):
    recipe = {"base_model": str(paths[0]), "gate_mode": mode, "experts_per_token": 2, **extra,
              "experts": [{"source_model": str(p), "positive_prompts": _prompts(k)} for k, p in enumerate(paths[1:])]}
    (tmp / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
    res = CliRunner().invoke(app, ["moe", str(tmp / f"{name}.yaml"), "--out", str(tmp / name)])
    assert res.exit_code == 0, res.output
    return tmp / name


@pytest.mark.parametrize("mode", ["hidden", "cheap_embed"])
def test_the_moe_loads_and_routes_an_experts_prompt_to_that_expert_in_the_first_layer(dense, tmp_path, mode):
    import transformers as tf
    from transformers import AutoTokenizer

    _, paths = dense
    out = _moe(tmp_path, paths, mode)
    model = tf.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "MixtralForCausalLM"
    assert model.config.num_local_experts == 3 and model.config.num_experts_per_tok == 2
    tok = AutoTokenizer.from_pretrained(out)
    for k in range(3):
        # expert k's words in an order none of its prompts has, ending with the word its prompts end with
        prompt = " ".join([WORDS[k][5], WORDS[k][2], WORDS[k][0], WORDS[k][9]])
        ids = tok("<s>" + prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            logits = model(ids, output_router_logits=True).router_logits[0]  # first layer, [tokens, experts]
        assert logits.argmax(-1)[-1].item() == k, (mode, k, logits)  # hidden: rows from prompts' last tokens
        if mode == "cheap_embed":  # rows from every token of the prompts: most words of expert k go to k
            assert (logits[1:].argmax(-1) == k).sum() >= 3, (mode, k, logits)


def test_experts_mlps_become_w1_w2_w3_per_expert_and_the_rest_comes_from_the_base(dense, tmp_path):
    _, paths = dense
    out = _moe(tmp_path, paths, "random", layout="per_expert")
    got = folder_state(out)
    base, experts = folder_state(paths[0]), [folder_state(p) for p in paths[1:]]
    for e, sd in enumerate(experts):
        for w, p in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
            assert torch.equal(got[f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight"],
                               sd[f"model.layers.1.mlp.{p}.weight"])
    for k in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.1.post_attention_layernorm.weight", "model.norm.weight"):
        assert torch.equal(got[k], base[k]), k
    assert got["model.layers.0.block_sparse_moe.gate.weight"].shape == (3, 32)
    assert not any(".mlp." in k for k in got)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["architectures"] == ["MixtralForCausalLM"]
    assert (out / "tokenizer.json").exists()


def test_the_default_layout_is_the_installed_transformers_fused_experts(dense, tmp_path):
    _, paths = dense
    got = folder_state(_moe(tmp_path, paths, "random"))
    gate_up = got["model.layers.1.mlp.experts.gate_up_proj"]  # [experts, gate rows then up rows, hidden]
    assert gate_up.shape == (3, 2 * 32, 32)  # intermediate 32, hidden 32
    e1 = folder_state(paths[2])
    assert torch.equal(gate_up[1], torch.cat([e1["model.layers.1.mlp.gate_proj.weight"],
                                              e1["model.layers.1.mlp.up_proj.weight"]]))
    assert torch.equal(got["model.layers.1.mlp.experts.down_proj"][1], e1["model.layers.1.mlp.down_proj.weight"])
    assert not any("block_sparse_moe" in k for k in got)


def test_moe_is_a_kind_the_runner_plans_dry_run_prints_the_plan_and_writes_nothing(dense, tmp_path):
    _, paths = dense
    recipe = {"base_model": str(paths[0]), "gate_mode": "hidden",
              "experts": [{"source_model": str(p), "positive_prompts": _prompts(k)} for k, p in enumerate(paths[1:])]}
    (tmp_path / "moe.yaml").write_text(yaml.safe_dump(recipe))
    res = CliRunner().invoke(app, ["moe", str(tmp_path / "moe.yaml"), "--dry-run", "--out", str(tmp_path / "m")])
    assert res.exit_code == 0, res.output
    assert "moe: mixtral (fused experts), 3 experts x 2 layers" in res.stdout and "hidden routers" in res.stdout
    assert not (tmp_path / "m").exists()
    res = CliRunner().invoke(app, ["moe", str(tmp_path / "moe.yaml")])
    assert res.exit_code == 2 and "--out PATH is required" in res.output
