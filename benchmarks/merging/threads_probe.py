"""Make a ~200M-parameter bf16 Llama-shaped checkpoint (base + 2 variants, sharded) for the threads probe.

Usage: python benchmarks/merging/threads_probe.py DIR   (then time `clmerge merge` on DIR/base, DIR/v0, DIR/v1)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from clmerge.merging.io.writer import ShardedWriter

HIDDEN, INTER, VOCAB = 1024, 2816, 32000
LAYERS = int(os.environ.get("LAYERS", "12"))  # 12: 220M parameters; 36: 530M


def shapes() -> list[tuple[str, tuple[int, ...]]]:
    out = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out += [(p + f"self_attn.{m}_proj.weight", (HIDDEN, HIDDEN)) for m in "qkvo"]
        out += [(p + "mlp.gate_proj.weight", (INTER, HIDDEN)), (p + "mlp.up_proj.weight", (INTER, HIDDEN)),
                (p + "mlp.down_proj.weight", (HIDDEN, INTER))]
        out += [(p + "input_layernorm.weight", (HIDDEN,)), (p + "post_attention_layernorm.weight", (HIDDEN,))]
    return out + [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]


def main(root: Path) -> None:
    plan = [(k, s, torch.bfloat16) for k, s in shapes()]
    g = torch.Generator().manual_seed(0)
    for name in ("base", "v0", "v1"):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        w = ShardedWriter(folder, plan, shard_size=200 * 10**6)
        for i, (k, s, _) in enumerate(plan):
            gen = torch.Generator().manual_seed(i)  # the base tensor, the same in every model
            t = torch.randn(s, generator=gen) * 0.02
            if name != "base":
                t += 0.002 * torch.randn(s, generator=g)
            w.write(k, t)
        w.close()
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
               "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": 16,
               "num_key_value_heads": 16, "vocab_size": VOCAB, "dtype": "bfloat16", "tie_word_embeddings": False}
        (folder / "config.json").write_text(json.dumps(cfg))
    print(sum(torch.Size(s).numel() for _, s in shapes()), "parameters per model")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
