"""Backbones, heads and presets."""

from . import presets  # noqa: F401  (registers the presets)
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
