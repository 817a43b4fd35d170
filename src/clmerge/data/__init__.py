"""Data sources (bundled and on-disk) and scenarios."""

from . import bundled  # noqa: F401  (registers mnist5k, digits, fashion_mnist, mnist1d)
from .base import (
    DATASETS,
    ClassificationData,
    DataSplits,
    FileListData,
    TensorData,
    available_datasets,
    build_dataset,
    register_dataset,
)
from .scenarios import PixelPermutation, Rotation, Scenario, Task, TaskData, build_scenario

from . import cifar, folders  # noqa: F401,E402  (on-disk layouts: folders, CIFAR-100, ImageNet-R/A, DomainNet, CUB)
from . import combined  # noqa: F401,E402  (mnist5k_fmnist20)

__all__ = [
    "DATASETS",
    "ClassificationData",
    "DataSplits",
    "FileListData",
    "TensorData",
    "available_datasets",
    "build_dataset",
    "register_dataset",
    "PixelPermutation",
    "Rotation",
    "Scenario",
    "Task",
    "TaskData",
    "build_scenario",
]
