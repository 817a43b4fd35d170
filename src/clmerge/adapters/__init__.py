"""Adapters: LoRA layers (several components per layer) and structure save/rebuild."""

from .lora import (
    LoRAComponent,
    LoRALinear,
    TARGET_ALIASES,
    add_lora_component,
    fold_component,
    gram_frobenius_norm,
    inject_lora,
    lora_layers,
    resolve_targets,
)
from .structure import model_structure, rebuild_structure, register_wrapper

__all__ = [
    "LoRAComponent",
    "LoRALinear",
    "TARGET_ALIASES",
    "add_lora_component",
    "fold_component",
    "gram_frobenius_norm",
    "inject_lora",
    "lora_layers",
    "resolve_targets",
    "model_structure",
    "rebuild_structure",
    "register_wrapper",
]
