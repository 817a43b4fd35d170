"""Backbones, heads and presets."""

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
