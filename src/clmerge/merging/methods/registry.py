"""The one registry of merge methods.

A merge method is a plain function ``fn(*, base, experts, **hyperparameters) -> dict[str, Tensor]`` registered
with :func:`register_merge`. Registering a name twice is an error (no silent overwrite).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ...registry import Registry
from ..io.base import MergeInputError
from ..io.checks import check_output_finite
from .hparams import check_hyperparameters

__all__ = ["ALIASES", "MergeMethod", "MERGES", "register_merge", "available", "merge", "get_method",
           "check_output_finite"]

MergeFn = Callable[..., dict[str, Tensor]]


@dataclass(frozen=True)
class MergeMethod:
    """A registered merge method: its name, one-line description and function."""

    name: str
    description: str
    fn: MergeFn
    needs_base: bool

    def hyperparameters(self) -> dict[str, Any]:
        """Keyword hyperparameters with their defaults (``inspect.Parameter.empty`` when required)."""
        sig = inspect.signature(self.fn)
        return {n: p.default for n, p in sig.parameters.items() if n not in ("base", "experts")}


MERGES: Registry = Registry("merge method")  # name -> MergeMethod

#: other tools' names for registered methods: alias -> (method, the hyperparameters the alias fixes). The
#: hyperparameters keep clmerge's names and meanings (``dare``'s ``density`` is its TIES trim); a mergekit
#: config file is translated with mergekit's meanings (:mod:`clmerge.merging.mergekit_config`).
ALIASES: dict[str, tuple[str, dict[str, Any]]] = {
    "linear": ("weight_average", {}),  # mergekit's name
    "ta": ("task_arithmetic", {}),
    "dare_ties": ("dare", {"combine": "ties"}),  # mergekit's names for dare's two combines
    "dare_linear": ("dare", {"combine": "task_arithmetic"}),
}


def register_merge(name: str, description: str, *, needs_base: bool = True) -> Callable[[MergeFn], MergeFn]:
    """Decorator: register ``fn`` under ``name``.

    Args:
        name: the method's public name (``merging.merge(name, ...)``).
        description: one line, shown by ``merging.available()`` and ``clmerge merge --help``.
        needs_base: whether the method uses the pretrained parameters ``base``.

    Raises:
        ValueError: if ``name`` is already registered.
    """

    def deco(fn: MergeFn) -> MergeFn:
        MERGES.register(name, MergeMethod(name, description, fn, needs_base), description=description,
                        module=fn.__module__)
        return fn

    return deco


def available() -> dict[str, str]:
    """Registered method names, each with its one-line description."""
    return MERGES.available()


def get_method(name: str) -> MergeMethod:
    """The registered method ``name`` (or the method an alias in :data:`ALIASES` names; its fixed
    hyperparameters are the caller's to apply); an unknown name is a :class:`~clmerge.registry.UnknownNameError`
    (a ``UsageError`` and ``KeyError``) naming the nearest known ones."""
    return MERGES.get(ALIASES[name][0] if name in ALIASES and MERGES.get(name, None) is None else name)


def merge(name: str, *, base: Any = None, experts: Sequence[Any], **hyperparameters: Any) -> dict[str, Tensor]:
    """Merge ``experts`` (parameter dicts or weight-file paths) with the registered method ``name``.

    Args:
        name: a name from :func:`available`.
        base: the pretrained parameters (dict or path); required by task-vector methods.
        experts: the fine-tuned parameter dicts, or paths to safetensors / ``.bin`` / ``.pt`` files.
        **hyperparameters: the method's keyword hyperparameters (see its function's docstring).

    Raises:
        UnknownNameError (a KeyError): unknown method. TypeError: unknown hyperparameter
        (:func:`~.hparams.check_hyperparameters`, with the nearest valid name). MergeInputError (a
        ValueError): an output tensor came out NaN or Inf (:func:`check_output_finite`).
    """
    method = get_method(name)
    if name in ALIASES and method.name != name:
        hyperparameters = {**ALIASES[name][1], **hyperparameters}
    check_hyperparameters(method, hyperparameters, types=False, data_ok=True, error=TypeError)
    if method.needs_base and base is None:
        raise ValueError(f"{name}: needs base= (the pretrained parameters)")
    out = method.fn(base=base, experts=experts, **hyperparameters)
    if isinstance(out, dict):  # a streamed merge (a sink's view) is checked by its sink, as the CLI's writer
        check_output_finite(name, out)
    return out
