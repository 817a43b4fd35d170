"""Readers: a weights file or a model folder (single or sharded safetensors) as one lazy source.

Interim version: folders with ``model.safetensors`` or ``model.safetensors.index.json`` and single files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import Tensor

from ..merging.sources import MergeInputError, ParamSource

__all__ = ["open_checkpoint", "ShardedSource"]


class ShardedSource:
    """The shards of one model (``*.index.json`` weight map) seen as one lazy source."""

    def __init__(self, index: Path, name: str | None = None) -> None:
        self.name = name or str(index.parent)
        weight_map = json.loads(index.read_text())["weight_map"]
        self._file_of = {k: index.parent / f for k, f in weight_map.items()}
        self._shards = {f: ParamSource(f) for f in dict.fromkeys(self._file_of.values())}

    def keys(self) -> list[str]:
        return list(self._file_of)

    def meta(self, key: str) -> Any:
        return self._shards[self._file_of[key]].meta(key)

    def get(self, key: str) -> Tensor:
        return self._shards[self._file_of[key]].get(key)


def open_checkpoint(spec: str | Path, *, name: str | None = None) -> ParamSource | ShardedSource:
    """A lazy source for a weights file or a model folder."""
    path = Path(spec)
    if path.is_dir():
        if (path / "model.safetensors.index.json").exists():
            return ShardedSource(path / "model.safetensors.index.json", name)
        if (path / "model.safetensors").exists():
            return ParamSource(path / "model.safetensors", name or str(path))
        raise MergeInputError(f"{path}: no model.safetensors or model.safetensors.index.json in this folder")
    return ParamSource(path, name)
