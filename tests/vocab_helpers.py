"""Tiny Llama models whose tokenizers differ (by added tokens, by the order of their vocabulary).

Each model's tokenizer is a ``tokenizers`` WordLevel model built in memory and wrapped as a
``PreTrainedTokenizerFast``, saved beside a tiny ``LlamaForCausalLM`` (``save_pretrained``). The embedding row
of a token depends only on the token's string and the model's ``seed`` (:func:`token_row`), so the same model
with its vocabulary reordered has its rows reordered with it.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

CORE = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(20)]
HIDDEN = 16


def token_row(token: str, seed: int) -> torch.Tensor:
    """The embedding row of ``token`` in the model of ``seed`` (seed 0: the base's row)."""
    g = torch.Generator().manual_seed(zlib.crc32(token.encode()))
    row = torch.randn(HIDDEN, generator=g)
    if seed:
        row += 0.1 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(zlib.crc32(token.encode()) + seed))
    return row


def head_row(token: str, seed: int) -> torch.Tensor:
    """The ``lm_head`` row of ``token`` (untied models)."""
    return token_row("head:" + token, seed)


def tiny_tokenizer(core: list[str], added: list[str] = (), chat_template: str | None = None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AddedToken, PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(core)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.add_tokens([AddedToken(a, special=a.startswith("<"), normalized=False) for a in added])
    if chat_template:
        tok.chat_template = chat_template
    return tok


def tiny_lm(folder: Path, *, seed: int, core: list[str] = CORE, added: list[str] = (), tie: bool = False,
            equal_head: bool = False, chat_template: str | None = None) -> Path:
    """A tiny LlamaForCausalLM plus its tokenizer in ``folder``; rows by :func:`token_row` / :func:`head_row`.

    Args:
        seed: 0 for the base; other seeds add small noise to every parameter (a fine-tune).
        tie: ``tie_word_embeddings`` (one matrix saved).
        equal_head: untied in the config, but ``lm_head`` saved equal to the input embeddings.
    """
    import transformers as tf

    tok = tiny_tokenizer(core, added, chat_template)
    vocab = tok.get_vocab()
    config = tf.LlamaConfig(vocab_size=len(vocab), hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie,
                            bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], pad_token_id=None)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config)
    with torch.no_grad():
        if seed:
            g = torch.Generator().manual_seed(seed)
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        for token, i in vocab.items():
            model.model.embed_tokens.weight[i] = token_row(token, seed)
            if not tie:
                model.lm_head.weight[i] = token_row(token, seed) if equal_head else head_row(token, seed)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def vocab_of(folder: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    return dict(AutoTokenizer.from_pretrained(str(folder)).get_vocab())
