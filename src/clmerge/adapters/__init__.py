"""Adapters: LoRA layers (several components per layer) and structure save/rebuild.

Layer: above config/metrics and utils; imports nothing else of clmerge (docs/architecture.md).
"""

from .lora import (
    TARGET_ALIASES,
    LoRAComponent,
    LoRALinear,
    add_lora_component,
    dense_is_cheaper,
    fold_component,
    gram_frobenius_norm,
    inject_lora,
    lora_layers,
    resolve_targets,
    set_lora_compute,
)
from .structure import model_structure, rebuild_structure, register_wrapper

__all__ = [
    "TARGET_ALIASES",
    "LoRAComponent",
    "LoRALinear",
    "add_lora_component",
    "dense_is_cheaper",
    "fold_component",
    "gram_frobenius_norm",
    "inject_lora",
    "lora_layers",
    "model_structure",
    "rebuild_structure",
    "register_wrapper",
    "resolve_targets",
    "set_lora_compute",
]
