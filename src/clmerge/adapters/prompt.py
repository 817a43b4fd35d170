"""One prompt mechanism for frozen HF transformer backbones: prompt tokens and key/value prefixes, via hooks.

Two ways a learned prompt enters a frozen transformer (the methods in ``methods/prompts/`` compose them):

(a) **prompt tokens** (prompt-tuning, L2P Eq. 2: ``x_p = [P_s1; ...; P_sN; x_e]``): tokens ``P`` (B, Lp, D) join
    the token sequence after the embedding layer (patch + position embeddings). They are placed right after the
    [CLS] token, ``[cls, P, patches]``, so the [CLS] output stays at index 0. ViT attention has no mask and no
    position information beyond what the embeddings added, so the place of P in the sequence changes no output
    (the official PyTorch L2P uses the same order).
(b) **key/value prefixes** (prefix-tuning, DualPrompt's Pre-T Eq. 3, CODA-Prompt): in chosen layers l, prefixes
    ``p_K`` (B, L, D) and ``p_V`` (B, L, D) are prepended to the *projected* keys and values of self-attention:
    ``softmax(q [p_K; k]^T / sqrt(d)) [p_V; v]``; the queries and the output length are unchanged.

How (no HF attention code is copied):
- (a) is a forward hook on the embeddings module that returns the longer sequence.
- (b) uses transformers' ``AttentionInterface``: HF attention modules call the function registered under their
  ``config._attn_implementation``. Each prompted attention module gets a private shallow copy of its config that
  names :data:`PREFIX_ATTENTION` (registered once). That function prepends the layer's prefix to ``key`` and
  ``value`` (B, H, T, d) and calls the module's original implementation (eager, sdpa, ...) with every other
  argument untouched; with no prefix it calls it with exactly the original arguments (bit-identical outputs).
- A forward pre-hook on the backbone computes the **query** first (the frozen backbone's [CLS] feature with
  prompts disabled, as L2P / DualPrompt / CODA-Prompt do with a second frozen copy), hands it to the method's
  ``selector`` (query -> :class:`PromptInput`) and arms the hooks for the prompted pass that follows.

Backbones: a :class:`_Layout` names the embeddings module, the attention modules and the final norm. HF ViT
(transformers 5 ``ViTModel``: ``embeddings``, ``layers[i].attention``) and CLIP vision (``CLIPVisionModel``:
``embeddings``, ``encoder.layers[i].self_attn``; the tokens pass CLIP's
``pre_layrnorm`` like the patch tokens) are supported. A BERT-style text encoder (``BertModel``: ``embeddings``,
``encoder.layer[i].attention.self``) needs one more layout; its prefixes work as they are (the prefix function
pads the attention mask with "attend" columns), its prompt tokens also need the padding mask widened by Lp
columns (a pre-hook on the encoder) because text batches are padded.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

__all__ = ["PromptInput", "PromptMechanism", "PREFIX_ATTENTION", "attach_prompts"]

PREFIX_ATTENTION = "clmerge_prefix"
Feature = Literal["cls", "prompt_mean"]


@dataclass
class PromptInput:
    """What one forward pass carries.

    Args:
        tokens: prompt tokens (B, Lp, D) inserted after [CLS], or None.
        prefixes: ``{layer: (p_K, p_V)}`` with p_K, p_V (B, L, D) prepended to that layer's keys and values.
    """

    tokens: torch.Tensor | None = None
    prefixes: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass
class _Layout:
    embeddings: nn.Module
    attentions: list[nn.Module]
    final_norm: nn.Module | None  # applied to the prompt tokens' outputs for feature="prompt_mean"


def _find_layout(inner: nn.Module) -> _Layout:
    """Where the embeddings and the attention modules of an HF vision transformer are."""
    name = type(inner).__name__
    if name == "ViTModel":  # last_hidden_state already has the final LayerNorm
        return _Layout(inner.embeddings, [blk.attention for blk in inner.layers], None)
    if name == "CLIPVisionModel":  # last_hidden_state is before post_layernorm (applied to the pooled CLS only)
        return _Layout(inner.embeddings, [blk.self_attn for blk in inner.encoder.layers], inner.post_layernorm)
    raise ValueError(f"prompts: no prompt layout for backbone {name!r} (supported: ViTModel, CLIPVisionModel)")


def _base_attention(module: nn.Module) -> Callable:
    """The attention function the module would call without prompts (its model family's eager one, or sdpa...)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = module._clmerge_base_config._attn_implementation
    eager = sys.modules[type(module).__module__].eager_attention_forward
    return eager if impl in (None, "eager") else ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager)


def _to_heads(p: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B, L, H*d) -> (B, H, L, d), the head split HF applies to projected keys and values."""
    b, h, _, d = like.shape
    return p.to(like.dtype).reshape(b, -1, h, d).transpose(1, 2)


def _pad_mask(mask: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """Add ``n`` "attend" columns in front of the key axis of an additive (float) or boolean mask."""
    if mask is None or n == 0:
        return mask
    pad_shape = (*mask.shape[:-1], n)
    pad = torch.ones(pad_shape, dtype=torch.bool, device=mask.device) if mask.dtype == torch.bool else \
        torch.zeros(pad_shape, dtype=mask.dtype, device=mask.device)
    return torch.cat([pad, mask], dim=-1)


def _prefix_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """Attention with the layer's prefix prepended to keys and values (DualPrompt Eq. 3); else the original call."""
    mechanism, layer = module._clmerge_prompt
    base = _base_attention(module)
    prefix = mechanism.prefix_for(layer)
    if prefix is None:
        return base(module, query, key, value, attention_mask, **kwargs)
    pk, pv = _to_heads(prefix[0], key), _to_heads(prefix[1], value)  # (B, H, L, d)
    key = torch.cat([pk, key], dim=2)
    value = torch.cat([pv, value], dim=2)
    return base(module, query, key, value, _pad_mask(attention_mask, pk.shape[2]), **kwargs)


def _register_prefix_attention() -> None:
    from transformers.modeling_utils import AttentionInterface

    if PREFIX_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(PREFIX_ATTENTION, _prefix_attention)


class PromptMechanism:
    """Prompt tokens and key/value prefixes for a :class:`~clmerge.models.backbones.VisionBackbone`.

    Args:
        backbone: a VisionBackbone whose ``inner`` is an HF ``ViTModel`` or ``CLIPVisionModel``.
        prefix_layers: indices of the blocks whose attention takes prefixes.
        feature: what the backbone returns while prompts are active: ``cls`` (the [CLS] output, DualPrompt,
            CODA-Prompt) or ``prompt_mean`` (mean of the prompt tokens' outputs, L2P's ``head_type='prompt'``).

    ``selector`` (query (B, D) -> :class:`PromptInput`) is called before every forward pass of the backbone.
    ``provider`` (inputs -> :class:`PromptInput`), when set, is called instead and no query pass is run (prompts
    that do not depend on the image, as VPT's).
    """

    def __init__(self, backbone: nn.Module, *, prefix_layers: list[int] | tuple[int, ...] = (),
                 feature: Feature = "cls") -> None:
        self.backbone = backbone
        self.layout = _find_layout(backbone.inner)
        self.num_layers = len(self.layout.attentions)
        self.feature = feature
        self.selector: Callable[[torch.Tensor], PromptInput] | None = None
        self.provider: Callable[[torch.Tensor], PromptInput] | None = None
        self._active: PromptInput | None = None
        self._fixed: PromptInput | None = None
        self._busy = False
        self._hidden: torch.Tensor | None = None
        self.prefix_layers = sorted(set(prefix_layers))
        self.check_layers(self.prefix_layers, "prefix_layers")
        self._handles = [backbone.register_forward_pre_hook(self._before), backbone.register_forward_hook(self._after),
                         self.layout.embeddings.register_forward_hook(self._insert_tokens),
                         backbone.inner.register_forward_hook(self._keep_hidden)]
        if self.prefix_layers:
            _register_prefix_attention()
        for i in self.prefix_layers:
            attn = self.layout.attentions[i]
            attn._clmerge_base_config = attn.config
            attn.config = copy.copy(attn.config)  # private: only this module routes through the prefix function
            attn.config._attn_implementation_internal = PREFIX_ATTENTION
            attn._clmerge_prompt = (self, i)

    def check_layers(self, layers, key: str) -> None:
        bad = [i for i in layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"{key}: layer(s) {bad} do not exist (the backbone has {self.num_layers} layers)")

    # -- what the hooks read ----------------------------------------------------------------------------
    def prefix_for(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self._active is None:
            return None
        pair = self._active.prefixes.get(layer)
        if pair is not None and pair[0].shape[1] != pair[1].shape[1]:
            raise ValueError(f"prompts: layer {layer} has {pair[0].shape[1]} key but {pair[1].shape[1]} value "
                             "prefix tokens; they must be equal")
        return pair

    def _insert_tokens(self, module, args, output: torch.Tensor):
        tokens = self._active.tokens if self._active is not None else None
        if tokens is None:
            return None
        return torch.cat([output[:, :1], tokens.to(output.dtype), output[:, 1:]], dim=1)  # (B, 1+Lp+N, D)

    def _keep_hidden(self, module, args, output) -> None:
        if self._active is not None and self._active.tokens is not None and self.feature == "prompt_mean":
            self._hidden = output.last_hidden_state

    def _before(self, module, args) -> None:
        if self._busy:
            return
        if self._fixed is not None:
            self._active = self._fixed
        elif self.provider is not None:
            self._active = self.provider(args[0])
        elif self.selector is not None:
            self._active = self.selector(self.query(args[0]))

    def _after(self, module, args, output: torch.Tensor):
        if self._busy:
            return None
        active, hidden = self._active, self._hidden
        self._active = self._hidden = None
        if active is None or active.tokens is None or self.feature != "prompt_mean":
            return None
        prompt_out = hidden[:, 1:1 + active.tokens.shape[1]]  # (B, Lp, D)
        if self.layout.final_norm is not None:
            prompt_out = self.layout.final_norm(prompt_out)
        return prompt_out.mean(dim=1)  # (B, D)

    # -- API ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def query(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen backbone's [CLS] feature of images ``x`` with every prompt disabled (B, D)."""
        was = self.backbone.training  # the official codes take the query from a frozen model in eval mode
        self.backbone.eval()
        try:
            with self.disabled():
                return self.backbone(x)
        finally:
            self.backbone.train(was)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Run the plain backbone: no selector call, no tokens, no prefixes."""
        busy, active = self._busy, self._active
        self._busy, self._active = True, None
        try:
            yield
        finally:
            self._busy, self._active = busy, active

    @contextlib.contextmanager
    def using(self, prompts: PromptInput) -> Iterator[None]:
        """Forward passes inside use ``prompts`` as given (no query, no selector)."""
        self._fixed = prompts
        try:
            yield
        finally:
            self._fixed = None

    def remove(self) -> None:
        """Detach every hook and give the attention modules their own config back."""
        for h in self._handles:
            h.remove()
        for i in self.prefix_layers:
            attn = self.layout.attentions[i]
            attn.config = attn._clmerge_base_config
            del attn._clmerge_base_config, attn._clmerge_prompt
        self._handles = []


def attach_prompts(backbone: nn.Module, *, prefix_layers: list[int] | tuple[int, ...] = (),
                   feature: Feature = "cls") -> PromptMechanism:
    """Hook ``backbone`` for prompts (see :class:`PromptMechanism`); returns the mechanism."""
    return PromptMechanism(backbone, prefix_layers=prefix_layers, feature=feature)
