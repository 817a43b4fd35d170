"""Layer slicing (frankenmerges): stacked layer ranges load in transformers and equal a model built by hand."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from checkpoint_helpers import folder_state, invoke, llama_config, save_variants

from clmerge.merging.slices import split_layer_key


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    """Two 2-layer Llama causal LMs (``a`` and a perturbed ``b``) saved with ``save_pretrained``."""
    import transformers as tf

    tmp = tmp_path_factory.mktemp("llamas")
    cfg = llama_config()
    cfg.num_hidden_layers = 2
    a, b = save_variants(tmp, cfg, ["a", "b"], auto=tf.AutoModelForCausalLM)
    return tmp, a, b


def _recipe(tmp, data, name="recipe.yaml"):
    p = tmp / name
    p.write_text(yaml.safe_dump(data))
    return p


def _renumbered(state, mapping):
    """``{out layer: in layer}`` applied to the per-layer keys of ``state``; other keys kept."""
    out = {k: v for k, v in state.items() if split_layer_key(k) is None}
    for o, i in mapping.items():
        for k, v in state.items():
            parts = split_layer_key(k)
            if parts and parts[1] == i:
                out[f"{parts[0]}.{o}.{parts[2]}"] = v
    return out


def test_duplicated_layers_load_and_give_the_logits_of_a_model_built_by_hand(llamas, tmp_path):
    import transformers as tf

    _, a, _ = llamas
    recipe = _recipe(tmp_path, {"method": "passthrough", "slices": [
        {"sources": [{"model": str(a), "layer_range": [0, 2]}]},
        {"sources": [{"model": str(a), "layer_range": [0, 2]}]}]})
    res = invoke(recipe, "--out", tmp_path / "out")
    assert res.exit_code == 0, res.output
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_hidden_layers"] == 4
    got = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()

    src = tf.AutoModelForCausalLM.from_pretrained(a)
    cfg4 = llama_config()
    cfg4.num_hidden_layers = 4
    ref = tf.LlamaForCausalLM(cfg4).eval()
    ref.load_state_dict(_renumbered(src.state_dict(), {0: 0, 1: 1, 2: 0, 3: 1}))
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(got(ids).logits, ref(ids).logits)
        assert not torch.allclose(got(ids).logits, src(ids).logits)  # four layers are not two


def test_a_slice_of_several_sources_is_merged_and_outer_keys_follow_mergekit(llamas, tmp_path):
    _, a, b = llamas
    recipe = _recipe(tmp_path, {"method": "weight_average", "slices": [
        {"sources": [{"model": str(a), "layer_range": [1, 2]}, {"model": str(b), "layer_range": [0, 1]}]},
        {"sources": [{"model": str(b), "layer_range": [1, 2]}]}]})
    res = invoke(recipe, "--out", tmp_path / "out")
    assert res.exit_code == 0, res.output
    got, sa, sb = folder_state(tmp_path / "out"), folder_state(a), folder_state(b)
    q = "self_attn.q_proj.weight"
    torch.testing.assert_close(got[f"model.layers.0.{q}"], (sa[f"model.layers.1.{q}"] + sb[f"model.layers.0.{q}"]) / 2)
    assert torch.equal(got[f"model.layers.1.{q}"], sb[f"model.layers.1.{q}"])
    # embeddings from the first slice's sources (merged), final norm and head from the last slice's
    emb = "model.embed_tokens.weight"
    torch.testing.assert_close(got[emb], (sa[emb] + sb[emb]) / 2)
    assert torch.equal(got["lm_head.weight"], sb["lm_head.weight"])
    assert torch.equal(got["model.norm.weight"], sb["model.norm.weight"])
    assert sum(split_layer_key(k) is not None for k in got) == sum(split_layer_key(k) is not None for k in sa)


def test_a_named_base_gives_the_non_layer_tensors_and_a_shallower_model_loads(llamas, tmp_path):
    import transformers as tf

    _, a, b = llamas
    recipe = _recipe(tmp_path, {"method": "passthrough", "base": str(a), "slices": [
        {"sources": [{"model": str(b), "layer_range": [1, 2]}]}]})
    res = invoke(recipe, "--out", tmp_path / "out")
    assert res.exit_code == 0, res.output
    got, sa, sb = folder_state(tmp_path / "out"), folder_state(a), folder_state(b)
    assert torch.equal(got["lm_head.weight"], sa["lm_head.weight"])
    assert torch.equal(got["model.layers.0.mlp.up_proj.weight"], sb["model.layers.1.mlp.up_proj.weight"])
    assert tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.num_hidden_layers == 1


def test_dry_run_lists_the_output_layers_and_writes_nothing(llamas, tmp_path):
    _, a, b = llamas
    recipe = _recipe(tmp_path, {"method": "passthrough", "slices": [
        [{"model": str(a), "layer_range": [0, 2]}], [{"model": str(b), "layer_range": [1, 2]}]]})
    res = invoke(recipe, "--dry-run")
    assert res.exit_code == 0, res.output
    assert "output layers: 3" in res.output and "layers 2..2" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


def test_the_documented_recipes_are_valid(tmp_path):
    """Every YAML recipe of the docs' section on slices, stages and MoE assembly validates."""
    import re
    import textwrap
    from pathlib import Path

    from clmerge.merging.moe import load_moe_recipe
    from clmerge.merging.recipes import load_recipe

    doc = (Path(__file__).resolve().parents[2] / "docs" / "merging_checkpoints.md").read_text()
    section = doc.split("## Frankenmerges, multi-stage recipes and MoE assembly", 1)[1].split("\n## ", 1)[0]
    blocks = [textwrap.dedent(body) for _, body in re.findall(r"( *)```yaml\n(.*?)\1```", section, re.S)]
    assert len(blocks) == 4
    kinds = []
    for i, text in enumerate(blocks):
        data = yaml.safe_load(text)
        if "experts" in data:
            (tmp_path / f"m{i}.yaml").write_text(text)
            kinds.append(type(load_moe_recipe(tmp_path / f"m{i}.yaml")).__name__)
        else:
            recipe = load_recipe("", data)
            kinds.append("stages" if recipe.stages else "slices")
    assert kinds == ["slices", "slices", "stages", "MoeRecipe"]


def test_a_slice_recipe_into_one_safetensors_file_is_an_output_error(llamas, tmp_path):
    _, a, _ = llamas
    recipe = _recipe(tmp_path, {"method": "passthrough", "slices": [[{"model": str(a), "layer_range": [0, 1]}]]})
    res = invoke(recipe, "--out", tmp_path / "m.safetensors")
    assert res.exit_code == 5 and "model folder" in res.stderr, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


def test_a_depth_gradient_runs_over_each_slices_own_layers(llamas, tmp_path):
    _, a, b = llamas
    both = [{"model": str(a), "layer_range": [0, 2]}, {"model": str(b), "layer_range": [0, 2]}]
    recipe = _recipe(tmp_path, {"method": "slerp", "parameters": {"t": [0.0, 1.0]},
                                "slices": [{"sources": both}, {"sources": both}]})
    res = invoke(recipe, "--out", tmp_path / "out")
    assert res.exit_code == 0, res.output
    got, sa, sb = folder_state(tmp_path / "out"), folder_state(a), folder_state(b)
    k = "mlp.down_proj.weight"
    for out_layer in (0, 2):  # each slice's first layer: t = 0, the first model
        torch.testing.assert_close(got[f"model.layers.{out_layer}.{k}"], sa[f"model.layers.0.{k}"])
    for out_layer in (1, 3):  # each slice's last layer: t = 1, the second model
        torch.testing.assert_close(got[f"model.layers.{out_layer}.{k}"], sb[f"model.layers.1.{k}"])


def test_tokenizer_from_names_the_folder_whose_tokenizer_is_copied(llamas, tmp_path):
    _, a, _ = llamas
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text('{"marker": 1}')
    recipe = _recipe(tmp_path, {"method": "passthrough", "tokenizer_from": str(tmp_path / "tok"),
                                "slices": [[{"model": str(a), "layer_range": [0, 1]}]]})
    res = invoke(recipe, "--out", tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"marker": 1}'
