"""Save and rebuild a model's *structure* (which layers are wrapped, which components and head blocks exist).

A checkpoint holds tensors; to load them after a restart, the model must first have the same modules. Every
module that changes shape during a run implements ``get_structure() -> dict`` and ``set_structure(dict)``;
wrapper classes that replace a layer register in :mod:`.wrappers` (when their module is imported, i.e. with the
method that uses them) so they can be re-created around the original layer.
"""

from __future__ import annotations

import torch
from torch import nn

from .lora import LoRALinear
from .wrappers import WRAPPERS, register_wrapper

__all__ = ["register_wrapper", "model_structure", "rebuild_structure", "WRAPPERS"]

register_wrapper(LoRALinear, LoRALinear)


def model_structure(model: nn.Module) -> dict:
    """JSON-able description of wrappers, per-module structures and shared magnitudes."""
    wrapped = {n: type(m).__name__ for n, m in model.named_modules() if type(m).__name__ in WRAPPERS}
    modules = {n: m.get_structure() for n, m in model.named_modules() if hasattr(m, "get_structure") and n}
    mags = getattr(model, "lora_magnitudes", None)
    magnitudes = {k: list(v.shape) for k, v in mags.items()} if mags is not None else {}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    return {"wrapped": wrapped, "modules": modules, "magnitudes": magnitudes, "trainable": trainable}


def rebuild_structure(model: nn.Module, structure: dict) -> None:
    """Make ``model`` (freshly built) match ``structure`` so a state dict saved with it loads strictly."""
    mags = getattr(model, "lora_magnitudes", None)
    if structure.get("magnitudes") and mags is None:
        raise ValueError("checkpoint has shared magnitudes but the model has no lora_magnitudes")
    for key, shape in structure.get("magnitudes", {}).items():
        if key not in mags:
            mags[key] = nn.Parameter(torch.zeros(shape))
    for name, cls_name in structure.get("wrapped", {}).items():
        if cls_name not in WRAPPERS:
            raise ValueError(f"checkpoint needs wrapper {cls_name!r} at {name!r}, which is not registered "
                             "(import the method that uses it, e.g. `import clmerge.methods`)")
        current = model.get_submodule(name)
        if type(current).__name__ == cls_name:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        _, wrap = WRAPPERS[cls_name]
        setattr(parent, child, wrap(current))
    for name, struct in structure.get("modules", {}).items():
        model.get_submodule(name).set_structure(struct)
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.attach_magnitudes(mags)
    if "trainable" in structure:  # requires_grad flags are not part of a state dict
        trainable = set(structure["trainable"])
        for n, p in model.named_parameters():
            p.requires_grad_(n in trainable)
