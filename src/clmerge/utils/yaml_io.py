"""The one way clmerge reads YAML: size, nesting depth and alias expansion capped before anything is built.

A few hundred bytes of YAML aliases (``&a [*b, *b, ...]`` nested a few levels) stand for billions of nodes,
and ``[[[[...]]]]`` nested tens of thousands deep overflows a recursive reader. Both are refused here with one
line, before a Python object exists: the document's parse events are scanned once (an iterative scan, no
recursion) counting every node as it would be once aliases are expanded, then the document is loaded with
PyYAML's safe loader (plain data only: no Python objects are built from tags).

Every reader of YAML goes through :func:`load_yaml` / :func:`read_yaml`: configs, merge recipes, study specs
and the ``config.yaml`` / ``study.yaml`` saved in run and study directories.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError, ConfigFileError, InputError, clip
from .inpaths import InputTooLarge, read_bytes

__all__ = ["MAX_YAML_BYTES", "MAX_YAML_NODES", "MAX_YAML_DEPTH", "YamlError", "YamlLimitError", "load_yaml",
           "read_yaml", "read_yaml_mapping", "parse_value", "parse_assignment"]

MAX_YAML_BYTES = 1 << 20  # 1 MiB: a config is a few KB, a recipe or study spec a few tens
MAX_YAML_NODES = 100_000  # scalars + collections once aliases are expanded (a full config: about 150)
MAX_YAML_DEPTH = 64  # nested mappings / lists (a config: 4)


class YamlError(InputError):
    """A YAML document that cannot be read: not YAML, or over a limit (exit code 3)."""


class YamlLimitError(YamlError):
    """A YAML document over the size, node-count or depth limit, or with a recursive alias."""


def read_yaml(path: str | Path, *, max_bytes: int = MAX_YAML_BYTES, within: str | Path | None = None,
              **limits: int) -> Any:
    """The YAML document in ``path`` (at most ``max_bytes`` bytes of UTF-8), read through the input boundary
    (:func:`clmerge.utils.inpaths.read_bytes`: a regular file, inside ``within`` when given) and parsed by
    :func:`load_yaml`.

    Raises:
        YamlError: too large, not UTF-8, not YAML or over a limit (the message names ``path``).
        InputError: not a regular file, a symlink loop, or outside ``within``.
        FileNotFoundError: no such file (an :class:`~clmerge.utils.inpaths.InputMissing`).
    """
    try:
        data = read_bytes(path, within=within, kind="yaml", max_bytes=max_bytes)
    except InputTooLarge:
        raise YamlLimitError(f"{path}: larger than {max_bytes:,} bytes, the limit for a YAML file; not a "
                             "clmerge YAML file") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise YamlError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    return load_yaml(text, source=str(path), **limits)


def load_yaml(text: str, *, source: str = "<text>", max_nodes: int = MAX_YAML_NODES,
              max_depth: int = MAX_YAML_DEPTH, fast: bool = False) -> Any:
    """Parse one YAML document with the safe loader, after checking its expanded size and depth.

    ``fast``: libyaml's safe loader where PyYAML has it (large data files, e.g. a dataset's split lists).

    Raises:
        YamlLimitError: more than ``max_nodes`` nodes once aliases are expanded, nesting deeper than
            ``max_depth``, or an alias inside the node it refers to (a recursive structure).
        YamlError: not valid YAML (one line: the problem and where).
    """
    try:
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader) if fast else yaml.SafeLoader
        _check_events(loader(text), source, max_nodes, max_depth)
        return yaml.load(text, Loader=loader)  # noqa: S506  (a safe loader: plain data only)
    except yaml.YAMLError as exc:
        raise YamlError(f"{source}: not valid YAML ({_describe(exc)})") from None


def _describe(exc: yaml.YAMLError) -> str:
    """A YAML error as one short line: the problem and its line and column (PyYAML's is several lines)."""
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None)
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return clip(f"{problem or exc}{where}", 160)


def _check_events(loader: Any, source: str, max_nodes: int, max_depth: int) -> None:
    """Scan the parse events: count nodes with aliases expanded (an alias counts the whole node it names)."""
    open_: list[list] = []  # [anchor, expanded nodes inside] per collection not yet closed
    sizes: dict[str, int] = {}  # anchor -> expanded size of the node it names
    total = 0
    try:
        while loader.check_event():
            ev = loader.get_event()
            if isinstance(ev, yaml.CollectionEndEvent):
                anchor, inner = open_.pop()
                if open_:
                    open_[-1][1] += inner
                if anchor is not None:
                    sizes[anchor] = inner + 1
                continue
            if not isinstance(ev, yaml.NodeEvent):
                continue
            n = _alias_size(ev, open_, sizes, source) if isinstance(ev, yaml.AliasEvent) else 1
            total += n
            if total > max_nodes:
                raise YamlLimitError(f"{source}: more than {max_nodes:,} YAML nodes once aliases are expanded "
                                     "(an alias bomb?); not a clmerge YAML file")
            if open_:
                open_[-1][1] += n
            if isinstance(ev, yaml.CollectionStartEvent):
                open_.append([ev.anchor, 0])
                if len(open_) > max_depth:
                    raise YamlLimitError(f"{source}: YAML nested deeper than {max_depth} levels; not a clmerge "
                                         "YAML file")
            elif isinstance(ev, yaml.ScalarEvent) and ev.anchor is not None:
                sizes[ev.anchor] = 1
    finally:
        loader.dispose()


def _alias_size(ev: yaml.AliasEvent, open_: list[list], sizes: dict[str, int], source: str) -> int:
    if any(anchor == ev.anchor for anchor, _ in open_):
        raise YamlLimitError(f"{source}: the YAML alias *{clip(ev.anchor, 40)} refers to a node that contains "
                             "it (a recursive structure)")
    return sizes.get(ev.anchor, 1)  # an undefined alias: the loader names it


def parse_value(text: str, source: str = "--set value") -> Any:
    """The one ``key=value`` value grammar of every command (``run --set``, ``merge --set``, ``sweep``,
    ``merge-bench --hp``, ``predict``): a YAML scalar or flow collection, read by :func:`load_yaml`.
    ``1e-3`` is a float (YAML 1.1 would read it as a string), ``[1, 2]`` a list, ``true``/``yes`` a bool,
    ``null`` None; text that is not YAML (``a: b: c``) stays the string it was.

    Raises:
        YamlLimitError: an alias bomb or a value nested too deeply (the caller reports it as a bad value).
    """
    try:
        value = load_yaml(text, source=source)
    except YamlLimitError:
        raise
    except YamlError:
        return text
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def parse_assignment(item: str, flag: str = "--set", example: str = "key=value") -> tuple[str, Any]:
    """``"key=value"`` -> ``(key, parse_value(value))``: the one ``key=value`` grammar of the command line.

    Raises:
        ValueError: no ``=`` or an empty key (the message names the flag, the item and an example); the callers
            turn it into their usage error.
        YamlLimitError: see :func:`parse_value`.
    """
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"{flag} {clip(repr(item), 80)}: expected {example}")
    return key.strip(), parse_value(text.strip(), source=f"{flag} {clip(key.strip(), 80)}")


def read_yaml_mapping(path: str | Path, what: str = "config file") -> dict:
    """Read a YAML file whose top level is a mapping (a config, recipe or spec): a missing, unreadable,
    oversized or invalid file -> :class:`~clmerge.errors.ConfigFileError` (an input error, exit code 3), a
    non-mapping -> :class:`~clmerge.errors.ConfigError`. The limits are this module's."""
    p = Path(path)
    if not p.exists():
        raise ConfigFileError(f"{what} not found: {p}")
    if not p.is_file():
        raise ConfigFileError(f"{p}: the {what} is a folder, not a YAML file")
    try:
        data = read_yaml(p) or {}
    except YamlError as exc:
        raise ConfigFileError(f"{exc} (the {what})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level of a {what} must be a mapping")
    return data
