"""The inputs of one merge: a base (optional) and the experts, checked to agree, read one key at a time.

:class:`ModelSet` checks once that the inputs agree (the base decides the key set; a missing, extra or
shape-mismatched key is an error naming the key and the model) and hands out one key at a time, so a
streaming merge keeps at most one tensor per input in memory besides its output. Floating inputs of different
dtypes (bf16 beside fp32) are cast to the compute dtype (float32 unless the recipe's ``compute_dtype``
says otherwise). The readers live in :mod:`clmerge.merging.io`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..io.base import MergeInputError, ParamSource
from ..io.checks import check_dtype, source_get, source_meta
from ..io.readers import as_source

__all__ = ["ModelSet", "open_models"]

log = logging.getLogger("clmerge.merging")


class ModelSet:
    """A base (or ``None``) and ``T >= 1`` experts that agree key by key.

    Args:
        base: pretrained parameters (dict, path, hub id or source) or ``None``.
        experts: the fine-tuned parameter sets.
        check_finite: raise if a floating tensor holds NaN or Inf (checked as each key is read).
        compute_dtype: floating dtype the inputs of a key are cast to when their dtypes differ, or always
            when it is wider than float32 (kernels do their arithmetic in at least float32 anyway). A narrower
            one (``torch.bfloat16``, ``torch.float16``) casts every floating input to it on reading and makes
            the kernels that compute in :func:`.trim.work_dtype` compute in it (mergekit's arithmetic);
            ``"input"``: each key's own dtype, which its inputs must share (mixed dtypes are refused).
            Default float32: one rounding, when the output is written.
        keys: restrict the merge to these keys (a group of a recipe with per-key overrides).
        sink: where :func:`~clmerge.merging.methods.driver.map_keys` streams each merged tensor (``write(key, t)``,
            ``read(key)``) instead of collecting a dict; ``None``: collect in memory.

    Attributes:
        prefetch: read the next key in a background thread during :meth:`items` (set by the CLI with
            ``--threads`` >= 2).

    Raises:
        MergeInputError: no experts, or a key / shape mismatch (names the key and both inputs).
    """

    def __init__(self, base: Any, experts: Sequence[Any], *, check_finite: bool = True,
                 compute_dtype: torch.dtype | str = torch.float32, keys: Sequence[str] | None = None,
                 sink: Any = None) -> None:
        if isinstance(experts, (str, Path, Mapping)) or len(experts) == 0:
            raise MergeInputError("experts: need a non-empty list of parameter dicts or weight files")
        base = None if base is None else as_source(base, None if not isinstance(base, Mapping) else "base")
        self._setup(base, [as_source(e, None if not isinstance(e, Mapping) else f"expert {i}", base=base)
                           for i, e in enumerate(experts)], check_finite, compute_dtype, keys, sink)

    @classmethod
    def of_sources(cls, base: ParamSource | None, experts: Sequence[ParamSource], *,
                   compute_dtype: torch.dtype | str = torch.float32) -> ModelSet:
        """A set of inputs opened already (``clmerge merge`` opens every checkpoint while it plans the recipe),
        validated as :class:`ModelSet` validates any other."""
        if not experts:
            raise MergeInputError("experts: need a non-empty list of parameter dicts or weight files")
        new = object.__new__(cls)
        new._setup(base, list(experts), True, compute_dtype, None, None)
        return new

    def _setup(self, base: ParamSource | None, experts: list[ParamSource], check_finite: bool,
               compute_dtype: torch.dtype | str, keys: Sequence[str] | None, sink: Any) -> None:
        self.base, self.experts = base, experts
        self.check_finite = check_finite
        self.compute_dtype = _compute_dtype(compute_dtype)
        self.sink = sink
        self.prefetch = False
        self.mixed: set[str] = set()
        self._validate()
        self._keys = self._ref.keys() if keys is None else list(keys)

    @property
    def _ref(self) -> Any:
        return self.base if self.base is not None else self.experts[0]

    def subset(self, keys: Sequence[str]) -> ModelSet:
        """The same inputs restricted to ``keys`` (validated once already; the sink is shared)."""
        new = object.__new__(ModelSet)
        new.__dict__.update(self.__dict__)
        new._keys = list(keys)
        return new

    def _validate(self) -> None:
        ref = self._ref
        for k in ref.keys():  # every key the reference lists: readable, and of a dtype clmerge merges
            check_dtype(ref, k, source_meta(ref, k)[1])
        keys = set(ref.keys())
        for other in [s for s in [self.base, *self.experts] if s is not None and s is not ref]:
            okeys = set(other.keys())
            if okeys != keys:
                missing, extra = sorted(keys - okeys), sorted(okeys - keys)
                key, where = (missing[0], f"missing from {other.name} (present in {ref.name})") if missing else \
                    (extra[0], f"present in {other.name} but missing from {ref.name}")
                raise MergeInputError(f"key {key!r} is {where}")
            for k in ref.keys():
                (s1, d1), (s2, d2) = ref.meta(k), source_meta(other, k)
                check_dtype(other, k, d2)
                if s1 != s2 or (d1 != d2 and not (d1.is_floating_point and d2.is_floating_point)):
                    what = "shape" if s1 != s2 else "dtype"
                    hint = ("; if their vocabularies differ, set embeddings: union, base or intersection in the "
                            "recipe" if len(s1) == len(s2) == 2 and s1[1:] == s2[1:] else "")
                    raise MergeInputError(f"key {k!r}: {what} mismatch: {ref.name} has {list(s1)} {d1}, "
                                          f"{other.name} has {list(s2)} {d2}{hint}")
                if d1 != d2:
                    if self.compute_dtype is None:
                        raise MergeInputError(
                            f"key {k!r}: compute_dtype: input needs one input dtype per key, but {ref.name} has "
                            f"{str(d1).removeprefix('torch.')} and {other.name} has {str(d2).removeprefix('torch.')}; "
                            "set compute_dtype to float32, bfloat16, float16 or float64")
                    self.mixed.add(k)
        if self.mixed:
            log.info("inputs mix floating dtypes on %d keys (e.g. %s); those are upcast to %s", len(self.mixed),
                     next(iter(sorted(self.mixed))), self.compute_dtype)

    @property
    def narrow(self) -> bool:
        """Whether the merge arithmetic runs in a dtype narrower than float32 (``compute_dtype`` bfloat16,
        float16, or ``"input"``: each key's own dtype), rather than in float32 with one rounding at the end."""
        return self.compute_dtype is None or self.compute_dtype.itemsize < 4

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    def keys(self) -> list[str]:
        return list(self._keys)

    def meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        shape, dtype = self.experts[0].meta(key)
        return shape, (self._cast_to(key) or dtype)

    def is_float(self, key: str) -> bool:
        return self.meta(key)[1].is_floating_point

    def _cast_to(self, key: str) -> torch.dtype | None:
        if not self.experts[0].meta(key)[1].is_floating_point:
            return None
        if self.compute_dtype is None:  # "input": the key's own dtype (one dtype per key: checked)
            return None
        if self.compute_dtype.itemsize != 4:  # float64; or bf16 / fp16, every input cast on reading (mergekit)
            return self.compute_dtype
        return self.compute_dtype if key in self.mixed else None

    def load(self, key: str, check: bool | None = None) -> tuple[Tensor | None, list[Tensor]]:
        """``(base tensor or None, [expert tensors])`` for one key, checked for NaN/Inf.

        Args:
            check: override ``check_finite`` for this read (a caller that checks its output instead).
        """
        base = source_get(self.base, key) if self.base is not None else None
        experts = [source_get(e, key) for e in self.experts]
        if (self.check_finite if check is None else check) and self.is_float(key):
            for src, t in zip(([self.base] if base is not None else []) + self.experts,
                              ([base] if base is not None else []) + experts):
                # a sum is finite only if every entry is (one read, no mask); confirm a non-finite sum exactly
                if not torch.isfinite(t.sum()) and not torch.isfinite(t).all():
                    raise MergeInputError(f"key {key!r} in {src.name} contains NaN or Inf")
        cast = self._cast_to(key)
        if cast is not None:
            base = None if base is None else base.to(cast)
            experts = [x.to(cast) for x in experts]
        return base, experts

    def items(self, check: bool | None = None) -> Iterator[tuple[str, Tensor | None, list[Tensor]]]:
        """Yield ``(key, base, experts)`` key by key (``check`` as in :meth:`load`).

        With ``prefetch`` set, the next key is read in a background thread while the caller merges this one
        (file reads release the GIL): reading overlaps merging at the cost of one more key in memory.
        """
        keys = self.keys()
        if not self.prefetch or len(keys) < 2:
            for k in keys:
                yield (k, *self.load(k, check))
            return
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1, thread_name_prefix="clmerge-read") as pool:
            nxt = pool.submit(self.load, keys[0], check)
            for i, k in enumerate(keys):
                base, experts = nxt.result()
                nxt = pool.submit(self.load, keys[i + 1], check) if i + 1 < len(keys) else None
                yield k, base, experts
                del base, experts


def _compute_dtype(value: torch.dtype | str) -> torch.dtype | None:
    """``compute_dtype`` as given (a torch dtype or a recipe name) -> a floating torch dtype, or ``None`` for
    ``"input"``."""
    from ...utils.dtypes import DTYPES

    if isinstance(value, str):
        if value == "input":
            return None
        if value not in DTYPES:
            raise ValueError(f"compute_dtype: expected input or one of {', '.join(DTYPES)}, got {value!r}")
        return DTYPES[value]
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"compute_dtype: expected a floating dtype, got {value!r}")
    return value


def open_models(base: Any, experts: Sequence[Any] | ModelSet) -> ModelSet:
    """A :class:`ModelSet` from the public ``base=`` / ``experts=`` arguments (passed through if already one)."""
    return experts if isinstance(experts, ModelSet) else ModelSet(base, experts)
