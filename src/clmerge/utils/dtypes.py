"""The one dtype table: the names recipes and flags use (``float32`` ...), the safetensors header names
(``F32`` ...), and the dtype a model folder's ``config.json`` records for a set of output tensors."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import Literal

import torch

__all__ = ["DTYPES", "DtypeName", "ST_DTYPES", "config_dtype", "dtype_name", "to_dtype"]

DtypeName = Literal["float32", "bfloat16", "float16", "float64"]

#: recipe / flag names -> torch dtypes
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                                  "float64": torch.float64}

#: safetensors header names -> torch dtypes
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def to_dtype(name: str | None) -> torch.dtype | None:
    """``"bfloat16"`` -> ``torch.bfloat16``; ``None`` stays ``None``."""
    return None if name is None else DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def config_dtype(plan: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> torch.dtype:
    """The dtype holding most floating-point elements of ``plan`` (``(key, shape, dtype)`` rows; the earliest
    on a tie), float32 when there is none: what ``config.json`` records."""
    sizes: Counter = Counter()
    for _, shape, dtype in plan:
        if dtype.is_floating_point:
            sizes[dtype] += math.prod(shape)
    return sizes.most_common(1)[0][0] if sizes else torch.float32
