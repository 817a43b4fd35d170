"""The merge methods: kernels, their shared math and their one registry.

A merge method is a pure function ``fn(*, base, experts, **hyperparameters) -> dict[str, Tensor]`` registered
with :func:`~.registry.register_merge`; importing this package registers every built-in one. What lives here:

- the registry (``registry.py``) and the hyperparameter check (``hparams.py``);
- the key driver (``driver.py``: one kernel call per key, streaming, chunking, the device) and the inputs
  (``sources.py``: a base and experts read key by key);
- shared math, registering nothing: trimming (``trim.py``, ``ties_kernels.py``), the TIES engine (``ties.py``),
  DARE's random drop (``dare.py``), low rank and the one randomized SVD (``lowrank.py``), the expert order of
  continual merges (``order.py``) and task-vector analysis (``analysis.py``);
- one file per method or family of methods: ``sparse_family.py`` holds the sparsification family (TIES, DARE,
  DELLA, Model Breadcrumbs and their variants) as rows of one kernel, ``spherical.py`` the spherical merges,
  ``base_and_expert.py`` the merges of a base and one expert; the SVD merges (``tsv.py``, ``iso.py``,
  ``cart.py``, ``knots.py``, ``low_rank_ta.py``) are thin over ``lowrank.py``. No method file imports another.

A new per-element method is one function plus one registration (docs/extending.md).
"""

from .registry import MERGES, available, get_method, merge, register_merge  # noqa: I001
from ..io import MergeInputError, ParamSource
from .sources import ModelSet

# Each import registers its method(s); the order is the order of ``available()`` ties (sorted anyway).
from .averaging import weight_average
from .task_arithmetic import task_arithmetic
from .low_rank_ta import low_rank_task_arithmetic
# the sparsification family (ties, dare, della, breadcrumbs and their variants): one kernel, a row each
from .sparse_family import breadcrumbs, breadcrumbs_ties, dare, della, della_linear, ties
from .consensus import consensus, tall_mask_ties, tall_masks
from .emr import emr_merging
from .fisher import fisher_merging
from .regmean import gram_matrices, regmean
from .cart import cart, cart_indexing
from .adamerging import adamerging
from .model_stock import model_stock
from .magmax import magmax
# the SVD family: task singular vectors and isotropic merging
from .tsv import tsv_c, tsv_m
from .iso import iso_c, iso_cts
from .knots import knots
from .wudi import wudi
from .spherical import karcher, multislerp, nuslerp, slerp
from .sce import sce
from .base_and_expert import arcee_fusion, nearswap
# continual merges over an ordered expert list
from .opcm import opcm
from .dop import dop

__all__ = [
    "MERGES", "available", "get_method", "merge", "register_merge", "MergeInputError", "ModelSet", "ParamSource",
    "weight_average", "task_arithmetic", "low_rank_task_arithmetic", "ties", "dare", "consensus", "tall_masks",
    "tall_mask_ties", "emr_merging", "fisher_merging", "regmean", "gram_matrices", "cart", "cart_indexing", "adamerging",
    "slerp", "model_stock", "breadcrumbs", "della", "magmax",
    "tsv_m", "tsv_c", "iso_c", "iso_cts", "knots", "wudi",
    "breadcrumbs_ties", "della_linear", "nuslerp", "multislerp", "karcher", "sce", "nearswap", "arcee_fusion",
    "opcm", "dop",
]
