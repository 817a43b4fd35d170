"""Data sources (bundled and on-disk) and scenarios.

Layer: above models (a text source uses its backbone's tokenizer); below report and merging (docs/architecture.md).
"""

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

from . import cifar, cub, domainnet, folders, imagenet  # noqa: F401,E402  (on-disk layouts)
from . import mixed  # noqa: F401,E402  (multi-source task sequences, Five-dataset style)
from . import omniglot, tinyimagenet  # noqa: F401,E402  (Omniglot-Rotation, Tiny ImageNet release layouts)
from . import combined  # noqa: F401,E402  (mnist5k_fmnist20: 20 classes over MNIST-5k and Fashion-MNIST)
from . import text_wordnet  # noqa: F401,E402  (wordnet_supersense: tokenised WordNet glosses for text backbones)

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
