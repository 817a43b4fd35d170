"""Checkpoint key mapping for HF ViT weights (a pure function, kept beside the builder).

transformers 5.x names a ViT block ``layers.N.attention.{q,k,v,o}_proj`` and ``layers.N.mlp.{fc1,fc2}``;
releases before 5.0 used ``encoder.layer.N.attention.attention.{query,key,value}``,
``encoder.layer.N.attention.output.dense``, ``encoder.layer.N.intermediate.dense`` and
``encoder.layer.N.output.dense``, often under a ``vit.`` prefix. Either spelling loads into either model.
"""

from __future__ import annotations

import re

import torch
from torch import nn

__all__ = ["vit_checkpoint_filter", "load_vit_weights"]

_OLD_TO_NEW = [
    (r"^encoder\.layer\.(\d+)\.attention\.attention\.query\.", r"layers.\1.attention.q_proj."),
    (r"^encoder\.layer\.(\d+)\.attention\.attention\.key\.", r"layers.\1.attention.k_proj."),
    (r"^encoder\.layer\.(\d+)\.attention\.attention\.value\.", r"layers.\1.attention.v_proj."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attention.o_proj."),
    (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.mlp.fc1."),
    (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.mlp.fc2."),
    (r"^encoder\.layer\.(\d+)\.layernorm_before\.", r"layers.\1.layernorm_before."),
    (r"^encoder\.layer\.(\d+)\.layernorm_after\.", r"layers.\1.layernorm_after."),
]


_NEW_TO_OLD = [
    (r"^layers\.(\d+)\.attention\.q_proj\.", r"encoder.layer.\1.attention.attention.query."),
    (r"^layers\.(\d+)\.attention\.k_proj\.", r"encoder.layer.\1.attention.attention.key."),
    (r"^layers\.(\d+)\.attention\.v_proj\.", r"encoder.layer.\1.attention.attention.value."),
    (r"^layers\.(\d+)\.attention\.o_proj\.", r"encoder.layer.\1.attention.output.dense."),
    (r"^layers\.(\d+)\.mlp\.fc1\.", r"encoder.layer.\1.intermediate.dense."),
    (r"^layers\.(\d+)\.mlp\.fc2\.", r"encoder.layer.\1.output.dense."),
    (r"^layers\.(\d+)\.layernorm_before\.", r"encoder.layer.\1.layernorm_before."),
    (r"^layers\.(\d+)\.layernorm_after\.", r"encoder.layer.\1.layernorm_after."),
]


def vit_checkpoint_filter(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Rename the keys of ``state_dict`` to the naming that ``model`` uses (old or new transformers)."""
    target = set(model.state_dict().keys())
    out: dict[str, torch.Tensor] = {}
    wants_new = any(k.startswith("layers.") for k in target)
    rules = _OLD_TO_NEW if wants_new else _NEW_TO_OLD
    for key, value in state_dict.items():
        k = key[len("vit.") :] if key.startswith("vit.") else key
        if k.startswith("classifier.") or k.startswith("pooler."):
            continue  # task heads / pooler are not part of the backbone
        for pat, repl in rules:
            new = re.sub(pat, repl, k)
            if new != k:
                k = new
                break
        out[k] = value
    return out


def load_vit_weights(model: nn.Module, state_dict: dict[str, torch.Tensor], *, source: str = "?") -> None:
    """Load ``state_dict`` into an HF ``ViTModel``; any missing/unexpected key or shape is an error."""
    sd = vit_checkpoint_filter(state_dict, model)
    own = model.state_dict()
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"{source}: weights do not match the ViT config: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for k, v in sd.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise ValueError(f"{source}: {k} has shape {tuple(v.shape)}, the model needs {tuple(own[k].shape)}")
    model.load_state_dict(sd, strict=True)
