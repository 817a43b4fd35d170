"""The ``select:`` and ``link:`` blocks of a sweep spec (docs/sweeps.md): parsing and checks only.

``select`` names one config key whose value is chosen on validation data (phase 1) before the grid's cells run
with the chosen value (phase 2); :mod:`.select` runs it. ``link`` makes a key follow a grid key in every cell
(``scenario.seed: seed``: the class order changes with the training seed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..config import ConfigError
from ..errors import clip

__all__ = ["SelectSpec", "SELECT_KEYS", "SELECT_METRICS", "parse_select", "parse_link"]

SELECT_KEYS = ("key", "values", "metric", "seeds", "extend", "per")
# metric name -> what it reads: the final class-incremental accuracy, on the held-out validation parts of all
# tasks, of the run's primary head (metrics.json "head.val_acc", written by the engine's validation pass)
SELECT_METRICS = ("acc",)
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass(frozen=True)
class SelectSpec:
    """``key`` chosen among ``values`` by the validation ``metric`` (maximised) on the ``seeds`` (None: the base
    config's seed), extended up to ``extend`` steps past an edge, separately for each value of the ``per`` keys."""

    key: str
    values: list[Any]
    metric: str = "acc"
    seeds: list[int] | None = None
    extend: int = 0
    per: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "values": list(self.values), "metric": self.metric,
                "seeds": None if self.seeds is None else list(self.seeds), "extend": self.extend,
                "per": list(self.per)}


_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _as_number(v: Any) -> Any:
    """YAML reads ``1e-3`` (no dot) as a string; such a value is the number it spells."""
    return float(v) if isinstance(v, str) and _FLOAT.match(v) else v


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(v, int) and not isinstance(v, bool)
                                                             for v in value) or len(set(value)) < len(value):
        raise ConfigError(f"{what}: expected a non-empty list of distinct integers, got {clip(value, 40)}")
    return list(value)


def _values(data: dict, extend: int, where: str) -> list[Any]:
    values = data.get("values")
    values = [_as_number(v) for v in values] if isinstance(values, list) else values
    if not isinstance(values, list) or not values or len({repr(v) for v in values}) < len(values):
        raise ConfigError(f"{where}.values: expected a non-empty list of distinct values, got {clip(values, 40)}")
    if extend and (len(values) < 2 or not all(_number(v) and v > 0 for v in values)):
        raise ConfigError(f"{where}.values: extend needs at least two positive numbers (the grid's geometric "
                          f"step), got {clip(values, 40)}")
    return list(values)


def _extend(data: dict, where: str) -> int:
    extend = data.get("extend", 0)
    if not isinstance(extend, int) or isinstance(extend, bool) or extend < 0:
        raise ConfigError(f"{where}.extend: expected a whole number of extra steps >= 0, got {clip(extend, 40)}")
    return extend


def _select_key(data: dict, grid: dict, fixed: dict, where: str) -> str:
    key = data.get("key")
    if not isinstance(key, str) or not _KEY.match(key):
        raise ConfigError(f"{where}.key: expected the dotted config key to choose (e.g. optim.lr), "
                          f"got {clip(key, 40)}")
    if key in grid or key in fixed:
        raise ConfigError(f"{where}.key: {key} is also in {'grid' if key in grid else 'set'}; the selection sets "
                          "it, so leave it out there")
    return key


def _per(data: dict, grid: dict, where: str) -> list[str]:
    per = data.get("per", [])
    if not isinstance(per, list) or not all(isinstance(k, str) for k in per):
        raise ConfigError(f"{where}.per: expected a list of grid keys, got {clip(per, 40)}")
    for k in per:
        if k not in grid or k == "seed":
            raise ConfigError(f"{where}.per: {clip(k, 60)} is not a grid key other than seed (grid keys: "
                              f"{', '.join(grid) or 'none'})")
    return list(per)


def parse_select(value: Any, grid: dict, fixed: dict, source: str) -> SelectSpec | None:
    """The ``select`` block checked against the spec's ``grid`` and ``set``; seeds default to the grid's first
    ``seed`` (None when the grid has no seed: the base config's)."""
    if value is None:
        return None
    where = f"{source}: select"
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping with {', '.join(SELECT_KEYS)}, got {clip(value, 40)}")
    unknown = [k for k in value if k not in SELECT_KEYS]
    if unknown:
        raise ConfigError(f"{where}: unknown key {clip(repr(unknown[0]), 60)} (expected {', '.join(SELECT_KEYS)})")
    extend = _extend(value, where)
    metric = value.get("metric", "acc")
    if metric not in SELECT_METRICS:
        raise ConfigError(f"{where}.metric: expected one of {', '.join(SELECT_METRICS)} (validation CIL accuracy "
                          f"of the primary head), got {clip(metric, 40)}")
    seeds = value.get("seeds")
    if seeds is None and "seed" in grid:
        seeds = [grid["seed"][0]]
    seeds = None if seeds is None else _int_list(seeds, f"{where}.seeds")
    return SelectSpec(_select_key(value, grid, fixed, where), _values(value, extend, where), metric, seeds,
                      extend, _per(value, grid, where))


def parse_link(value: Any, grid: dict, fixed: dict, source: str) -> dict[str, str]:
    """``link: {follower: grid_key}``: every cell sets ``follower`` to its value of ``grid_key``."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: link: expected a mapping of dotted.key: grid key, got {clip(value, 40)}")
    for dst, src in value.items():
        if not isinstance(dst, str) or not _KEY.match(dst) or dst in grid or dst in fixed:
            raise ConfigError(f"{source}: link: {clip(repr(dst), 60)} must be a dotted config key that is in "
                              "neither grid nor set")
        if src not in grid:
            raise ConfigError(f"{source}: link.{dst}: {clip(repr(src), 60)} is not a grid key (grid keys: "
                              f"{', '.join(grid) or 'none'})")
    return dict(value)
