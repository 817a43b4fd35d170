"""Backbones, heads and presets."""

from . import presets, small_nets  # noqa: F401  (register the presets and the small networks)
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
