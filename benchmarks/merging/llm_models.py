"""The llm_scale benchmark's models: a random-init 1.1B Llama (TinyLlama-1.1B shapes) and 3 variants.

Everything is generated from seeds (nothing downloaded) and written with ``save_pretrained`` as sharded bf16
safetensors, plus a small BPE tokenizer trained offline on this repository's Markdown (so the folders look
like what users have: config, generation config, tokenizer, index, shards). At most two models are in memory
at once (the base, and the variant being built key by key).

- base: linear and embedding weights ~ N(0, 0.02^2) (Llama's ``initializer_range``), norms = 1;
- variant v (1..3), per tensor W with scale s = std(W) (mean |W| for the constant norms): ``W + M * N(0, (0.01
  s)^2) + (0.005 s / 2) * U V`` with M a Bernoulli(0.3) mask and U, V ~ N(0, 1) of rank 4 (the low-rank part
  only on matrices), computed in fp32 and rounded to bf16. A change of 0.01 s is about two bf16 units in the
  last place of a typical entry, so many entries of the task vector are exactly 0 or tie in magnitude: the
  regime where "keep the top 20%" needs a tie rule.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch

LLAMA_1B = {"hidden_size": 2048, "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
            "intermediate_size": 5632, "vocab_size": 32000, "max_position_embeddings": 2048,
            "tie_word_embeddings": False}
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 176, "vocab_size": 1000, "max_position_embeddings": 128,
        "tie_word_embeddings": False}
VARIANTS = 3
SPEC_VERSION = 1


def _generator(seed: int, variant: int, key: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + variant * 7919 + zlib.crc32(key.encode()))
                                         % 2**63)


def _base_tensor(key: str, shape: torch.Size, g: torch.Generator) -> torch.Tensor:
    if key.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    return torch.empty(shape).normal_(0.0, 0.02, generator=g).to(torch.bfloat16)


def variant_tensor(w: torch.Tensor, g: torch.Generator, rank: int = 4) -> torch.Tensor:
    """``w`` plus a sparse Gaussian delta and (for matrices) a low-rank one; see the module docstring."""
    x = w.float()
    s = float(x.std()) if x.numel() > 1 and float(x.std()) > 0 else float(x.abs().mean())
    noise = torch.randn(x.shape, generator=g).mul_(0.01 * s)
    noise.mul_(torch.rand(x.shape, generator=g) < 0.3)
    x.add_(noise)
    del noise
    if x.dim() == 2:
        u = torch.randn(x.shape[0], rank, generator=g)
        v = torch.randn(rank, x.shape[1], generator=g)
        x.addmm_(u, v, alpha=0.005 * s / rank ** 0.5)
    return x.to(torch.bfloat16)


def _tokenizer(out: Path, vocab_size: int) -> bool:
    """Train a byte-level BPE on the repo's Markdown and save it next to the model; False if that fails."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        repo = Path(__file__).resolve().parents[2]
        files = [str(p) for p in sorted(repo.rglob("*.md")) if ".venv" not in p.parts][:200]
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train(files, trainers.BpeTrainer(vocab_size=min(vocab_size, 8000), show_progress=False,
                                             special_tokens=["<unk>", "<s>", "</s>"]))
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                       unk_token="<unk>")
        fast.save_pretrained(str(out))
        return True
    except Exception as exc:  # an optional extra: the benchmark runs without it
        print(f"note: no tokenizer written ({type(exc).__name__}: {exc})")
        return False


def make_models(data_dir: Path, *, tiny: bool = False, seed: int = 0, shard: str = "500MB",
                layers: int | None = None) -> dict[str, Any]:
    """Write ``base/`` and ``variant{1..3}/`` under ``data_dir``; skipped when ``spec.json`` matches.
    ``layers``: TinyLlama's widths with that many decoder layers (a quicker set with the same tensor shapes)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    shapes_cfg = TINY if tiny else LLAMA_1B
    if layers is not None:
        shapes_cfg = {**shapes_cfg, "num_hidden_layers": layers}
    spec = {"config": shapes_cfg, "seed": seed, "shard": shard, "variants": VARIANTS, "version": SPEC_VERSION}
    spec_file = data_dir / "spec.json"
    if spec_file.exists():
        old = json.loads(spec_file.read_text())
        if {k: old.get(k) for k in spec} == spec:
            return old
    data_dir.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(**shapes_cfg, bos_token_id=1, eos_token_id=2)
    cfg.dtype = torch.bfloat16
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for key, p in model.named_parameters():
            p.copy_(_base_tensor(key, p.shape, _generator(seed, 0, key)))
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2)
    spec["tokenizer"] = False
    for v in range(VARIANTS + 1):
        out = data_dir / ("base" if v == 0 else f"variant{v}")
        sd = None if v == 0 else {k: variant_tensor(p.detach(), _generator(seed, v, k))
                                  for k, p in model.named_parameters()}
        shutil.rmtree(out, ignore_errors=True)  # stale shards or index of an earlier spec would be read
        model.save_pretrained(str(out), state_dict=sd, max_shard_size=shard)
        spec["tokenizer"] = _tokenizer(out, shapes_cfg["vocab_size"])
        del sd
        print(f"wrote {out}", flush=True)
    spec_file.write_text(json.dumps(spec))
    return spec


def model_dirs(data_dir: Path) -> tuple[Path, list[Path]]:
    return data_dir / "base", [data_dir / f"variant{v}" for v in range(1, VARIANTS + 1)]
