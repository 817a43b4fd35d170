"""FusionBench's plain-torch merge functions, loaded at run time from a checkout outside this repository.

Nothing from FusionBench is copied here: :func:`load_fusion_bench` imports four of its files
(``utils/type.py``, ``utils/state_dict_arithmetic.py``, ``method/ties_merging/ties_merging_utils.py``,
``method/dare/utils.py``) straight from ``PATH/fusion_bench/...`` under stub parent packages, so its heavy
package ``__init__`` files (hydra, lightning, transformers models) are never executed. The ``fb_*``
functions below call those functions in the order FusionBench's algorithm classes do
(``SimpleAverageAlgorithm``/``simple_average``, ``TaskArithmeticAlgorithm.run``, ``TiesMergingAlgorithm.run``,
``DareTaskArithmetic.run``), minus model loading and ``load_state_dict``.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

FILES = {
    "fusion_bench.utils.type": "fusion_bench/utils/type.py",
    "fusion_bench.utils.state_dict_arithmetic": "fusion_bench/utils/state_dict_arithmetic.py",
    "fusion_bench.method.ties_merging.ties_merging_utils": "fusion_bench/method/ties_merging/ties_merging_utils.py",
    "fusion_bench.method.dare.utils": "fusion_bench/method/dare/utils.py",
}
# the SVD merges (TSV-M and Iso-C/CTS; FusionBench has no CART); ``timer.py`` for iso_utils' timeit_context
SVD_FILES = {
    "fusion_bench.utils.type": "fusion_bench/utils/type.py",
    "fusion_bench.utils.timer": "fusion_bench/utils/timer.py",
    "fusion_bench.utils.state_dict_arithmetic": "fusion_bench/utils/state_dict_arithmetic.py",
    "fusion_bench.method.task_singular_vector.utils.TSVM_utils":
        "fusion_bench/method/task_singular_vector/utils/TSVM_utils.py",
    "fusion_bench.method.isotropic_merging.iso_utils": "fusion_bench/method/isotropic_merging/iso_utils.py",
}
SD = dict[str, Tensor]


def load_fusion_bench(root: str | Path, files: dict[str, str] = FILES) -> types.SimpleNamespace:
    """Import FusionBench's ``files`` (default: state-dict arithmetic, TIES, DARE) from the checkout ``root``.

    Raises:
        FileNotFoundError: a needed file is missing under ``root``.
    """
    root = Path(root)
    parents = {".".join(n.split(".")[:i]) for n in files for i in range(1, n.count(".") + 1)}
    for name in sorted(parents):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(root / name.replace(".", "/"))]  # stub package: its __init__ is not run
            sys.modules[name] = pkg
    mods = {}
    for name, rel in files.items():
        path = root / rel
        if not path.exists():
            raise FileNotFoundError(f"FusionBench file not found: {path}")
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        mods[name.rsplit(".", 1)[-1]] = mod
        if name == "fusion_bench.utils.timer":  # what ``from fusion_bench.utils import timeit_context`` finds
            sys.modules["fusion_bench.utils"].timeit_context = mod.timeit_context
    return types.SimpleNamespace(**mods)


def fb_average(fb: Any, base: SD, experts: list[SD], **_: Any) -> SD:
    """``SimpleAverageAlgorithm.run``: running ``state_dict_add`` over the models, then ``state_dict_div``."""
    sda = fb.state_dict_arithmetic
    sd, n = None, 0
    for model in experts:
        sd = model if sd is None else sda.state_dict_add(sd, model)
        n += 1
    return sda.state_dict_div(sd, n)


def fb_task_arithmetic(fb: Any, base: SD, experts: list[SD], scaling: float = 0.3, **_: Any) -> SD:
    """``TaskArithmeticAlgorithm.run``: running sum of ``state_dict_sub``, then ``mul`` and ``add``."""
    sda = fb.state_dict_arithmetic
    tv = None
    for sd in experts:
        diff = sda.state_dict_sub(sd, base)
        tv = diff if tv is None else sda.state_dict_add(tv, diff)
    tv = sda.state_dict_mul(tv, scaling, keep_dtype_when_zero=True)
    return sda.state_dict_add(base, tv)


def fb_ties(fb: Any, base: SD, experts: list[SD], density: float = 0.2, scaling: float = 1.0,
            merge_fn: str = "mean", **_: Any) -> SD:
    """``TiesMergingAlgorithm.run``: flatten every model, ``ties_merging`` on the N x d stack, unflatten."""
    tu = fb.ties_merging_utils
    flat_ft = torch.vstack([tu.state_dict_to_vector(sd, []) for sd in experts])
    flat_ptm = tu.state_dict_to_vector(base, [])
    tv_flat = flat_ft - flat_ptm
    merged_tv = tu.ties_merging(tv_flat, reset_thresh=density, merge_func=merge_fn)
    merged = flat_ptm + scaling * merged_tv
    return dict(tu.vector_to_state_dict(merged, base, remove_keys=[]))


def fb_dare(fb: Any, base: SD, experts: list[SD], drop_rate: float = 0.5, scaling: float = 0.3,
            rescale: bool = True, **_: Any) -> SD:
    """``DareTaskArithmetic.run`` (all tensors dropped): task vectors, ``module_random_drop_``, sum, add.

    Task vectors come from ``state_dict_sub`` (``module_sub_`` would subtract in place, from the inputs).
    """
    sda = fb.state_dict_arithmetic
    tvs = [sda.state_dict_sub(sd, base) for sd in experts]
    for tv in tvs:
        fb.utils.module_random_drop_(tv, drop_rate, rescale=rescale)
    total = sda.state_dict_sum(tvs)
    return {k: base[k] + total[k] * scaling for k in base}


FB_METHODS = {"weight_average": fb_average, "task_arithmetic": fb_task_arithmetic, "ties": fb_ties,
              "dare": fb_dare}
