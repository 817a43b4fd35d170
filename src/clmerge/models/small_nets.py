"""Small networks trained from scratch (HALRP, Li et al., TKDE 2024, App. F.2).

Registered as ``mlp``, ``lenet``, ``alexnet`` and ``resnet18_reduced``.

Each maps images to a feature vector (the heads stay in :class:`~clmerge.models.classifier.IncrementalHead`) and is
wrapped in a :class:`VisionBackbone` that resizes / adapts channels / normalises the input. Every hidden
conv/linear layer is a plain ``nn.Conv2d`` / ``nn.Linear`` and every normalisation a plain BatchNorm, so methods
can wrap them (HALRP's perturbed layers, per-task BatchNorm) or project their gradients (GPM).

Architectures (HALRP App. F.2, details from the official code lijiaqi/HALRP, ``models/``):
- ``mlp``: flatten -> FC(hidden[0]) -> ReLU -> FC(hidden[1]) -> ReLU (IRU setting: 784-256-256).
- ``lenet``: Conv(3->20, 5x5, pad 2)-BN-ReLU-MaxPool2, Conv(20->50, 5x5, pad 2)-BN-ReLU-MaxPool2,
  FC(3200->800)-BN1d-ReLU, FC(800->500)-BN1d-ReLU; BN tracks running statistics. ``channels: [64, 128]`` and
  ``fc: [2500, 1500]`` give the extended LeNet of Omniglot (the intended version, not the code's buggy one).
- ``alexnet``: Conv(64, 4x4)/Conv(128, 3x3)/Conv(256, 2x2), each BN-ReLU-Dropout(0.2/0.2/0.5)-MaxPool2, then
  FC(2048)-BN-ReLU-Dropout(0.5) twice; BN with ``track_running_stats=False`` (batch statistics at test time).
- ``resnet18_reduced``: ResNet18 with nf = 32 (channels 32/64/128/256), BasicBlocks [2, 2, 2, 2], 3x3 convs with
  bias, 1x1 shortcut convs, BN with ``track_running_stats=False``, then avg_pool(2) and flatten.
Small nets are always built from random init (seeded by the engine); ``model.source`` is not supported.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .backbones import VisionBackbone, register_backbone

__all__ = ["MLPNet", "LeNet", "AlexNetSmall", "ReducedResNet18", "small_backbone"]

CIFAR100_MEAN, CIFAR100_STD = [0.507, 0.487, 0.441], [0.267, 0.256, 0.276]
MNIST_MEAN, MNIST_STD = [0.1307], [0.3081]


class MLPNet(nn.Module):
    """Flatten then ``FC-ReLU`` per hidden size (IRU's 3-layer MLP with the head as third layer)."""

    def __init__(self, in_features: int, hidden: Sequence[int] = (256, 256)) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        prev = in_features
        for h in hidden:
            layers += [nn.Linear(prev, h), nn.ReLU()]
            prev = h
        self.body = nn.Sequential(*layers)
        self.out_features = prev

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # (B, hidden[-1])


def _conv_block(cin: int, cout: int, k: int, *, pad: int, track: bool, drop: float) -> list[nn.Module]:
    block = [nn.Conv2d(cin, cout, k, padding=pad), nn.BatchNorm2d(cout, track_running_stats=track), nn.ReLU()]
    if drop > 0:
        block.append(nn.Dropout(drop))
    return block + [nn.MaxPool2d(2)]


def _fc_block(cin: int, cout: int, *, track: bool, drop: float) -> list[nn.Module]:
    block = [nn.Linear(cin, cout), nn.BatchNorm1d(cout, track_running_stats=track), nn.ReLU()]
    return block + ([nn.Dropout(drop)] if drop > 0 else [])


def _flat_dim(features: nn.Module, channels: int, size: int) -> int:
    with torch.no_grad():
        was = features.training
        features.eval()
        out = features(torch.zeros(2, channels, size, size)).flatten(1).shape[1]
        features.train(was)
    return int(out)


class LeNet(nn.Module):
    """LeNet "20-20-50-800-500" of the HALRP code (conv/BN/ReLU/pool x2, FC/BN/ReLU x2)."""

    def __init__(self, in_channels: int = 3, image_size: int = 32, channels: Sequence[int] = (20, 50),
                 fc: Sequence[int] = (800, 500)) -> None:
        super().__init__()
        convs: list[nn.Module] = []
        prev = in_channels
        for c in channels:
            convs += _conv_block(prev, c, 5, pad=2, track=True, drop=0.0)
            prev = c
        self.features = nn.Sequential(*convs, nn.Flatten())
        prev = _flat_dim(self.features, in_channels, image_size)
        fcs: list[nn.Module] = []
        for h in fc:
            fcs += _fc_block(prev, h, track=True, drop=0.0)
            prev = h
        self.classifier = nn.Sequential(*fcs)
        self.out_features = prev

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))  # (B, fc[-1])


class AlexNetSmall(nn.Module):
    """The GPM/WSN AlexNet of the HALRP code (BN without running statistics, dropout)."""

    def __init__(self, in_channels: int = 3, image_size: int = 32, channels: Sequence[int] = (64, 128, 256),
                 kernels: Sequence[int] = (4, 3, 2), drops: Sequence[float] = (0.2, 0.2, 0.5),
                 fc: Sequence[int] = (2048, 2048), fc_drop: float = 0.5) -> None:
        super().__init__()
        convs: list[nn.Module] = []
        prev = in_channels
        for c, k, d in zip(channels, kernels, drops):
            convs += _conv_block(prev, c, k, pad=0, track=False, drop=d)
            prev = c
        self.features = nn.Sequential(*convs, nn.Flatten())
        prev = _flat_dim(self.features, in_channels, image_size)
        fcs: list[nn.Module] = []
        for h in fc:
            fcs += _fc_block(prev, h, track=False, drop=fc_drop)
            prev = h
        self.classifier = nn.Sequential(*fcs)
        self.out_features = prev

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))  # (B, fc[-1])


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convs with bias; a 1x1 conv shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=True)
        self.bn1 = nn.BatchNorm2d(cout, track_running_stats=False)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=True)
        self.bn2 = nn.BatchNorm2d(cout, track_running_stats=False)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=True),
                                          nn.BatchNorm2d(cout, track_running_stats=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ReducedResNet18(nn.Module):
    """ResNet18 with nf filters (32 in the HALRP/GPM code), blocks [2, 2, 2, 2], avg_pool(2) + flatten."""

    def __init__(self, in_channels: int = 3, image_size: int = 32, nf: int = 32, stem_stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, nf, 3, stride=stem_stride, padding=1, bias=True)
        self.bn1 = nn.BatchNorm2d(nf, track_running_stats=False)
        blocks: list[nn.Module] = []
        prev = nf
        for mult, stride in zip((1, 2, 4, 8), (1, 2, 2, 2)):
            for k in range(2):
                blocks.append(BasicBlock(prev, nf * mult, stride if k == 0 else 1))
                prev = nf * mult
        self.layers = nn.Sequential(*blocks)
        self.out_features = _flat_dim(self, in_channels, image_size) if image_size else prev

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(F.relu(self.bn1(self.conv1(x))))
        return F.avg_pool2d(out, 2).flatten(1)  # (B, 8 nf * (side/16)^2)


def _features(inner: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    return inner(pixels)


def small_backbone(inner: nn.Module, *, name: str, image_size: int, num_channels: int, mean, std) -> VisionBackbone:
    """Wrap a small net in the input adaptation of :class:`VisionBackbone`."""
    if len(mean) != num_channels or len(std) != num_channels:
        raise ValueError(f"model.config: mean/std need {num_channels} values for {num_channels} channels")
    n = sum(p.numel() for p in inner.parameters())
    return VisionBackbone(inner, extract=_features, feature_dim=int(inner.out_features), image_size=image_size,
                          num_channels=num_channels, mean=list(mean), std=list(std),
                          info={"source": "random init", "arch": name, "parameters": n})


def _split_io(config: dict | None, source: str | None, *, size: int, channels: int, mean, std) -> tuple[dict, dict]:
    if source is not None:
        raise ValueError("model.source: the small networks are trained from scratch and load no weights")
    cfg = dict(config or {})
    io = {"image_size": int(cfg.pop("image_size", size)), "num_channels": int(cfg.pop("num_channels", channels))}
    io["mean"] = cfg.pop("mean", mean if io["num_channels"] == len(mean) else mean[:1] * io["num_channels"])
    io["std"] = cfg.pop("std", std if io["num_channels"] == len(std) else std[:1] * io["num_channels"])
    return io, cfg


def _build(name: str, cls, config, source, *, size: int, channels: int, mean, std, flat: bool = False):
    io, arch = _split_io(config, source, size=size, channels=channels, mean=mean, std=std)
    try:
        if flat:
            inner = cls(io["num_channels"] * io["image_size"] ** 2, **arch)
        else:
            inner = cls(in_channels=io["num_channels"], image_size=io["image_size"], **arch)
    except TypeError as exc:
        raise ValueError(f"model.config: bad architecture override for {name!r} ({exc})") from None
    return small_backbone(inner, name=name, **io)


@register_backbone("mlp", "MLP 784-256-256 from scratch (IRU/HALRP P-MNIST setting); config: hidden, image_size")
def mlp(*, pretrained: bool = False, source: str | None = None, config: dict | None = None) -> VisionBackbone:
    return _build("mlp", MLPNet, config, source, size=28, channels=1, mean=MNIST_MEAN, std=MNIST_STD, flat=True)


@register_backbone("lenet", "LeNet 20-50-800-500 with BN from scratch (HALRP CIFAR100 / P-MNIST); 32x32x3")
def lenet(*, pretrained: bool = False, source: str | None = None, config: dict | None = None) -> VisionBackbone:
    return _build("lenet", LeNet, config, source, size=32, channels=3, mean=CIFAR100_MEAN, std=CIFAR100_STD)


@register_backbone("alexnet", "GPM/WSN AlexNet (3 conv + 2 FC, BN without running stats) from scratch; 32x32x3")
def alexnet(*, pretrained: bool = False, source: str | None = None, config: dict | None = None) -> VisionBackbone:
    return _build("alexnet", AlexNetSmall, config, source, size=32, channels=3, mean=CIFAR100_MEAN, std=CIFAR100_STD)


@register_backbone("resnet18_reduced", "ResNet18 with nf=32 (GPM/HALRP), BN without running stats; 32x32x3")
def resnet18_reduced(*, pretrained: bool = False, source: str | None = None,
                     config: dict | None = None) -> VisionBackbone:
    return _build("resnet18_reduced", ReducedResNet18, config, source, size=32, channels=3, mean=CIFAR100_MEAN,
                  std=CIFAR100_STD)
