"""HALRP (Li et al., TKDE 2024), everything it alone uses: the method, its options, its perturbed layers and
the closed forms of low-rank perturbation. ``from clmerge.methods.halrp import HALRP, HALRPOptions`` works."""

from . import low_rank_perturbation
from .layers import HALRPConv2d, HALRPLayer, HALRPLinear, TaskFactors, halrp_layers, wrap_halrp_layers
from .method import HALRP, official_growth, task_parameter_count
from .options import HALRPOptions

__all__ = [
    "HALRP",
    "HALRPOptions",
    "official_growth",
    "task_parameter_count",
    "HALRPLayer",
    "HALRPLinear",
    "HALRPConv2d",
    "TaskFactors",
    "halrp_layers",
    "wrap_halrp_layers",
    "low_rank_perturbation",
]
