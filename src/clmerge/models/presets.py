"""Registered backbone presets.

- ``vit-tiny-fmnist``: the shipped small ViT (28x28, patch 4, 6 layers, ~1M parameters) pretrained on
  Fashion-MNIST by ``clmerge pretrain --preset vit-tiny-fmnist``; weights ship in ``clmerge/assets``.
- ``vit-b16``: ViT-B/16 at 224x224 (``google/vit-base-patch16-224`` by default; the in21k checkpoint
  ``google/vit-base-patch16-224-in21k`` via ``model.source``); ``model.pretrained: false`` builds it from its
  config with random init (dry runs).
- ``hf-vit`` / ``hf-clip-vision``: any HF ViT / CLIP vision tower from ``model.source`` (a directory or hub id).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from ..utils.io import load_tensors, read_json
from .backbones import (VisionBackbone, hf_vision_from_config, hf_vision_from_pretrained, hf_vit_backbone,
                        register_backbone)

__all__ = ["VIT_TINY_FMNIST", "tiny_vit_config", "asset_dir"]

# Architecture of the shipped small ViT. Fashion-MNIST statistics are the normalisation it was trained with.
VIT_TINY_FMNIST = dict(
    image_size=28,
    patch_size=4,
    num_channels=1,
    hidden_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    intermediate_size=384,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
FMNIST_MEAN, FMNIST_STD = [0.2860], [0.3530]
IMAGENET_HALF = ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
VIT_B16 = dict(image_size=224, patch_size=16, num_channels=3, hidden_size=768, num_hidden_layers=12,
               num_attention_heads=12, intermediate_size=3072)


def asset_dir(name: str) -> Path:
    return Path(str(resources.files("clmerge") / "assets" / name))


def tiny_vit_config(**overrides):
    from transformers import ViTConfig

    return ViTConfig(**{**VIT_TINY_FMNIST, **overrides})


@register_backbone("vit-tiny-fmnist", "small HF ViT (28x28, 6 layers, ~1M params) pretrained on Fashion-MNIST; ships with clmerge")
def vit_tiny_fmnist(*, pretrained: bool = True, source: str | None = None, config: dict | None = None,
                    **_) -> VisionBackbone:
    weights = None
    info = {"preset": "vit-tiny-fmnist"}
    if config and pretrained:
        raise ValueError("model.config: architecture overrides need model.pretrained: false (the weights fix it)")
    if pretrained:
        d = Path(source) if source else asset_dir("vit_tiny_fmnist")
        wfile = d / "model.safetensors"
        if not wfile.exists():
            raise FileNotFoundError(
                f"vit-tiny-fmnist: weights not found at {wfile}\nfix: `clmerge pretrain --out DIR` (needs the Debian "
                "package dataset-fashion-mnist) then set model.source=DIR, or set model.pretrained=false"
            )
        weights = load_tensors(wfile)
        info["weights"] = str(wfile)
        prov = d / "provenance.json"
        if prov.exists():
            info["sha256"] = read_json(prov).get("sha256")
    return hf_vit_backbone(tiny_vit_config(**(config or {})), weights=weights, info=info, mean=FMNIST_MEAN,
                           std=FMNIST_STD)


@register_backbone("vit-b16", "ViT-B/16, 224x224 (HF google/vit-base-patch16-224, or model.source); random init with pretrained: false")
def vit_b16(*, pretrained: bool = True, source: str | None = None, config: dict | None = None, **_) -> VisionBackbone:
    mean, std = IMAGENET_HALF
    if not pretrained:
        return hf_vision_from_config("vit", {**VIT_B16, **(config or {})}, mean=mean, std=std)
    return hf_vision_from_pretrained("vit", source or "google/vit-base-patch16-224", mean=mean, std=std)


@register_backbone("hf-vit", "any HF ViTModel from model.source (directory or hub id); from model.config with pretrained: false")
def hf_vit(*, pretrained: bool = True, source: str | None = None, config: dict | None = None,
           mean: list[float] | None = None, std: list[float] | None = None, **_) -> VisionBackbone:
    mean, std = mean or IMAGENET_HALF[0], std or IMAGENET_HALF[1]
    if not pretrained:
        return hf_vision_from_config("vit", config or {}, mean=mean, std=std)
    if not source:
        raise ValueError("model.source: hf-vit needs a directory or hub id")
    return hf_vision_from_pretrained("vit", source, mean=mean, std=std)


@register_backbone("hf-clip-vision", "HF CLIP vision tower from model.source (directory or hub id); from model.config with pretrained: false")
def hf_clip_vision(*, pretrained: bool = True, source: str | None = None, config: dict | None = None,
                   mean: list[float] | None = None, std: list[float] | None = None, **_) -> VisionBackbone:
    mean = mean or [0.48145466, 0.4578275, 0.40821073]
    std = std or [0.26862954, 0.26130258, 0.27577711]
    if not pretrained:
        return hf_vision_from_config("clip", config or {}, mean=mean, std=std)
    if not source:
        raise ValueError("model.source: hf-clip-vision needs a directory or hub id")
    return hf_vision_from_pretrained("clip", source, mean=mean, std=std)
