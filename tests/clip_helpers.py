"""A tiny random CLIP (``CLIPModel`` with tiny text and vision towers, saved with ``save_pretrained``) with a
WordLevel tokenizer over the words of some datasets' prompts, and experts that are perturbed copies of its
vision tower, for the CLIP merging benchmark's tests (nothing is downloaded)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from clmerge.data.clip_tasks import class_prompts


def _words(datasets: list[str]) -> list[str]:
    text = " ".join(p for d in datasets for ps in class_prompts(d) for p in ps)
    return sorted(set(re.findall(r"\w+|[^\w\s]", text)))


def tiny_clip(folder: Path, datasets: list[str], seed: int = 0, patch_size: int = 8) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPConfig, CLIPModel, PreTrainedTokenizerFast

    vocab = ["<pad>", "<unk>", "<s>"] + _words(datasets) + ["</s>"]  # EOS last: the text pooling's argmax
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                  eos_token="</s>")
    torch.manual_seed(seed)
    cfg = CLIPConfig(text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=32,
                                      eos_token_id=2),
                     vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, image_size=16, patch_size=patch_size,
                                        initializer_factor=5.0),
                     projection_dim=16)
    CLIPModel(cfg).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def perturbed_experts(clip: Path, out: Path, datasets: list[str], scale: float = 0.05) -> Path:
    """``out/<dataset>``: the CLIP vision tower plus seeded noise (one seed per dataset)."""
    from transformers import CLIPVisionModel

    for i, d in enumerate(datasets):
        m = CLIPVisionModel.from_pretrained(clip)
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=g))
        m.save_pretrained(out / d)
    return out
