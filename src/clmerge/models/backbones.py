"""Backbones: image batches in [0, 1] -> feature vectors.

A backbone owns its input adaptation (resize, channel count, normalisation) as buffers, so data sources can
stay raw and the same dataset feeds a 28x28 one-channel ViT or a 224x224 three-channel one.
Backbones are registered by name with :func:`register_backbone`; each entry is a small function that calls
one builder (timm-style presets).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import Registry

__all__ = [
    "VisionBackbone",
    "register_backbone",
    "build_backbone",
    "available_backbones",
    "BACKBONES",
    "hf_vit_backbone",
    "BackboneEntry",
]

class BackboneEntry(NamedTuple):
    """A registered backbone: its builder and one-line description (indexable as ``(fn, description)``)."""

    fn: Callable[..., "VisionBackbone"]
    description: str


BACKBONES: Registry = Registry("backbone", key="model.name")  # name -> BackboneEntry


def register_backbone(name: str, description: str) -> Callable:
    """Register a backbone builder ``fn(**kwargs) -> VisionBackbone`` under ``name``."""

    def deco(fn: Callable[..., "VisionBackbone"]) -> Callable[..., "VisionBackbone"]:
        BACKBONES.register(name, BackboneEntry(fn, description), description=description, module=fn.__module__)
        return fn

    return deco


def available_backbones() -> dict[str, str]:
    return BACKBONES.available()


def build_backbone(name: str, **kwargs) -> "VisionBackbone":
    return BACKBONES.get(name).fn(**kwargs)


class VisionBackbone(nn.Module):
    """Adapts raw images to an inner feature extractor and returns one feature vector per image.

    Args:
        inner: module mapping preprocessed pixels ``(B, C, H, W)`` to features ``(B, D)`` via ``extract``.
        extract: function ``(inner, pixels) -> (B, D)`` features.
        feature_dim: D.
        image_size: side the inner model expects (inputs of another size are resized bilinearly).
        num_channels: channels the inner model expects (1 <-> 3 adapted by repeat / mean).
        mean, std: per-channel normalisation applied after resizing.
    """

    def __init__(
        self,
        inner: nn.Module,
        *,
        extract: Callable[[nn.Module, torch.Tensor], torch.Tensor],
        feature_dim: int,
        image_size: int | None,
        num_channels: int,
        mean: list[float],
        std: list[float],
        info: dict | None = None,
    ) -> None:
        super().__init__()
        self.inner = inner
        self._extract = extract
        self.feature_dim = feature_dim
        self.image_size = image_size
        self.num_channels = num_channels
        mean, std = _per_channel(mean, num_channels), _per_channel(std, num_channels)
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)
        self.info = dict(info or {})

    def preprocess(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(f"backbone expects images (B, C, H, W), got shape {tuple(x.shape)}")
        c = x.shape[1]
        if c != self.num_channels:
            if c == 1:
                x = x.expand(-1, self.num_channels, -1, -1)
            elif self.num_channels == 1:
                x = x.mean(dim=1, keepdim=True)
            else:
                raise ValueError(f"cannot adapt {c} input channels to {self.num_channels}")
        if self.image_size is not None and (x.shape[-1] != self.image_size or x.shape[-2] != self.image_size):
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False)
        return (x - self.mean) / self.std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._extract(self.inner, self.preprocess(x))  # (B, D)


def _per_channel(values: list[float], channels: int) -> list[float]:
    """Normalisation statistics for ``channels`` channels (a single value is repeated, RGB averaged to gray)."""
    if len(values) == channels:
        return list(values)
    if len(values) == 1:
        return list(values) * channels
    if channels == 1:
        return [sum(values) / len(values)]
    raise ValueError(f"{len(values)} normalisation values for a {channels}-channel model")


def _hf_cls_features(inner: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    out = inner(pixel_values=pixels)
    return out.last_hidden_state[:, 0]  # ViTModel applies the final LayerNorm to the whole sequence


def _clip_pooled_features(inner: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    return inner(pixel_values=pixels).pooler_output  # CLS token after post_layernorm


def hf_vit_backbone(config, *, weights: dict | None, info: dict, mean, std) -> VisionBackbone:
    """An HF ``ViTModel`` built from ``config`` (weights loaded if given), its CLS token as the feature."""
    from transformers import ViTModel

    inner = ViTModel(config, add_pooling_layer=False)
    if weights is not None:
        from .checkpoint_keys import load_vit_weights

        load_vit_weights(inner, weights, source=info.get("weights", "?"))
    inner.eval()
    return VisionBackbone(
        inner,
        extract=_hf_cls_features,
        feature_dim=config.hidden_size,
        image_size=config.image_size,
        num_channels=config.num_channels,
        mean=mean,
        std=std,
        info=info,
    )


def hf_vision_from_pretrained(
    kind: str, source: str, *, mean: list[float], std: list[float], local_files_only: bool | None = None
) -> VisionBackbone:
    """Load an HF ViT (``kind='vit'``) or CLIP vision tower (``kind='clip'``) from a directory or a hub id.

    With no network (``HF_HUB_OFFLINE=1``), a hub id that is not cached fails with the library's error.
    """
    import os

    if local_files_only is None:
        local_files_only = os.environ.get("HF_HUB_OFFLINE") == "1" or Path(source).exists()
    if kind == "vit":
        from transformers import ViTModel

        inner = ViTModel.from_pretrained(source, add_pooling_layer=False, local_files_only=local_files_only)
        extract, dim = _hf_cls_features, inner.config.hidden_size
    elif kind == "clip":
        from transformers import CLIPVisionModel

        inner = CLIPVisionModel.from_pretrained(source, local_files_only=local_files_only)
        extract, dim = _clip_pooled_features, inner.config.hidden_size
    else:
        raise ValueError(f"unknown HF vision kind {kind!r} (expected 'vit' or 'clip')")
    inner.eval()
    cfg = inner.config
    return VisionBackbone(
        inner,
        extract=extract,
        feature_dim=dim,
        image_size=cfg.image_size,
        num_channels=cfg.num_channels,
        mean=mean,
        std=std,
        info={"source": source, "kind": kind},
    )


def hf_vision_from_config(kind: str, config_kwargs: dict, *, mean, std) -> VisionBackbone:
    """Build an HF ViT / CLIP vision tower from config values with random init (dry runs, tests)."""
    if kind == "vit":
        from transformers import ViTConfig

        return hf_vit_backbone(ViTConfig(**config_kwargs), weights=None, info={"source": "config"}, mean=mean, std=std)
    if kind == "clip":
        from transformers import CLIPVisionConfig, CLIPVisionModel

        cfg = CLIPVisionConfig(**config_kwargs)
        inner = CLIPVisionModel(cfg).eval()
        return VisionBackbone(
            inner,
            extract=_clip_pooled_features,
            feature_dim=cfg.hidden_size,
            image_size=cfg.image_size,
            num_channels=cfg.num_channels,
            mean=mean,
            std=std,
            info={"source": "config", "kind": "clip"},
        )
    raise ValueError(f"unknown HF vision kind {kind!r}")
