"""Where parameters come from: in-memory dicts, or weight files read lazily tensor by tensor.

:class:`ModelSet` holds a base (optional) and the experts, checks once that they agree (same keys, shapes and
dtypes; an error names the key and the files) and hands out one key at a time, so a streaming merge keeps at
most one tensor per expert in memory besides its output.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["ParamSource", "ModelSet", "as_source", "open_models", "MergeInputError"]

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class MergeInputError(ValueError):
    """Inputs to a merge disagree or are malformed (message names the key and the files)."""


class ParamSource:
    """A read-only view of one parameter set: a dict, a safetensors file (lazy) or a ``.bin``/``.pt`` file.

    Args:
        obj: a ``dict[str, Tensor]`` or a path.
        name: how errors refer to this input (default: the path, or ``"<dict>"``).
    """

    def __init__(self, obj: Mapping[str, Tensor] | str | Path, name: str | None = None) -> None:
        self._dict: Mapping[str, Tensor] | None = None
        self._handle = None
        self._reader: _SafetensorsReader | None = None
        if isinstance(obj, Mapping):
            self._dict = obj
            self.name = name or "<dict>"
        else:
            path = Path(obj)
            self.name = name or str(path)
            if not path.exists():
                raise FileNotFoundError(f"no such weights file: {path}")
            if path.suffix == ".safetensors":
                from safetensors import safe_open

                try:
                    self._handle = safe_open(str(path), framework="pt")  # validates the header
                    self._reader = _SafetensorsReader(path)
                except Exception as exc:  # safetensors raises several types for corrupt headers
                    raise MergeInputError(f"{path}: not a readable safetensors file ({exc})") from exc
            else:
                self._dict = _torch_load(path)
        self._meta = self._read_meta()

    def _read_meta(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if self._dict is not None:
            return {k: (tuple(v.shape), v.dtype) for k, v in self._dict.items()}
        meta = {}
        for k in self._handle.keys():
            sl = self._handle.get_slice(k)
            meta[k] = (tuple(sl.get_shape()), _ST_DTYPES.get(sl.get_dtype(), sl.get_dtype()))
        return meta

    def keys(self) -> list[str]:
        """Parameter names, in the input's order."""
        return list(self._meta)

    def meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        """``(shape, dtype)`` of ``key`` without reading its data."""
        return self._meta[key]

    def get(self, key: str) -> Tensor:
        """The tensor ``key`` (read from disk now for a lazy file). Never modify it in place."""
        return self._dict[key] if self._dict is not None else self._reader.read(key)


class _SafetensorsReader:
    """Reads one tensor of a safetensors file with ``readinto`` into fresh memory (no memory map).

    A mapped file's pages count in the process's resident memory while mapped, so reading every key of
    ``T`` mapped experts would look like ``T`` models resident; plain reads keep the resident set at what
    the merge holds. Format: 8-byte little-endian header length, a JSON header with ``dtype``, ``shape``,
    ``data_offsets`` per tensor, then the data.
    """

    def __init__(self, path: Path) -> None:
        import json

        self.path = path
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            self.header = {k: v for k, v in json.loads(f.read(n)).items() if k != "__metadata__"}
        self.data_start = 8 + n

    def read(self, key: str) -> Tensor:
        info = self.header[key]
        dtype = _ST_DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        size = end - begin
        if size == 0:
            return torch.empty(info["shape"], dtype=dtype)
        buf = _anonymous_buffer(size)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.data_start + begin)
            view, got = memoryview(buf.numpy() if isinstance(buf, Tensor) else buf), 0
            while got < size:  # readinto may return short counts
                n = f.readinto(view[got:])
                if not n:
                    raise MergeInputError(f"{self.path}: truncated data for key {key!r}")
                got += n
            view.release()
        out = torch.frombuffer(buf, dtype=torch.uint8) if not isinstance(buf, Tensor) else buf
        return out.view(dtype).reshape(info["shape"])


def _anonymous_buffer(size: int) -> Any:
    """A private anonymous memory map of ``size`` bytes (a tensor where mmap flags are unavailable).

    Its own mapping is unmapped as soon as the tensor over it is freed, so reading key after key does not
    leave holes in the malloc heap between the (kept) outputs: the resident set stays at what is alive.
    """
    import mmap

    if hasattr(mmap, "MAP_ANONYMOUS") and hasattr(mmap, "MAP_PRIVATE"):
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.empty(size, dtype=torch.uint8)


def _torch_load(path: Path) -> dict[str, Tensor]:
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise MergeInputError(f"{path}: cannot be read with torch.load(weights_only=True) ({exc})") from exc
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise MergeInputError(f"{path}: expected a dict of tensors (a state_dict)")
    return dict(obj)


def as_source(obj: Any, name: str | None = None) -> ParamSource:
    """Wrap a dict or a path as a :class:`ParamSource` (a source is returned as is)."""
    return obj if isinstance(obj, ParamSource) else ParamSource(obj, name)


class ModelSet:
    """A base (or ``None``) and ``T >= 1`` experts that agree key by key.

    Args:
        base: pretrained parameters (dict, path or source) or ``None``.
        experts: the fine-tuned parameter sets.
        check_finite: raise if a floating tensor holds NaN or Inf (checked as each key is read).

    Raises:
        MergeInputError: no experts, or a key / shape / dtype mismatch (names the key and both files).
    """

    def __init__(self, base: Any, experts: Sequence[Any], *, check_finite: bool = True) -> None:
        if isinstance(experts, (str, Path, Mapping)) or len(experts) == 0:
            raise MergeInputError("experts: need a non-empty list of parameter dicts or weight files")
        self.experts = [as_source(e, None if not isinstance(e, Mapping) else f"expert {i}")
                        for i, e in enumerate(experts)]
        self.base = None if base is None else as_source(base, None if not isinstance(base, Mapping) else "base")
        self.check_finite = check_finite
        self._validate()

    def _validate(self) -> None:
        ref = self.experts[0]
        keys = set(ref.keys())
        for other in self.experts[1:] + ([self.base] if self.base is not None else []):
            okeys = set(other.keys())
            if okeys != keys:
                missing, extra = sorted(keys - okeys), sorted(okeys - keys)
                key, where = (missing[0], f"missing from {other.name} (present in {ref.name})") if missing else \
                    (extra[0], f"present in {other.name} but missing from {ref.name}")
                raise MergeInputError(f"key {key!r} is {where}")
            for k in ref.keys():
                if other.meta(k) != ref.meta(k):
                    (s1, d1), (s2, d2) = ref.meta(k), other.meta(k)
                    what = "shape" if s1 != s2 else "dtype"
                    raise MergeInputError(f"key {k!r}: {what} mismatch: {ref.name} has {list(s1)} {d1}, "
                                          f"{other.name} has {list(s2)} {d2}")

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    def keys(self) -> list[str]:
        return self.experts[0].keys()

    def meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        return self.experts[0].meta(key)

    def is_float(self, key: str) -> bool:
        return self.meta(key)[1].is_floating_point

    def load(self, key: str, check: bool | None = None) -> tuple[Tensor | None, list[Tensor]]:
        """``(base tensor or None, [expert tensors])`` for one key, checked for NaN/Inf.

        Args:
            check: override ``check_finite`` for this read (a caller that checks its output instead).
        """
        base = self.base.get(key) if self.base is not None else None
        experts = [e.get(key) for e in self.experts]
        if (self.check_finite if check is None else check) and self.is_float(key):
            for src, t in zip(([self.base] if base is not None else []) + self.experts,
                              ([base] if base is not None else []) + experts):
                # a sum is finite only if every entry is (one read, no mask); confirm a non-finite sum exactly
                if not torch.isfinite(t.sum()) and not torch.isfinite(t).all():
                    raise MergeInputError(f"key {key!r} in {src.name} contains NaN or Inf")
        return base, experts

    def items(self, check: bool | None = None) -> Iterator[tuple[str, Tensor | None, list[Tensor]]]:
        """Yield ``(key, base, experts)`` key by key (``check`` as in :meth:`load`)."""
        for k in self.keys():
            yield (k, *self.load(k, check))


def open_models(base: Any, experts: Sequence[Any] | ModelSet) -> ModelSet:
    """A :class:`ModelSet` from the public ``base=`` / ``experts=`` arguments (passed through if already one)."""
    return experts if isinstance(experts, ModelSet) else ModelSet(base, experts)
