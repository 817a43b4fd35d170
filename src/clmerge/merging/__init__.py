"""Model merging: pure functions over parameter dicts (``merging.methods``: the kernels and their one registry),
the recipe runner, and checkpoint I/O (``merging.io``).

```python
from clmerge import merging
merged = merging.merge("ties", base=pretrained, experts=[sd_a, sd_b], density=0.2, scaling=1.0)
merging.available()  # {name: one-line description}
```
Experts (and the base) may be ``dict[str, Tensor]`` or paths to safetensors files (read lazily, key by key)
or ``.bin``/``.pt`` files (``torch.load(weights_only=True)``).

Layer: above report and data; ``merging/io`` is its checkpoint I/O. Imports no method, engine or command (docs/architecture.md).
"""

# importing .methods registers every built-in method
from .methods import (  # noqa: F401
    MERGES, available, get_method, merge, register_merge, MergeInputError, ModelSet, ParamSource,
    weight_average, task_arithmetic, low_rank_task_arithmetic, ties, dare, consensus, tall_masks, tall_mask_ties,
    emr_merging, fisher_merging, regmean, gram_matrices, cart, cart_indexing, adamerging, slerp,
    model_stock, breadcrumbs, della, magmax, tsv_m, tsv_c, iso_c, iso_cts,
    knots, wudi, breadcrumbs_ties, della_linear, nuslerp, multislerp, karcher, sce,
    nearswap, arcee_fusion, opcm, dop,
)

__all__ = [
    "MERGES", "available", "get_method", "merge", "register_merge", "MergeInputError", "ModelSet", "ParamSource",
    "weight_average", "task_arithmetic", "low_rank_task_arithmetic", "ties", "dare", "consensus", "tall_masks",
    "tall_mask_ties", "emr_merging", "fisher_merging", "regmean", "gram_matrices", "cart", "cart_indexing", "adamerging",
    "slerp", "model_stock", "breadcrumbs", "della", "magmax",
    "tsv_m", "tsv_c", "iso_c", "iso_cts", "knots", "wudi",
    "breadcrumbs_ties", "della_linear", "nuslerp", "multislerp", "karcher", "sce", "nearswap", "arcee_fusion",
    "opcm", "dop",
]
