"""Tiny dense source models for the MoE tests: a base and variants of it (save_pretrained, no downloads)."""

from __future__ import annotations

from pathlib import Path

import yaml
from checkpoint_helpers import save_variants
from typer.testing import CliRunner

from clmerge.cli import app

_COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, tie_word_embeddings=False)


def dense_config(family: str):
    """A tiny dense config of ``family`` (llama, qwen2, qwen3, deepseek_v3: every layer dense)."""
    import transformers as tf

    if family == "llama":
        return tf.LlamaConfig(**_COMMON)
    if family == "qwen2":
        return tf.Qwen2Config(**_COMMON)
    if family == "qwen3":
        return tf.Qwen3Config(**_COMMON, head_dim=8)
    if family == "deepseek_v3":  # MLA attention, first_k_dense_replace = the layer count: a dense model
        return tf.DeepseekV3Config(**{**_COMMON, "num_key_value_heads": 4}, moe_intermediate_size=48,
                                   first_k_dense_replace=2, n_routed_experts=2, n_shared_experts=1, n_group=1,
                                   topk_group=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4,
                                   qk_nope_head_dim=4, v_head_dim=8)
    raise ValueError(family)


def dense_family(folder: Path, family: str, n: int = 4) -> list[Path]:
    """``base`` and ``n - 1`` fine-tuned-like variants of a tiny dense ``family`` model."""
    import transformers as tf

    return save_variants(folder, dense_config(family), ["base"] + [f"e{i}" for i in range(n - 1)],
                         auto=tf.AutoModelForCausalLM)


def build_moe(tmp: Path, name: str, recipe: dict) -> tuple[int, str, Path]:
    """Run ``clmerge moe`` on ``recipe``; returns the exit code, the output and the output folder."""
    (tmp / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
    res = CliRunner().invoke(app, ["moe", str(tmp / f"{name}.yaml"), "--out", str(tmp / name)])
    return res.exit_code, res.output, tmp / name
