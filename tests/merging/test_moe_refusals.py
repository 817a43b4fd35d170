"""``clmerge moe`` refuses, in one line and before writing anything, a target its inputs cannot make."""

from __future__ import annotations

import pytest
from moe_helpers import build_moe, dense_family


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    import transformers as tf
    from checkpoint_helpers import save_variants
    from moe_helpers import dense_config

    root = tmp_path_factory.mktemp("moe_refusals")
    out = {f: dense_family(root / f, f, n=3) for f in ("llama", "qwen3")}
    biased = dense_config("llama")
    biased.attention_bias = True  # Mixtral's attention has no biases
    out["llama_bias"] = save_variants(root / "llama_bias", biased, ["base", "e0", "e1"], auto=tf.AutoModelForCausalLM)
    return out


def _recipe(paths, **extra):
    return {"base_model": str(paths[0]), "gate_mode": "random",
            "experts": [{"source_model": str(p)} for p in paths[1:3]], **extra}


CASES = [  # (family, recipe keys, words of the error)
    ("qwen3", {"shared_experts": [{"source_model": "{0}"}]}, ["qwen3_moe has no shared experts", "dots1"]),
    ("llama", {"shared_experts": [{"source_model": "{0}"}]}, ["mixtral has no shared experts"]),
    ("llama", {"architecture": "qwen2_moe"}, ["exactly one shared expert", "got 0"]),
    ("qwen3", {"architecture": "dots1"}, ["at least one shared expert"]),
    ("llama", {"architecture": "deepseek"}, ["mergekit's DeepSeek-MoE", "deepseek_v3", "dots1"]),
    ("llama", {"architecture": "qwen3_moe"}, ["model_type 'llama'", "qwen3"]),
    ("llama", {"architecture": "gpt"}, ["architecture: 'gpt'", "mixtral, qwen2_moe"]),
    ("llama", {"first_k_dense_replace": 1}, ["first_k_dense_replace", "only deepseek_v3 and dots1"]),
    ("qwen3", {"architecture": "dots1", "first_k_dense_replace": 2, "shared_experts": [{"source_model": "{0}"}]},
     ["leaves no MoE layer"]),
    ("qwen3", {"architecture": "dots1", "shared_experts": [{"source_model": "{0}", "positive_prompts": ["x"]}]},
     ["shared experts have no gate"]),
    ("llama", {"layout": "stacked"}, ["layout"]),
    ("llama_bias", {}, ["mixtral output has keys the model does not", "q_proj.bias"]),
]


@pytest.mark.parametrize("family, extra, words", CASES, ids=[f"{c[0]}-{sorted(c[1])}" for c in CASES])
def test_refused_in_one_line_and_nothing_written(families, tmp_path, family, extra, words):
    paths = families[family]
    for e in extra.get("shared_experts", []):
        e["source_model"] = e["source_model"].format(str(paths[0]))
    code, output, out = build_moe(tmp_path, "moe", _recipe(paths, **extra))
    assert code in (2, 3), output
    line = output.strip().splitlines()[-1]
    assert line.startswith("error:") and all(w in output for w in words), output
    assert not out.exists() and not any(p.name.startswith(".moe.") for p in tmp_path.iterdir())
