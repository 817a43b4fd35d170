"""Checks on what a merge reads and writes: supported dtypes, keys a source lists but cannot give, and
outputs that came out NaN or Inf. Each failure is one line naming the file, the key and what was expected."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ...utils.dtypes import ST_DTYPES
from .base import MergeInputError

__all__ = ["SUPPORTED_DTYPES", "check_dtype", "source_meta", "source_get", "is_finite", "check_finite_output",
           "check_output_finite"]

SUPPORTED_DTYPES = frozenset(ST_DTYPES.values())
_EXPECTED = "F64, F32, F16 or BF16 (integer and bool buffers are copied)"


def check_dtype(src: Any, key: str, dtype: Any) -> None:
    """Refuse a tensor whose dtype clmerge does not merge (float8, float4, complex, ...).

    float8 checkpoints are refused rather than upcast: their values usually come with per-tensor scales
    stored under other keys (``weight_scale``), so merging the raw values would be wrong without a word.
    """
    if dtype not in SUPPORTED_DTYPES:
        name = str(dtype).removeprefix("torch.")
        raise MergeInputError(f"{src.name}: key {key!r} has dtype {name}, which clmerge does not merge; expected "
                              f"{_EXPECTED}: convert the checkpoint (e.g. to bfloat16) first")


def source_meta(src: Any, key: str) -> tuple[tuple[int, ...], torch.dtype]:
    """``src.meta(key)``, with a key the source lists but cannot find reported by file and key."""
    try:
        return src.meta(key)
    except KeyError:
        raise MergeInputError(_listed_but_missing(src, key)) from None


def source_get(src: Any, key: str) -> Tensor:
    """``src.get(key)``, with a key the source lists but cannot find reported by file and key."""
    try:
        return src.get(key)
    except KeyError:
        raise MergeInputError(_listed_but_missing(src, key)) from None


def _listed_but_missing(src: Any, key: str) -> str:
    return (f"{src.name}: key {key!r} is listed (e.g. in its shard index) but no weights file there holds it; "
            "expected every listed key in the file the index names")


def is_finite(tensor: Tensor) -> bool:
    """Whether a tensor is free of NaN and Inf (non-floating tensors are); one read when it is."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    # a sum is finite only if every entry is (one read, no mask); a non-finite sum may be an overflow
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def check_finite_output(bad: Sequence[str], what: str = "the merged model", written: bool = False) -> None:
    """Refuse an output whose tensors ``bad`` hold NaN or Inf: one line naming them (``written``: the writer's
    case, which says that nothing was written).

    The inputs were checked finite as they were read (``ModelSet(check_finite=True)``), so a non-finite output
    comes from the method (e.g. WUDI's squares overflowing float32), its hyperparameters or the output dtype
    (float16 overflows above 65504).
    """
    if bad:
        shown = ", ".join(repr(k) for k in list(bad)[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise MergeInputError(f"{what}: {len(bad)} merged tensor{'s' if len(bad) > 1 else ''} came out NaN or Inf "
                              f"({shown}) from finite inputs; expected finite values: check the hyperparameters "
                              "(scaling, steps, lr, weights), the input scale (float32 overflows above 3.4e38, "
                              "e.g. in squares of large task vectors) and the output dtype (float16 overflows "
                              "above 65504)" + ("; nothing was written" if written else ""))


def check_output_finite(name: str, out: Mapping[str, Tensor]) -> None:
    """The Python API's check of a merge result ``{key: tensor}`` of method ``name`` (:func:`check_finite_output`;
    the CLI's writer checks every tensor it writes the same way). Cost: one sum per tensor (:func:`is_finite`: a
    mask only when the sum is not finite)."""
    check_finite_output([k for k, t in out.items() if isinstance(t, Tensor) and not is_finite(t)], name)
