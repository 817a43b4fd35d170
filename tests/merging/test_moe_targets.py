"""``clmerge moe`` targets beyond Mixtral: Qwen2-MoE (one gated shared expert), Qwen3-MoE, DeepSeek-V3 and
dots.llm1 (summed shared experts, dense first layers), each in the fused and the per-expert layout, built from
tiny dense models, loaded with ``AutoModelForCausalLM`` (transformers' loading info: nothing missing,
unexpected or mismatched) and generating."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_helpers import folder_state
from moe_helpers import build_moe, dense_family

TARGETS = [  # (target, dense family, shared experts, first_k_dense_replace)
    ("mixtral", "llama", 0, 0),
    ("qwen2_moe", "qwen2", 1, 0),
    ("qwen2_moe", "llama", 1, 0),  # mergekit-moe's Qwen MoE takes Llama too: no attention biases then
    ("qwen3_moe", "qwen3", 0, 0),
    ("deepseek_v3", "deepseek_v3", 1, 0),
    ("dots1", "qwen3", 2, 1),
]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_families")
    return {f: dense_family(root / f, f) for f in ("llama", "qwen2", "qwen3", "deepseek_v3")}


def _recipe(paths, target, shared, dense, layout):
    r = {"base_model": str(paths[0]), "architecture": target, "gate_mode": "random", "layout": layout,
         "experts": [{"source_model": str(p)} for p in paths[1:3]]}
    if shared:
        r["shared_experts"] = [{"source_model": str(p)} for p in [paths[3], paths[0]][:shared]]
    if dense:
        r["first_k_dense_replace"] = dense
    return r


def _load(out):
    import transformers as tf

    model, info = tf.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    return model.eval(), info


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
@pytest.mark.parametrize("target, family, shared, dense", TARGETS, ids=[f"{t}-{f}" for t, f, *_ in TARGETS])
def test_each_target_loads_with_no_missing_or_unexpected_weight_and_generates(families, tmp_path, target, family,
                                                                              shared, dense, layout):
    paths = families[family]
    code, output, out = build_moe(tmp_path, "moe", _recipe(paths, target, shared, dense, layout))
    assert code == 0, output
    stored = folder_state(out)
    assert any(k.endswith("experts.gate_up_proj") for k in stored) == (layout == "fused")
    model, info = _load(out)
    assert type(model).__name__ == json.loads((out / "config.json").read_text())["architectures"][0]
    assert model.config.model_type == target
    assert {k: v for k, v in info.items() if v} == {}, info  # missing, unexpected, mismatched, error messages
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert gen.shape == (1, 8)
    # what transformers holds is what the sources hold: expert e of an MoE layer is expert model e's MLP
    sd = model.state_dict()
    layer = dense  # the first MoE layer
    src = [folder_state(p) for p in paths[1:3]]
    for e, s in enumerate(src):
        gate_up = torch.cat([s[f"model.layers.{layer}.mlp.gate_proj.weight"],
                             s[f"model.layers.{layer}.mlp.up_proj.weight"]])
        assert torch.equal(sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"][e], gate_up)
        assert torch.equal(sd[f"model.layers.{layer}.mlp.experts.down_proj"][e],
                           s[f"model.layers.{layer}.mlp.down_proj.weight"])
    base = folder_state(paths[0])
    for k, v in base.items():  # attention, norms, embeddings, head (and the dense first layers) from the base
        if ".mlp." not in k or int(k.split(".")[2]) < dense:
            assert torch.equal(sd[k], v), k


def test_fused_and_per_expert_give_the_same_model(families, tmp_path):
    paths = families["qwen2"]
    outs = [build_moe(tmp_path, lay, _recipe(paths, "qwen2_moe", 1, 0, lay))[2] for lay in ("fused", "per_expert")]
    a, b = (_load(o)[0] for o in outs)
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())


@pytest.mark.parametrize("target, family", [("mixtral", "llama"), ("qwen3_moe", "qwen3")])
def test_identical_experts_reproduce_the_dense_model(families, tmp_path, target, family):
    """Every expert the base: the top-k weights sum to 1, so the MoE is the dense model (a gate / up swap in
    the fused tensor would change the output)."""
    import transformers as tf

    base = families[family][0]
    recipe = {"base_model": str(base), "architecture": target, "gate_mode": "random",
              "experts": [{"source_model": str(base)}] * 3}
    code, output, out = build_moe(tmp_path, "same", recipe)
    assert code == 0, output
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        want = tf.AutoModelForCausalLM.from_pretrained(base).eval()(ids).logits
        got = _load(out)[0](ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_summed_shared_experts_are_one_mlp_with_their_rows_side_by_side(families, tmp_path):
    paths = families["qwen3"]
    code, output, out = build_moe(tmp_path, "dots", _recipe(paths, "dots1", 2, 1, "fused"))
    assert code == 0, output
    got, s0, s1 = folder_state(out), folder_state(paths[3]), folder_state(paths[0])
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["n_shared_experts"], cfg["first_k_dense_replace"], cfg["n_routed_experts"]) == (2, 1, 2)
    pre = "model.layers.1.mlp.shared_experts"
    assert torch.equal(got[f"{pre}.gate_proj.weight"], torch.cat([s0["model.layers.1.mlp.gate_proj.weight"],
                                                                  s1["model.layers.1.mlp.gate_proj.weight"]]))
    assert torch.equal(got[f"{pre}.down_proj.weight"], torch.cat([s0["model.layers.1.mlp.down_proj.weight"],
                                                                  s1["model.layers.1.mlp.down_proj.weight"]], 1))
    assert torch.equal(got["model.layers.1.mlp.gate.e_score_correction_bias"], torch.zeros(2))
    assert got["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert "model.layers.0.mlp.gate_proj.weight" in got  # the dense first layer, from the base


def test_a_qwen2_moe_shared_expert_gate_is_made_from_its_prompts(tmp_path):
    """cheap_embed: the shared expert's gate row is the unit sum of its prompts' input embeddings, as a routed
    expert's row is (mergekit-moe's shared router weights)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # a Llama base (mergekit-moe's Qwen MoE takes Llama too): AutoTokenizer then keeps this word-level
    # tokenizer as it is (for a qwen2 config transformers 5 rebuilds it as Qwen2's byte-level BPE)
    paths = dense_family(tmp_path / "q", "llama")
    words = ["<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(3, 64)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(paths[0])
    recipe = {"base_model": str(paths[0]), "architecture": "qwen2_moe", "gate_mode": "cheap_embed",
              "experts": [{"source_model": str(p), "positive_prompts": [f"w{3 + i} w{9 + i}"]}
                          for i, p in enumerate(paths[1:3])],
              "shared_experts": [{"source_model": str(paths[3]), "positive_prompts": ["w20 w21", "w22"]}]}
    code, output, out = build_moe(tmp_path, "moe", recipe)
    assert code == 0, output
    embed = folder_state(paths[0])["model.embed_tokens.weight"]
    want = embed[[0, 20, 21, 0, 22]].sum(0)  # each prompt with the BOS token in front
    got = folder_state(out)
    for layer in (0, 1):
        torch.testing.assert_close(got[f"model.layers.{layer}.mlp.shared_expert_gate.weight"][0], want / want.norm())
    row0 = embed[[0, 3, 9]].sum(0)
    torch.testing.assert_close(got["model.layers.1.mlp.gate.weight"][0], row0 / row0.norm())


@pytest.mark.parametrize("target, family, shared", [("qwen3_moe", "qwen3", 0), ("dots1", "qwen3", 1)])
def test_a_tied_base_gives_a_tied_moe(tmp_path, target, family, shared):
    """Small Qwen3 models tie their embeddings: no lm_head is stored, and the MoE loads tied."""
    import transformers as tf
    from checkpoint_helpers import save_variants
    from moe_helpers import dense_config

    cfg = dense_config(family)
    cfg.tie_word_embeddings = True
    paths = save_variants(tmp_path, cfg, ["base", "e0", "e1", "e2"], auto=tf.AutoModelForCausalLM)
    code, output, out = build_moe(tmp_path, "moe", _recipe(paths, target, shared, 0, "fused"))
    assert code == 0, output
    assert "lm_head.weight" not in folder_state(out)
    model, info = _load(out)
    assert {k: v for k, v in info.items() if v} == {}, info
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
