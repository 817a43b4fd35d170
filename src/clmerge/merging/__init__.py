"""Model merging: pure functions over parameter dicts, one file per method, one registry.

```python
from clmerge import merging
merged = merging.merge("ties", base=pretrained, experts=[sd_a, sd_b], density=0.2, scaling=1.0)
merging.available()  # {name: one-line description}
```
Experts (and the base) may be ``dict[str, Tensor]`` or paths to safetensors files (read lazily, key by key)
or ``.bin``/``.pt`` files (``torch.load(weights_only=True)``).

Layer: above report and data; ``merging/io`` is its checkpoint I/O. Imports no method, engine or command (docs/architecture.md).
"""

from .registry import MERGES, available, get_method, merge, register_merge  # noqa: I001
from .io import MergeInputError, ParamSource
from .sources import ModelSet

# Each import registers its method(s); the order is the order of ``available()`` ties (sorted anyway).
from .averaging import weight_average
from .task_arithmetic import task_arithmetic
from .low_rank_ta import low_rank_task_arithmetic
from .ties import ties
from .dare import dare
from .consensus import consensus, tall_masks
from .tall_ties import tall_mask_ties
from .emr import emr_merging
from .fisher import fisher_merging
from .regmean import gram_matrices, regmean
from .cart import cart, cart_indexing
from .adamerging import adamerging
from .slerp import slerp
from .model_stock import model_stock
from .breadcrumbs import breadcrumbs, breadcrumbs_ties
from .della import della, della_linear
from .magmax import magmax
# the SVD family: task singular vectors and isotropic merging
from .tsv import tsv_c, tsv_m
from .iso import iso_c, iso_cts
from .knots import knots
from .wudi import wudi
from .spherical import karcher, multislerp, nuslerp
from .sce import sce
from .nearswap import nearswap
from .arcee_fusion import arcee_fusion
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
