"""Readers: the checkpoints people have (a model folder, a weights file, a hub id, a PEFT adapter folder) as one
lazy source each.

A model folder holds ``model.safetensors``, or shards listed by ``model.safetensors.index.json``, or
``pytorch_model.bin`` / shards listed by ``pytorch_model.bin.index.json`` (read with
``torch.load(weights_only=True)``, one shard in memory at a time). A hub id (``org/name`` that is not a local
path) is resolved with ``huggingface_hub.snapshot_download`` (weights, config and tokenizer files only).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from ...utils import inpaths
from ...utils.extras import offline as offline_mode
from ...utils.inpaths import inside
from .base import MergeInputError, ParamSource, is_source, torch_load_state_dict

__all__ = ["HUB_PATTERNS", "BinShardedSource", "ShardedSource", "as_source", "open_checkpoint", "resolve_hub_id",
           "shard_map"]

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a merge needs from a hub repository: weights, configs, tokenizer files (never optimizer states etc.)
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


class ShardedSource:
    """The safetensors shards of one model (``model.safetensors.index.json``) seen as one lazy source."""

    def __init__(self, index: Path, name: str | None = None) -> None:
        self.folder = index.parent
        self.name = name or str(index.parent)
        self._file_of = _weight_map(index)
        self._shards = {f: ParamSource(f, within=self.folder) for f in dict.fromkeys(self._file_of.values())}
        self.files = list(self._shards)
        missing = [k for k, f in self._file_of.items() if k not in self._shards[f]._meta]  # headers only
        if missing:
            raise MergeInputError(f"{index}: key {missing[0]!r} is in the index but not in {self._file_of[missing[0]]}"
                                  + (f" ({len(missing) - 1} more keys likewise)" if len(missing) > 1 else ""))

    def keys(self) -> list[str]:
        return list(self._file_of)

    def meta(self, key: str) -> Any:
        return self._shards[self._file_of[key]].meta(key)

    def get(self, key: str) -> Tensor:
        return self._shards[self._file_of[key]].get(key)


class BinShardedSource:
    """``pytorch_model-*.bin`` shards (``pytorch_model.bin.index.json``), read with ``weights_only=True``.

    Shapes are read at open from memory-mapped shards (no data read); later reads keep one shard in memory,
    so a merge that walks the keys in index order loads each shard about once per input.
    """

    def __init__(self, index: Path, name: str | None = None) -> None:
        self.folder = index.parent
        self.name = name or str(index.parent)
        self._file_of = _weight_map(index)
        self.files = list(dict.fromkeys(self._file_of.values()))
        self._meta: dict[str, Any] = {}
        for f in self.files:
            for k, v in torch_load_state_dict(f, mmap=True, within=self.folder).items():
                self._meta[k] = (tuple(v.shape), v.dtype)
        missing = [k for k in self._file_of if k not in self._meta]
        if missing:
            raise MergeInputError(f"{index}: key {missing[0]!r} is in the index but not in {self._file_of[missing[0]]}")
        self._cached: tuple[Path, dict[str, Tensor]] | None = None

    def keys(self) -> list[str]:
        return list(self._file_of)

    def meta(self, key: str) -> Any:
        return self._meta[key]

    def get(self, key: str) -> Tensor:
        f = self._file_of[key]
        if self._cached is None or self._cached[0] != f:
            self._cached = None  # drop the old shard before reading the next
            self._cached = (f, torch_load_state_dict(f, within=self.folder))
        return self._cached[1][key]


def shard_map(index: Path) -> dict[str, Path]:
    """``{weight_map entry: shard path}`` of a shard index, each distinct entry once; every shard must lie
    inside the index's folder (checked before any shard is opened: :func:`clmerge.utils.inpaths.inside`) and
    exist."""
    return _read_index(index)[1]


def _read_index(index: Path) -> tuple[dict[str, str], dict[str, Path]]:
    """The index's ``weight_map`` (read once, through the input boundary) and its checked shards."""
    data = inpaths.read_json(index, within=index.parent)
    try:
        weight_map = data["weight_map"]
    except (KeyError, TypeError) as exc:
        raise MergeInputError(f"{index}: not a shard index (needs a 'weight_map'): {exc}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise MergeInputError(f"{index}: 'weight_map' must map each tensor name to a shard file name, got "
                              f"{type(weight_map).__name__}")
    shards = {f: inside(index.parent, f, f"{index}: weight_map entry") for f in dict.fromkeys(weight_map.values())}
    for f in shards.values():
        if not os.path.lexists(f):
            raise MergeInputError(f"{index}: shard {f.name} is listed but missing")
    return weight_map, shards


def _weight_map(index: Path) -> dict[str, Path]:
    """``{key: shard path}`` of a shard index (:func:`shard_map`'s checks)."""
    weight_map, shards = _read_index(index)
    return {k: shards[f] for k, f in weight_map.items()}


def _open_folder(path: Path, base: Any, name: str | None) -> Any:
    if (path / "adapter_config.json").exists():
        return _open_adapter(path, base, name)
    indexes = (("model.safetensors.index.json", ShardedSource), ("pytorch_model.bin.index.json", BinShardedSource))
    for index, cls in indexes:
        if (path / index).exists():
            return cls(inside(path, index, f"{path}: shard index"), name)
    singles = [path / "model.safetensors", path / "pytorch_model.bin"]
    singles += sorted(path.glob("*.safetensors")) if len(list(path.glob("*.safetensors"))) == 1 else []
    for f in singles:
        if os.path.lexists(f):  # a FIFO or a loop of that name is refused by name when it is opened
            f = inside(path, f.name, f"{path}: weights file")
            src = ParamSource(f, name or str(path), within=path)
            src.folder = path
            return src
    raise MergeInputError(f"{path}: no model weights in this folder (looked for model.safetensors, its shard "
                          "index, pytorch_model.bin, or adapter_config.json)")


def _open_adapter(path: Path, base: Any, name: str | None) -> Any:
    try:
        from .peft import AdapterSource
    except ImportError:
        raise MergeInputError(f"{path}: a PEFT adapter folder, but adapter support (clmerge.merging.io.peft) "
                              "is not available in this build") from None
    if base is None:
        raise MergeInputError(f"{path}: a PEFT adapter needs the base model (--base)")
    src = AdapterSource(path, base)
    if name:
        src.name = name
    return src


def _hub_reachable(timeout: float = 3.0) -> bool:
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def resolve_hub_id(repo_id: str) -> Path:
    """Download (or find in the cache) the weights, configs and tokenizer of ``repo_id``; one-line errors.

    Offline (``HF_HUB_OFFLINE=1``, or the hub unreachable within 3 s) only the local cache is used, so a
    missing model fails at once instead of after the client's retries.
    """
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise MergeInputError(f"{repo_id}: not a local path, and huggingface_hub is not installed") from None
    offline = offline_mode() or not _hub_reachable()
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, local_files_only=offline,
                                      etag_timeout=10))
    except Exception as exc:  # the hub client raises many types (HTTP, offline, not found, auth)
        why = "offline and not in the local cache" if offline else type(exc).__name__
        raise MergeInputError(f"{repo_id}: not a local path, and the hub model cannot be fetched ({why})") from None


def open_checkpoint(spec: str | Path, *, base: Any = None, name: str | None = None) -> Any:
    """A lazy source for a weights file, a model folder, a PEFT adapter folder (over ``base``) or a hub id.

    Args:
        spec: a path, or a hub id ``org/name`` that is not an existing path.
        base: the base model's source (needed by adapter folders, whose tensors are ``base + delta W``).
        name: how errors refer to this input (default: the path).

    Raises:
        FileNotFoundError: ``spec`` is neither a path nor a hub id.
        MergeInputError: the path holds no readable weights, or the hub model cannot be fetched.
    """
    path = Path(spec)
    if path.is_dir():
        return _open_folder(path, base, name)
    if path.exists():
        return ParamSource(path, name)
    text = str(spec)
    if HUB_ID.match(text) and not text.startswith(".") and path.suffix not in (".safetensors", ".bin", ".pt"):
        return _open_folder(resolve_hub_id(text), base, name or text)
    raise FileNotFoundError(f"no such weights file or model folder: {path}")


def as_source(obj: Any, name: str | None = None, *, base: Any = None) -> Any:
    """Wrap a dict, a weights file, a model folder, a hub id or a PEFT adapter folder (over the source
    ``base``) as a lazy source (a source is returned as is)."""
    if is_source(obj):
        return obj
    if isinstance(obj, Mapping):
        return ParamSource(obj, name)
    return open_checkpoint(obj, name=name, base=base)
