"""Sweep specs (``clmerge sweep SPEC.yaml``): a base config crossed with a grid of overrides.

A spec is a YAML mapping (docs/sweeps.md)::

    base: my.yaml                 # a config file or a shipped config name; omitted: the embedded default
    set: {scenario.n_tasks: 2}    # dotted keys fixed for every cell
    grid: {method.name: [seq_lora, pm], seed: [0, 1]}   # dotted keys crossed: one cell per combination
    link: {scenario.seed: seed}   # optional: keys that follow a grid key in every cell
    select: {key: optim.lr, values: [1e-3, 3e-3]}       # optional: a key chosen on validation (.select)

Every cell is one ``clmerge run`` with the base config, then ``set``, then its own grid values. A cell is
named by its grid values (:func:`cell_name`), e.g. ``method.name=pm, seed=1`` -> ``pm-seed1``; a name that
would not be a safe folder name (``..``, ``.``, a separator, a space, more than
:data:`~clmerge.utils.outpaths.MAX_NAME` characters) is made one by :func:`clmerge.utils.outpaths.slug`
(its safe characters, cut, and a hash of the whole name), so a cell's run always lands in its own folder
directly inside the sweep directory.

A grid holds at most :data:`MAX_CELLS` cells (10,000, the bound of ``merge --tune``'s grid): the count is the
product of the grid's list lengths, checked (:func:`check_cell_count`) before any cell is built or anything
is written; ``clmerge sweep --max-cells N`` raises it. A spec without a grid (an empty file, only ``set``) is
refused: it would run the base config as a one-cell sweep.
"""

from __future__ import annotations

import copy
import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import ConfigError, ExperimentConfig, embedded_default, parse_config, read_yaml_mapping, resolve_config_arg
from ..errors import UsageError, clip
from ..utils.outpaths import slug
from .select_spec import SelectSpec, parse_link, parse_select

__all__ = ["SweepSpec", "Cell", "load_spec", "spec_from_dict", "expand_cells", "cell_name", "cell_config",
           "base_data", "dotted_items", "parse_seeds", "set_dotted", "linked", "SPEC_KEYS", "MAX_CELLS",
           "cell_count", "check_cell_count"]

SPEC_KEYS = ("base", "set", "grid", "link", "select")
#: The most cells a sweep's grid may have unless ``--max-cells`` raises it (``merge --tune``'s MAX_TRIALS).
MAX_CELLS = 10_000
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass
class SweepSpec:
    """``base`` (a config path or shipped name; None: the embedded default), ``set`` (dotted key -> value,
    every cell), ``grid`` (dotted key -> list of values, crossed in the order given), ``link`` (key -> the grid
    key whose value it takes) and ``select`` (a key chosen on validation, :mod:`.select`)."""

    base: str | None = None
    set: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list[Any]] = field(default_factory=dict)
    link: dict[str, str] = field(default_factory=dict)
    select: SelectSpec | None = None
    max_cells: int = field(default=MAX_CELLS, compare=False)  # the bound on the cells (``--max-cells``)

    def as_dict(self) -> dict[str, Any]:
        out = {"base": self.base, "set": dict(self.set), "grid": {k: list(v) for k, v in self.grid.items()}}
        if self.link:
            out["link"] = dict(self.link)
        if self.select is not None:
            out["select"] = self.select.as_dict()
        return out


@dataclass(frozen=True)
class Cell:
    """One combination of grid values: its folder name and its overrides (dotted key -> value)."""

    name: str
    overrides: dict[str, Any]


def load_spec(path: str | Path) -> SweepSpec:
    """Read and check a sweep spec file (unknown keys, a grid key with no list, a bad dotted key: ConfigError
    naming the key; a missing or unreadable file: ConfigFileError; no grid, or an empty file: UsageError
    naming the file)."""
    data = read_yaml_mapping(path, what="sweep spec")
    spec = spec_from_dict(data, source=str(path))
    if not spec.grid:
        if spec.set:  # a bad base or set key is the more precise error: name it first
            cell_config(base_data(spec), Cell("base", {}))
        what = "is empty" if not data else "has no grid (or an empty one)"
        raise UsageError(f"{path}: the sweep spec {what}; give a grid of values to cross, e.g. grid: {{seed: "
                         "[0, 1, 2]} (a single run is `clmerge run CONFIG`)")
    return spec


def cell_count(spec: SweepSpec) -> int:
    """The number of cells of the spec's grid: the product of its list lengths (nothing enumerated)."""
    return math.prod(len(v) for v in spec.grid.values())


def check_cell_count(spec: SweepSpec, max_cells: int = MAX_CELLS, source: str = "grid") -> int:
    """The grid's cell count, after refusing one over ``max_cells`` (before any cell is built).

    Raises:
        UsageError: naming the keys with their lengths, the count and the limit.
    """
    n = cell_count(spec)
    if n > max_cells:
        sizes = " x ".join(f"{k} ({len(v)})" for k, v in spec.grid.items())
        raise UsageError(f"{source}: {sizes} = {n:,} cells, over the limit of {max_cells:,}; split the sweep or "
                         "raise the limit with --max-cells N")
    return n


def spec_from_dict(data: dict, source: str = "sweep spec") -> SweepSpec:
    unknown = [k for k in data if k not in SPEC_KEYS]
    if unknown:
        raise ConfigError(f"{source}: unknown key {clip(repr(unknown[0]), 60)} (expected {', '.join(SPEC_KEYS)})")
    base = data.get("base")
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"{source}: base: expected a config file or a shipped config name, got {clip(base, 40)}")
    fixed = _mapping(data.get("set"), "set", source)
    grid = _mapping(data.get("grid"), "grid", source)
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{source}: grid.{key}: expected a non-empty list of values, got {clip(values, 40)}")
        if len({repr(v) for v in values}) < len(values):
            raise ConfigError(f"{source}: grid.{key}: a value is listed twice")
    both = sorted(set(fixed) & set(grid))
    if both:
        raise ConfigError(f"{source}: {both[0]} is in both set and grid; keep it in one")
    return SweepSpec(base=base, set=fixed, grid=grid, link=parse_link(data.get("link"), grid, fixed, source),
                     select=parse_select(data.get("select"), grid, fixed, source))


def _mapping(value: Any, name: str, source: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {name}: expected a mapping of dotted.key: value, got {clip(value, 40)}")
    for key in value:
        if not isinstance(key, str) or not _KEY.match(key):
            raise ConfigError(f"{source}: {name}: {clip(repr(key), 60)} is not a dotted config key")
    return dict(value)


def _label(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "_".join(_label(v) for v in value)
    return str(value)


def _prefixes(keys: list[str]) -> dict[str, str]:
    """What a key's value is prefixed with in a cell name: nothing for a ``*.name`` key (the value is its own
    label), else the key's last part, or the whole dotted key when another grid key ends the same way."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: "" if tail == "name" else (k if last.count(tail) > 1 else tail) for k, tail in zip(keys, last)}


def cell_name(overrides: dict[str, Any], prefixes: dict[str, str] | None = None) -> str:
    """A readable folder name: ``{method.name: pm, seed: 1}`` -> ``pm-seed1``; ``optim.lr: 0.001`` ->
    ``lr0.001``; ``{seed: 0, scenario.seed: 2}`` -> ``seed0-scenario.seed2``. A name that is not a safe folder
    name as it stands (a character other than letters, digits and ``._+=-``, a leading ``.`` as in ``..``,
    longer than :data:`~clmerge.utils.outpaths.MAX_NAME`) is :func:`~clmerge.utils.outpaths.slug`'s: its safe
    characters, cut, then ``-h`` and 12 hex digits of the sha256 of the whole name, so two names never
    become one folder and a cell's run never leaves the sweep directory."""
    prefixes = prefixes if prefixes is not None else _prefixes(list(overrides))
    return slug("-".join(f"{prefixes[k]}{_label(v)}" for k, v in overrides.items()) or "base")


def linked(overrides: dict[str, Any], link: dict[str, str]) -> dict[str, Any]:
    """``overrides`` plus each ``link`` follower set to its leader's value (every leader is a grid key)."""
    return {**overrides, **{dst: overrides[src] for dst, src in link.items() if src in overrides}}


def expand_cells(spec: SweepSpec) -> list[Cell]:
    """Every combination of the grid's values (the first key varies slowest), each with its unique name (the
    name is the grid values'; the overrides carry the linked keys too); a grid of more than
    ``spec.max_cells`` cells is a UsageError before any is built (:func:`check_cell_count`)."""
    check_cell_count(spec, spec.max_cells)
    keys = list(spec.grid)
    prefixes = _prefixes(keys)
    cells = [Cell(cell_name(dict(zip(keys, combo)), prefixes), linked(dict(zip(keys, combo)), spec.link))
             for combo in itertools.product(*spec.grid.values())]
    seen: dict[str, Cell] = {}
    for c in cells:
        if c.name in seen:
            raise ConfigError(f"grid: cells {clip(seen[c.name].overrides, 100)} and {clip(c.overrides, 100)} would "
                              f"share the folder {c.name!r}; make the values differ")
        seen[c.name] = c
    return cells


def set_dotted(data: dict, key: str, value: Any) -> None:
    """``data[a][b][c] = value`` for ``key`` ``a.b.c`` (sections created as needed)."""
    node = data
    parts = key.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{clip(key, 80)}: {p!r} is not a section")
    node[parts[-1]] = copy.deepcopy(value)


def dotted_items(data: dict, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as dotted key -> leaf value: ``{optim: {lr: 0.1}}`` -> ``{"optim.lr": 0.1}``."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(dotted_items(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def base_data(spec: SweepSpec) -> dict:
    """The base config's mapping (file, shipped name or the embedded default) with ``set`` applied."""
    data = (read_yaml_mapping(resolve_config_arg(spec.base)) if spec.base
            else embedded_default([*spec.set, *spec.grid]))
    for key, value in spec.set.items():
        set_dotted(data, key, value)
    return data


def cell_config(base: dict, cell: Cell) -> tuple[dict, ExperimentConfig]:
    """A cell's config mapping and its validated config (a bad value: ConfigError naming the cell)."""
    from .. import methods  # noqa: F401  (registers the methods a config's method section is checked against)

    data = copy.deepcopy(base)
    for key, value in cell.overrides.items():
        set_dotted(data, key, value)
    try:
        return data, parse_config(data)
    except ConfigError as exc:
        raise ConfigError(f"cell {cell.name}: {exc}") from None


def parse_seeds(text: str) -> list[int]:
    """``--seeds 0,1,2`` -> [0, 1, 2] (distinct integers; anything else is a usage error naming the flag)."""
    try:
        seeds = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) < len(seeds):
        raise UsageError(f"--seeds {clip(repr(text), 60)}: expected distinct integers separated by commas, "
                         "e.g. 0,1,2")
    return seeds
