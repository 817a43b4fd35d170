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


def _hf_vision_load(kind: str, source: str, local_files_only: bool) -> nn.Module:
    if kind == "vit":
        from transformers import ViTModel

        return ViTModel.from_pretrained(source, add_pooling_layer=False, local_files_only=local_files_only)
    from transformers import CLIPVisionModel

    return CLIPVisionModel.from_pretrained(source, local_files_only=local_files_only)


def _weights_not_found(source: str, offline: bool, err: OSError) -> Exception:
    """The input error for weights that cannot be loaded from ``model.source`` (a folder or a hub id)."""
    from ..errors import InputError, clip

    where = ("a folder without config.json and weights" if Path(source).exists()
             else "not a folder, and not in the hub cache" + (" (HF_HUB_OFFLINE=1)" if offline else ""))
    return InputError(f"model.source={clip(source, 80)}: cannot load the pretrained weights ({where}: "
                      f"{clip(type(err).__name__, 40)})\nfix: download the hub id once with network access, or set "
                      "model.source to a local folder holding the HF model (config.json + model.safetensors)")


def hf_vision_from_pretrained(
    kind: str, source: str, *, mean: list[float], std: list[float], local_files_only: bool | None = None
) -> VisionBackbone:
    """Load an HF ViT (``kind='vit'``) or CLIP vision tower (``kind='clip'``) from a directory or a hub id.

    With no network (``HF_HUB_OFFLINE=1``), a hub id that is not cached, or a folder without the files, is an
    :class:`~clmerge.errors.InputError` naming ``model.source`` (exit code 3), not the library's traceback.
    """
    import os

    if local_files_only is None:
        local_files_only = os.environ.get("HF_HUB_OFFLINE") == "1" or Path(source).exists()
    if kind not in ("vit", "clip"):
        raise ValueError(f"unknown HF vision kind {kind!r} (expected 'vit' or 'clip')")
    try:
        inner = _hf_vision_load(kind, source, local_files_only)
    except OSError as e:
        raise _weights_not_found(source, local_files_only, e) from None
    extract = _hf_cls_features if kind == "vit" else _clip_pooled_features
    dim = inner.config.hidden_size
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
