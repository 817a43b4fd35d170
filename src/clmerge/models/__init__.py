"""Backbones, heads and presets.

Layer: above params and adapters (docs/architecture.md).
"""

from . import presets, small_nets, text  # noqa: F401  (register the presets, small networks, text encoders)
from .backbones import VisionBackbone, available_backbones, build_backbone, register_backbone
from .classifier import ContinualClassifier, IncrementalHead

__all__ = [
    "VisionBackbone",
    "available_backbones",
    "build_backbone",
    "register_backbone",
    "ContinualClassifier",
    "IncrementalHead",
]
