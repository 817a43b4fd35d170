"""Tiny real-architecture checkpoints (random-init Llama / BERT / ViT saved with ``save_pretrained``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from clmerge.cli import app


def llama_config():
    import transformers as tf

    return tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                          num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)


def save_variants(folder: Path, config, names, *, dtype=torch.float32, shard: str | None = None, auto=None):
    """``base`` plus fine-tuned-like variants (base + small noise) saved with ``save_pretrained``."""
    import transformers as tf

    auto = auto or tf.AutoModel
    torch.manual_seed(0)
    base = auto.from_config(config).to(dtype)
    paths = []
    for i, name in enumerate(names):
        model = base if i == 0 else auto.from_config(config).to(dtype)
        if i:
            g = torch.Generator().manual_seed(i)
            with torch.no_grad():
                for (_, p), (_, q) in zip(model.named_parameters(), base.named_parameters()):
                    p.copy_(q + 0.05 * torch.randn(q.shape, generator=g).to(dtype))
        kwargs = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(folder / name, **kwargs)
        paths.append(folder / name)
    return paths


def folder_state(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved model folder (single file or shards), in the order ``open_checkpoint`` gives
    (the index's order): exact-density TIES breaks magnitude ties by position, so key order matters."""
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        return load_file(str(folder / "model.safetensors"))
    weight_map = json.loads(index.read_text())["weight_map"]
    out = {}
    for f in sorted(set(weight_map.values())):
        out.update(load_file(str(folder / f)))
    return {k: out[k] for k in weight_map}


def invoke(*args):
    return CliRunner().invoke(app, ["merge", *map(str, args)])
