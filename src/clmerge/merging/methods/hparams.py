"""What a merge method's hyperparameters are: their types (from the signature), defaults and meaning (from the
docstring's ``Args:`` section), and the check of a user's value against them (one-line errors).
"""

from __future__ import annotations

import difflib
import inspect
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class MergeMethod(Protocol):
    """What these checks read of a registered method (:class:`~.registry.MergeMethod`)."""

    name: str
    fn: Any

__all__ = ["DATA_HPARAMS", "HParam", "check_hyperparameters", "coerce_value", "effective_hyperparameters",
           "method_hparams", "per_expert_name", "per_model_params"]

# Hyperparameters that are data-dependent statistics (computed by the Python API from a dataset).
DATA_HPARAMS = ("fishers", "grams")


@dataclass(frozen=True)
class HParam:
    """One keyword hyperparameter of a merge method."""

    name: str
    annotation: str
    default: Any
    help: str

    @property
    def required(self) -> bool:
        return self.default is inspect.Parameter.empty

    @property
    def is_list(self) -> bool:
        return bool(re.search(r"\b(Sequence|list|tuple)\[", self.annotation))

    @property
    def kinds(self) -> list[str]:
        """The scalar kinds the annotation allows: some of ``bool int float str none``."""
        text = self.annotation or type(self.default).__name__
        if self.is_list:
            text = re.sub(r"(Sequence|list|tuple)\[([^\]]*)\]", r"\2", text)
        kinds = [k for k in ("bool", "int", "float", "str") if re.search(rf"\b{k}\b", text)]
        if "None" in text or self.default is None:
            kinds.append("none")
        return kinds or ["any"]


def method_hparams(method: MergeMethod) -> dict[str, HParam]:
    """The keyword hyperparameters of ``method`` (not ``base`` / ``experts``), with their ``Args:`` text."""
    docs = _args_section(inspect.getdoc(method.fn) or "")
    sig = inspect.signature(method.fn)
    out = {}
    for name, p in sig.parameters.items():
        if name in ("base", "experts"):
            continue
        ann = p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", "")
        ann = "" if p.annotation is inspect.Parameter.empty else str(ann)
        out[name] = HParam(name, ann, p.default, docs.get(name, ""))
    return out


def _args_section(doc: str) -> dict[str, str]:
    """``{name: description}`` from a Google-style ``Args:`` section (``a, b: text`` documents both)."""
    out: dict[str, str] = {}
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Args:")
    except StopIteration:
        return out
    indent, current = None, []
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        ind = len(line) - len(line.lstrip())
        indent = ind if indent is None else indent
        if ind < indent:
            break  # the next section (Returns:, Raises:)
        m = re.match(r"\s*([\w, ]+):\s*(.*)", line) if ind == indent else None
        if m:
            current = [n.strip() for n in m.group(1).split(",")]
            for n in current:
                out[n] = m.group(2).strip()
        else:
            for n in current:
                out[n] += " " + line.strip()
    return out


def coerce_value(method: str, hp: HParam, value: Any, where: str) -> Any:
    """Check ``value`` against ``hp``'s type; returns it (ints accepted for floats) or raises one line.

    Raises:
        ValueError: ``"{where}: {method} expects <type>, got <value>"``.
    """
    if hp.is_list and isinstance(value, (list, tuple)):
        return [_gradient(method, hp, v, where) if isinstance(v, list) else _scalar(method, hp, v, where)
                for v in value]
    return _scalar(method, hp, value, where)


def _gradient(method: str, hp: HParam, value: list, where: str) -> list:
    """One expert's entry of a per-expert list given as a depth gradient (a non-empty list of numbers,
    interpolated over the layers by :func:`..recipes.key_groups`), each number checked."""
    if not value or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{where}: a depth gradient is a non-empty list of numbers, got {value!r}")
    return [_scalar(method, hp, v, where) for v in value]


def _scalar(method: str, hp: HParam, value: Any, where: str) -> Any:
    kinds = hp.kinds
    ok = ("any" in kinds
          or (value is None and "none" in kinds)
          or (isinstance(value, bool) and "bool" in kinds)
          or (isinstance(value, int) and not isinstance(value, bool) and ("int" in kinds or "float" in kinds))
          or (isinstance(value, float) and "float" in kinds and math.isfinite(value))
          or (isinstance(value, str) and "str" in kinds))
    if not ok:
        want = " or ".join({"none": "none", "float": "a finite number", "int": "an integer",
                            "bool": "true/false", "str": "a string"}[k] for k in kinds)
        want = f"a list of ({want})" if hp.is_list else want
        raise ValueError(f"{where}: {method}'s {hp.name} expects {want}, got {value!r}")
    return float(value) if isinstance(value, int) and not isinstance(value, bool) and "int" not in kinds else value


def per_expert_name(method: str, hps: dict[str, HParam], key: str) -> str:
    """The list hyperparameter that a per-model value ``key`` feeds (``weight`` -> ``weights``, ``density`` ->
    ``densities``), or an error."""
    plural = key[:-1] + "ies" if key.endswith("y") else key + "s"
    for name in (key, plural):
        if name in hps and hps[name].is_list and name not in DATA_HPARAMS:
            return name
    lists = [n for n, h in hps.items() if h.is_list and n not in DATA_HPARAMS]
    have = f"its per-model lists: {', '.join(lists)}" if lists else "it takes no per-model values"
    raise ValueError(f"per-model parameter {key!r}: {method} has no per-expert list {key!r} or {plural!r} ({have})")


def check_hyperparameters(method: MergeMethod, params: Mapping[str, Any], where: str = "", *,
                          hps: dict[str, HParam] | None = None, types: bool = True, data_ok: bool = False,
                          error: type[Exception] = ValueError) -> None:
    """The one check of a user's hyperparameters against ``method``: every name is one of its keyword
    hyperparameters (else the nearest valid name, or the valid ones), and with ``types`` every value has the
    annotated type; a list for a scalar hyperparameter is a depth gradient (a non-empty list of numbers).

    Args:
        where: how the message names the values (``"parameters."``, ``"--set "``, ``"overrides[0].parameters."``).
        data_ok: accept the data-dependent statistics (:data:`DATA_HPARAMS`; the Python API computes them).
        error: the exception raised for an unknown name (``TypeError`` in the Python API, as for a call).

    Raises:
        ``error`` (unknown name) or ValueError (a value of the wrong type): one line naming it.
    """
    hps = method_hparams(method) if hps is None else hps
    for name, value in params.items():
        if name not in hps or (name in DATA_HPARAMS and not data_ok):
            near = difflib.get_close_matches(name, list(hps), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f"; valid: {', '.join(hps) or 'none'}"
            raise error(f"{where}{name}: not a hyperparameter of {method.name}{hint}")
        if not types or name == "task":
            continue
        if isinstance(value, list) and not hps[name].is_list:
            if not value or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
                raise ValueError(f"{where}{name}: a depth gradient is a non-empty list of numbers, got {value!r}")
            for v in value:
                coerce_value(method.name, hps[name], v, f"{where}{name}")
        else:
            coerce_value(method.name, hps[name], value, f"{where}{name}")


def per_model_params(method: MergeMethod, hps: dict[str, HParam], models: Sequence[Any]) -> dict[str, list]:
    """The per-expert lists that ``models[i].parameters`` feed (``weight`` -> ``weights``), checked: every model
    gives the same names."""
    names = [set(m.parameters) for m in models]
    if not any(names):
        return {}
    for i, n in enumerate(names):
        if n != names[0]:
            raise ValueError(f"models[{i}].parameters: gives {sorted(n)} but models[0] gives {sorted(names[0])} "
                             "(every model needs the same per-model parameters)")
    out = {}
    for key in names[0]:
        target = per_expert_name(method.name, hps, key)
        out[target] = [coerce_value(method.name, hps[target], [m.parameters[key]], f"models[{i}].parameters.{key}")[0]
                       for i, m in enumerate(models)]
    return out


def _plain(value: Any) -> tuple[bool, Any]:
    """``(True, value as YAML writes it)`` for a default a recipe can hold (``None``, a bool, an int, a finite
    float, a string, or a list of those; a tuple becomes a list), else ``(False, None)``."""
    if value is None or isinstance(value, (bool, int, str)):
        return True, value
    if isinstance(value, float):
        return math.isfinite(value), value
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    return False, None


def effective_hyperparameters(method: MergeMethod, params: Mapping[str, Any],
                              per_model: Sequence[str] = ()) -> dict[str, Any]:
    """``params`` with every keyword hyperparameter of ``method`` that it leaves out at its default: what the
    method runs with, so a recipe that records it gives the same merge after a default changes.

    Left out: required hyperparameters (no default), the data-dependent statistics (:data:`DATA_HPARAMS`),
    ``task`` (chosen by ``--task``), the per-expert lists that the models' own ``parameters`` feed
    (``per_model``: their keys, ``weight`` feeding ``weights``) and a default a recipe cannot hold (an object,
    a non-finite float). A given name that is no hyperparameter is kept, for the check to name it. The
    signature's order, then any unknown given names.
    """
    hps = method_hparams(method)
    fed = set()
    for key in per_model:
        try:
            fed.add(per_expert_name(method.name, hps, key))
        except ValueError:
            pass  # named by per_model_params when the recipe is checked
    out: dict[str, Any] = {}
    for name, hp in hps.items():
        if name in params:
            out[name] = params[name]
            continue
        if hp.required or name in DATA_HPARAMS or name == "task" or name in fed:
            continue
        ok, value = _plain(hp.default)
        if ok:
            out[name] = value
    out.update({k: v for k, v in params.items() if k not in out})
    return out
