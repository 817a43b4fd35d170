"""The table of layer-wrapper classes that :mod:`.structure` can re-create on a resumed model.

A module defining a wrapper (LoRA layers, HALRP's perturbed layers, per-task BatchNorm / copies) registers it
here when it is imported; this module imports nothing of clmerge, so the arrows run one way.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["WRAPPERS", "register_wrapper"]

# class name -> (class, function that wraps a freshly built base module)
WRAPPERS: dict[str, tuple[type, Callable[[nn.Module], nn.Module]]] = {}


def register_wrapper(cls: type, wrap: Callable[[nn.Module], nn.Module]) -> None:
    """Let :func:`~clmerge.adapters.structure.rebuild_structure` wrap a base module into ``cls`` by ``wrap``."""
    WRAPPERS[cls.__name__] = (cls, wrap)
