"""One generic name -> object registry, used for merge methods, CL methods, datasets and backbones.

A :class:`Registry` maps a public name to an object (a function, a class, an entry tuple) and remembers a
one-line description and the module that registered it. Registering a name twice is an error naming the
first registrant; looking up an unknown name is a :class:`UnknownNameError` (a :class:`~clmerge.errors.UsageError`
that is also a ``KeyError``, so older ``except KeyError`` callers keep working) naming the nearest known names.

A module of a low layer that looks names up in a registry a higher layer fills (the config checks ``method:``
against the continual methods) does not import that layer: it asks :func:`provided` for the registry of a kind.
The package's face (``clmerge/__init__.py``, above every layer and run before any module of the package) names
the provider of each such kind with :func:`set_provider`, so the lookup works whatever was imported first.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .errors import UsageError

__all__ = ["Registry", "RegistryEntry", "UnknownNameError", "provided", "set_provider"]

_MISSING = object()
_PROVIDERS: dict[str, Callable[[], "Registry"]] = {}  # kind -> the function that returns its filled registry


def set_provider(kind: str, provider: Callable[[], "Registry"]) -> None:
    """Name the function that returns the filled registry of ``kind`` (it imports the modules that fill it)."""
    _PROVIDERS[kind] = provider


def provided(kind: str) -> "Registry | None":
    """The filled registry of ``kind`` from its provider (None: no provider is named)."""
    provider = _PROVIDERS.get(kind)
    return provider() if provider is not None else None


class UnknownNameError(UsageError, KeyError):
    """An unknown registry name (exit code 2); its text is the plain message, not ``KeyError``'s quoted one."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class RegistryEntry:
    """One registered object with its description, registering module and any extra metadata."""

    name: str
    obj: Any
    description: str
    module: str
    meta: dict[str, Any] = field(default_factory=dict)


def _one_line(obj: Any, description: str | None) -> str:
    """The given description, else the object's ``description`` attribute, else its docstring's first line."""
    text = description or getattr(obj, "description", None) or (getattr(obj, "__doc__", None) or "")
    return str(text).strip().split("\n")[0]


class Registry:
    """A named registry of ``kind`` (e.g. ``"merge method"``); ``key`` prefixes lookup errors (a config key).

    ``register(name, obj)`` or ``@register(name, description=...)``; ``reg[name]`` / ``reg.get(name)`` return
    the object (``get`` with a default behaves like ``dict.get``); ``available()`` lists names with descriptions.
    """

    def __init__(self, kind: str, *, key: str | None = None) -> None:
        self.kind = kind
        self.key = key
        self._entries: dict[str, RegistryEntry] = {}

    def register(self, name: str, obj: Any = None, *, description: str | None = None,
                 module: str | None = None, **meta: Any) -> Any:
        """Register ``obj`` under ``name`` (returns it); without ``obj``, a decorator that does so.

        Raises:
            ValueError: ``name`` is already registered (the message names the module that registered it).
        """
        if obj is None:
            return lambda target: self.register(name, target, description=description, module=module, **meta)
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered (by {self._entries[name].module})")
        origin = module or getattr(obj, "__module__", None) or "?"
        self._entries[name] = RegistryEntry(name, obj, _one_line(obj, description), origin, dict(meta))
        return obj

    def get(self, name: str, default: Any = _MISSING) -> Any:
        """The object registered as ``name``; unknown: ``default`` if given, else :class:`UnknownNameError`."""
        if name in self._entries:
            return self._entries[name].obj
        if default is not _MISSING:
            return default
        raise UnknownNameError(self.unknown_message(name))

    def entry(self, name: str) -> RegistryEntry:
        """The full :class:`RegistryEntry` of ``name`` (unknown: :class:`UnknownNameError`)."""
        self.get(name)
        return self._entries[name]

    def unknown_message(self, name: str) -> str:
        """``[key: ]unknown <kind> 'name' (did you mean 'a', 'b'?); known: ...``."""
        near = difflib.get_close_matches(str(name), list(self._entries), n=3)
        hint = f" (did you mean {', '.join(repr(n) for n in near)}?)" if near else ""
        prefix = f"{self.key}: " if self.key else ""
        return f"{prefix}unknown {self.kind} {name!r}{hint}; known: {', '.join(sorted(self._entries)) or 'none'}"

    def unregister(self, name: str) -> None:
        """Remove ``name`` if registered (tests and plugins that clean up after themselves)."""
        self._entries.pop(name, None)

    def available(self) -> dict[str, str]:
        """Registered names, sorted, each with its one-line description."""
        return {n: self._entries[n].description for n in sorted(self._entries)}

    def items(self) -> Iterator[tuple[str, Any]]:
        return ((n, e.obj) for n, e in self._entries.items())

    def keys(self) -> Iterator[str]:
        return iter(self._entries)

    def values(self) -> Iterator[Any]:
        return (e.obj for e in self._entries.values())

    def __getitem__(self, name: str) -> Any:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {len(self)} entries)"

