"""mergekit configuration files read as they are: one translation into a clmerge recipe mapping.

A mapping with a ``merge_method`` key is a mergekit config (``mergekit-yaml``'s format, 0.1.x). :func:`translate`
turns it into the mapping of a :class:`~clmerge.merging.recipes.Recipe` (``recipe_of`` calls it; nothing else
reads mergekit keys), so ``clmerge merge config.yml`` runs it through the one recipe runner and
``clmerge merge config.yml --print-recipe`` prints what it became.

What is translated (mergekit's meaning, :mod:`mergekit.config` and its merge methods):

- ``merge_method``: every mergekit method name, to the clmerge method of the same definition (:data:`METHODS`);
  a name without one (``ram``, ``ramplus_tl``) is refused by name.
- ``base_model``, ``models[].model`` / ``models[].parameters``, ``slices[].sources[]`` with ``layer_range``.
- ``parameters`` (global) and per-model ``parameters``: a number, a list of numbers (a gradient over the
  layers, as clmerge's lists) or a list of ``{filter, value}`` (the first entry whose ``filter`` is a substring
  of the tensor name wins; no ``filter``: the fallback). Filters become ``overrides`` (``re:`` + the escaped
  substring, in reverse order, since a later override wins). A per-model value overrides the global one, as
  in mergekit. mergekit's defaults are written out, since some differ from clmerge's (``density`` is 1 there).
- mergekit's per-model ``weight`` and global ``lambda`` / ``normalize`` become clmerge's ``scaling`` and
  ``merge_fn`` (task-vector methods) or ``weights`` (``linear``, ``nuslerp``, ``multislerp``). For ``ties``,
  ``dare_ties`` and ``dare_linear``, per-model ``density`` and ``weight`` that differ between models become
  ``densities`` (``dare``: ``drop_rates``, ``1 - density``) and ``weights``, each model's gradient and filters
  included (:func:`_per_expert_overrides`).
- ``dtype`` / ``out_dtype``: the output dtype is ``out_dtype``, else ``dtype``. clmerge computes in float32
  (float64 for float64 inputs) and rounds once when writing; mergekit casts every input to ``dtype`` and
  computes its task-vector methods in it (docs/merge_methods.md, "bf16"). The translation keeps clmerge's
  arithmetic; a ``compute_dtype`` key (or ``--compute-dtype``) passes through, and ``bfloat16`` / ``input``
  there gives mergekit's.
- ``tokenizer_source`` / ``tokenizer.source``: ``base`` and ``union`` set ``embeddings``; a model sets
  ``tokenizer_from`` with ``embeddings: base``. ``chat_template``: the name of one of the inputs.

Where clmerge's own choice differs from mergekit's, the translation asks for mergekit's with a named option:
``karcher`` with a base (``include_base: true``), a slice recipe with a base (``outer_tensors: slices``) and
``della`` / ``della_linear`` (``window: mergekit``, ``rescale: l1``) and ``dare_ties`` / ``dare_linear``
(``rescale_rule: l1``).

Anything else is refused with one line naming the file, the key and the reason (:data:`UNSUPPORTED`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["METHODS", "UNSUPPORTED", "is_mergekit", "translate"]

_TOP_KEYS = {"merge_method", "base_model", "models", "slices", "parameters", "dtype", "out_dtype",
             "tokenizer_source", "tokenizer", "chat_template"}
# clmerge recipe keys that ``clmerge merge``'s flags add to a config (--compute-dtype, ...): passed through
_FLAG_KEYS = {"compute_dtype", "out_shard_size", "tokenizer_from"}

#: mergekit keys clmerge refuses, with the reason
UNSUPPORTED = {
    "modules": "per-module definitions (mergekit's multi-module syntax) have no clmerge equivalent; use models or "
               "slices",
    "tokenizer.tokens": "per-token embedding sources are not supported; clmerge fills a token's missing rows "
                        "with its `fill` rule",
    "tokenizer.pad_to_multiple_of": "padding the vocabulary is not supported (clmerge writes one row per token)",
    "slices[].parameters": "per-slice parameters are not supported; give them at the top level or per source",
    "slices[].base_model": "a per-slice base model is not supported; give one base_model",
    "slices[].residual_weight": "residual_weight has no clmerge equivalent",
    "base": "a mergekit config names its base in base_model (drop --base)",
    "method": "a mergekit config names its method in merge_method (give one of the two formats)",
}

_DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16", "half": "float16",
           "bfloat16": "bfloat16", "bf16": "bfloat16", "float64": "float64"}


def is_mergekit(data: Any) -> bool:
    """Whether a recipe mapping is a mergekit config (it has mergekit's ``merge_method`` key)."""
    return isinstance(data, dict) and "merge_method" in data


class _Refused(Exception):
    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")


# -- parameter settings: scalars, gradients and filters ----------------------------------------------------

@dataclass
class Setting:
    """One mergekit parameter setting: ``fallback`` (a number, a list: a gradient, or ``None``: unset) and the
    conditional values ``conds`` ``[(filter, value)]`` in mergekit's order (the first match wins)."""

    fallback: Any = None
    conds: list[tuple[str, Any]] = field(default_factory=list)

    def map(self, fn: Any) -> Setting:
        """The setting with ``fn`` applied to every number (gradients entry by entry)."""
        def one(v: Any) -> Any:
            return None if v is None else [fn(x) for x in v] if isinstance(v, list) else fn(v)
        return Setting(one(self.fallback), [(f, one(v)) for f, v in self.conds])

    def plain(self) -> bool:
        return not self.conds and not isinstance(self.fallback, list)


def _value(v: Any, where: str) -> Any:
    if isinstance(v, bool) or isinstance(v, (int, float, str)):
        return v
    if isinstance(v, list) and v and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        return [float(x) for x in v]
    raise _Refused(where, f"expected a number, a list of numbers (a gradient) or a list of filter/value "
                          f"entries, got {v!r}")


def parse_setting(v: Any, where: str) -> Setting:
    """A mergekit ``ParameterSetting`` (``mergekit.config.evaluate_setting``) as a :class:`Setting`."""
    if isinstance(v, dict):
        v = [v]
    if isinstance(v, list) and v and all(isinstance(c, dict) for c in v):
        out = Setting()
        for i, c in enumerate(v):
            extra = set(c) - {"filter", "value"}
            if extra or "value" not in c:
                raise _Refused(f"{where}[{i}]", "expected {filter: SUBSTRING, value: ...} or {value: ...}")
            val = _value(c["value"], f"{where}[{i}].value")
            if c.get("filter") in (None, "*"):
                out.fallback = val
                break  # later entries are never reached (mergekit returns the first match)
            out.conds.append((str(c["filter"]), val))
        return out
    if isinstance(v, list) and v and not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        raise _Refused(where, "a list of non-numbers (picked by layer position in mergekit) is not supported")
    return Setting(_value(v, where))


def _layered(over: Setting | None, under: Setting | None, default: Any) -> Setting:
    """``over`` (per-model) on top of ``under`` (global) on top of ``default``, as mergekit's ``ConfigReader``
    reads them: a conditional list without a match falls through to the next level."""
    out = Setting(default)
    for s in (under, over):
        if s is None:
            continue
        if s.fallback is not None:
            out = Setting(s.fallback, list(s.conds))
        else:
            out = Setting(out.fallback, list(s.conds) + out.conds)
    return out


# -- the methods --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Method:
    """A mergekit method: the clmerge method, mergekit's global and per-model parameters with their defaults
    (``REQUIRED``: no default), and the kind of translation (``gta``: generalized task arithmetic)."""

    target: str
    kind: str
    globals_: dict[str, Any] = field(default_factory=dict)
    per_model: dict[str, Any] = field(default_factory=dict)
    fixed: dict[str, Any] = field(default_factory=dict)
    needs_base: bool = True
    consensus: bool = False


REQUIRED = object()
_GTA_G = {"int8_mask": False, "lambda": 1.0}
_GTA_M = {"weight": REQUIRED, "density": 1.0}

#: mergekit 0.1.5's method names (``mergekit/merge_methods/registry.py`` and the ``@merge_method`` ones)
METHODS: dict[str, Method | str] = {
    "linear": Method("weight_average", "linear", {"normalize": True}, {"weight": REQUIRED}, needs_base=False),
    "task_arithmetic": Method("task_arithmetic", "gta", {**_GTA_G, "normalize": False, "rescale": False}, _GTA_M),
    "ties": Method("ties", "gta", {**_GTA_G, "normalize": True, "rescale": False}, _GTA_M,
                   {"trim_scope": "per_tensor"}, consensus=True),
    "dare_ties": Method("dare", "gta", {**_GTA_G, "normalize": False, "rescale": True}, _GTA_M,
                        {"combine": "ties", "density": 1.0, "trim_scope": "per_tensor"}, consensus=True),
    "dare_linear": Method("dare", "gta", {**_GTA_G, "normalize": False, "rescale": True}, _GTA_M,
                          {"combine": "task_arithmetic"}),
    "breadcrumbs": Method("breadcrumbs", "gta", {**_GTA_G, "normalize": False, "rescale": False},
                          {**_GTA_M, "gamma": 0.01}),
    "breadcrumbs_ties": Method("breadcrumbs_ties", "gta", {**_GTA_G, "normalize": False, "rescale": False},
                               {**_GTA_M, "gamma": 0.01}, consensus=True),
    "della": Method("della", "gta", {**_GTA_G, "normalize": True, "rescale": True}, {**_GTA_M, "epsilon": 0.15},
                    {"window": "mergekit"}, consensus=True),
    "della_linear": Method("della_linear", "gta", {**_GTA_G, "normalize": False, "rescale": True},
                           {**_GTA_M, "epsilon": 0.15}, {"window": "mergekit"}),
    "slerp": Method("slerp", "slerp", {"t": REQUIRED}),
    "nuslerp": Method("nuslerp", "weights", {"nuslerp_flatten": True, "nuslerp_row_wise": False},
                      {"weight": REQUIRED}, needs_base=False),
    "multislerp": Method("multislerp", "weights", {"normalize_weights": True, "eps": 1e-8}, {"weight": REQUIRED},
                         needs_base=False),
    "karcher": Method("karcher", "plain", {"max_iter": 10, "tol": 1e-5}, needs_base=False),
    "model_stock": Method("model_stock", "plain", {"filter_wise": False}),
    "sce": Method("sce", "plain", {"int8_mask": False, "select_topk": 1.0}),
    "nearswap": Method("nearswap", "plain", {"t": REQUIRED}),
    "arcee_fusion": Method("arcee_fusion", "plain"),
    "passthrough": Method("passthrough", "passthrough", {}, {"scale": None}, needs_base=False),
    "ram": "Reinforced Agent Merging has no clmerge equivalent",
    "ramplus_tl": "Reinforced Agent Merging Plus has no clmerge equivalent",
}

# mergekit parameter name -> clmerge hyperparameter name, where both mean the same
_RENAMES = {"nuslerp_flatten": "flatten", "nuslerp_row_wise": "row_wise", "gamma": "beta"}


# -- the translation ---------------------------------------------------------------------------------------

@dataclass
class _Entry:
    model: str
    parameters: dict[str, Any]
    where: str
    layer_range: list[int] | None = None


def translate(data: dict, path: str = "") -> dict:
    """The clmerge recipe mapping of the mergekit config ``data`` (read from ``path``, named in errors).

    Raises:
        ConfigError: a key or value clmerge does not support, one line naming the file, the key and why.
    """
    try:
        return _translate(data)
    except _Refused as exc:
        raise ConfigError(f"{path}: mergekit config: {exc}" if path else f"mergekit config: {exc}") from None


def _translate(data: dict) -> dict:
    for key in data:
        if key not in _TOP_KEYS | _FLAG_KEYS:
            raise _Refused(key, UNSUPPORTED.get(key, "not a mergekit key clmerge reads (it reads "
                                                     + ", ".join(sorted(_TOP_KEYS)) + ")"))
    name = data["merge_method"]
    spec = METHODS.get(name) if isinstance(name, str) else None
    if isinstance(spec, str):
        raise _Refused("merge_method", f"{name}: {spec}")
    if spec is None:
        raise _Refused("merge_method", f"unknown mergekit method {name!r}; known: {', '.join(sorted(METHODS))}")
    base = _model_ref(data.get("base_model"), "base_model") if data.get("base_model") is not None else None
    entries, slices = _entries(data)
    out: dict[str, Any] = {"method": spec.target}
    if spec.needs_base and base is None:
        raise _Refused("base_model", f"mergekit's {name} needs a base_model")
    g = data.get("parameters") or {}
    if not isinstance(g, dict):
        raise _Refused("parameters", "expected a mapping of parameter names to settings")
    params, overrides, per_model = _parameters(name, spec, g, entries, base, slices)
    if base is not None and spec.kind not in ("linear", "passthrough"):
        out["base"] = base  # passthrough slices take the non-layer tensors from the slices, as mergekit
    if name == "karcher" and base is not None:
        params["include_base"] = True
    out.update(_layout(spec, entries, slices, base, per_model))
    if params:
        out["parameters"] = params
    if overrides:
        out["overrides"] = overrides
    if slices is not None and base is not None and spec.kind != "passthrough":
        out["outer_tensors"] = "slices"  # mergekit merges the embeddings and the head from the slices' sources
    out.update(_dtypes(data))
    out.update(_tokenizer(data, base, entries))
    out.update({k: data[k] for k in _FLAG_KEYS if data.get(k) is not None})
    return out


def _model_ref(v: Any, where: str) -> str:
    if not isinstance(v, str) or not v:
        raise _Refused(where, f"expected a model path or hub id, got {v!r}")
    if "+" in v and not Path(v).exists():  # mergekit reads "model+lora" as a model with a LoRA applied
        raise _Refused(where, f"{v!r}: a model with a LoRA applied (mergekit's 'model+lora') is not supported; "
                              "give the adapter folder itself as a model (read as base + delta W)")
    return v


def _entries(data: dict) -> tuple[list[_Entry], list[list[_Entry]] | None]:
    """The models (``models:``) or the slices' sources, each with its parameters."""
    if "slices" in data and "models" in data:
        raise _Refused("slices", "give models or slices, not both (as mergekit)")
    if "slices" in data:
        if not isinstance(data["slices"], list) or not data["slices"]:
            raise _Refused("slices", "expected a non-empty list of slices")
        slices = []
        for i, sl in enumerate(data["slices"]):
            if not isinstance(sl, dict) or "sources" not in sl:
                raise _Refused(f"slices[{i}]", "expected {sources: [...]}")
            for key in sl:
                if key != "sources":
                    raise _Refused(f"slices[{i}].{key}", UNSUPPORTED.get(f"slices[].{key}", "not a slice key"))
            srcs = []
            for j, s in enumerate(sl["sources"] or []):
                where = f"slices[{i}].sources[{j}]"
                if not isinstance(s, dict) or set(s) - {"model", "layer_range", "parameters"}:
                    raise _Refused(where, "expected {model, layer_range, parameters}")
                if "layer_range" not in s:
                    raise _Refused(f"{where}.layer_range", "required")
                srcs.append(_Entry(_model_ref(s.get("model"), f"{where}.model"), _params_map(s, where), where,
                                   list(s["layer_range"])))
            slices.append(srcs)
        return [e for srcs in slices for e in srcs], slices
    models = data.get("models")
    if not isinstance(models, list) or not models:
        raise _Refused("models", "expected a non-empty list of models (or slices)")
    out = []
    for i, m in enumerate(models):
        where = f"models[{i}]"
        if isinstance(m, str):
            m = {"model": m}
        if not isinstance(m, dict) or set(m) - {"model", "parameters"}:
            raise _Refused(where, "expected {model: PATH, parameters: {...}}")
        out.append(_Entry(_model_ref(m.get("model"), f"{where}.model"), _params_map(m, where), where))
    return out, None


def _params_map(m: dict, where: str) -> dict:
    p = m.get("parameters") or {}
    if not isinstance(p, dict):
        raise _Refused(f"{where}.parameters", "expected a mapping")
    return p


def _parameters(name: str, spec: Method, g: dict, entries: list[_Entry], base: str | None,
                slices: list | None) -> tuple[dict, list, dict]:
    """clmerge's global parameters, overrides and per-model parameters (``{entry index: {...}}``)."""
    for k in g:
        if k not in spec.globals_ and k not in spec.per_model:
            raise _Refused(f"parameters.{k}", f"not a parameter of mergekit's {name} (it takes "
                                              f"{', '.join(sorted({**spec.globals_, **spec.per_model})) or 'none'})")
    others = [e for e in entries if e.model != base] if spec.kind not in ("linear",) else entries
    for e in others:
        for k in e.parameters:
            if k not in spec.per_model:
                raise _Refused(f"{e.where}.parameters.{k}", f"not a per-model parameter of mergekit's {name} "
                                                            f"(it takes {', '.join(sorted(spec.per_model)) or 'none'})")
    settings: dict[str, Setting] = {}
    for k, default in spec.globals_.items():
        s = _layered(None, parse_setting(g[k], f"parameters.{k}") if k in g else None,
                     None if default is REQUIRED else default)
        if s.fallback is None and not s.conds and default is REQUIRED:
            raise _Refused(f"parameters.{k}", f"mergekit's {name} requires it")
        settings[k] = s
    per_model: dict[int, dict] = {}
    pm_settings: dict[str, list[Setting]] = {}
    for k, default in spec.per_model.items():
        gs = parse_setting(g[k], f"parameters.{k}") if k in g else None
        raw = [e.parameters.get(k) for e in others]
        if all(r == raw[0] for r in raw) and not (k == "weight" and spec.kind in ("linear", "weights")
                                                  and _plain_weights(raw, gs)):
            over = parse_setting(raw[0], f"{others[0].where}.parameters.{k}") if raw and raw[0] is not None else None
            s = _layered(over, gs, None if default is REQUIRED else default)
            if default is REQUIRED and s.fallback is None and others:
                raise _Refused(f"{others[0].where}.parameters.{k}", f"mergekit's {name} requires a {k} for every "
                                                                    "model (or in parameters)")
            settings[k] = s
            continue
        if k == "weight" and spec.kind in ("linear", "weights"):  # clmerge's per-expert ``weights``
            for i, e in enumerate(others):
                s = _layered(parse_setting(raw[i], f"{e.where}.parameters.weight") if raw[i] is not None else None,
                             gs, None)
                if not s.plain() or s.fallback is None:
                    raise _Refused(f"{e.where}.parameters.weight", "per-model weights that differ between models "
                                   "must be plain numbers here (a gradient or filter per model is not supported)")
                per_model[i] = {"weight": float(s.fallback)}
            continue
        if (spec.target, k) in _PER_EXPERT and slices is None:  # clmerge's per-expert list (weights, densities)
            pm_settings[k] = _per_model_settings(others, raw, gs, default, k, name)
            continue
        i = next(i for i, r in enumerate(raw) if r != raw[0])
        raise _Refused(f"{others[i].where}.parameters.{k}",
                       f"differs from {others[0].where}'s ({raw[i]!r} vs {raw[0]!r}); clmerge's {spec.target} takes "
                       f"one {k} for all models: give every model the same value")
    params, overrides = _method_params(name, spec, settings, len(_experts_per_slice(others, slices, base)),
                                       per_model, pm_settings)
    for k, per in pm_settings.items():
        name_, target, fn = _PER_EXPERT[(spec.target, k)]
        per = [s.map(fn) for s in per] if fn is not None else per
        for i, s in enumerate(per):
            per_model.setdefault(i, {})[name_] = list(s.fallback) if isinstance(s.fallback, list) else s.fallback
        overrides += _per_expert_overrides(target, per)
    return params, overrides, per_model


def _drop_rate(density: float) -> float:
    return max(0.0, 1.0 - density)


#: (clmerge method, mergekit per-model parameter) -> (clmerge per-model key, the per-expert list it feeds, the
#: map of mergekit's value or None), where values that differ between models are read per model
_PER_EXPERT = {("ties", "density"): ("density", "densities", None), ("ties", "weight"): ("weight", "weights", None),
               ("dare", "density"): ("drop_rate", "drop_rates", _drop_rate),
               ("dare", "weight"): ("weight", "weights", None)}
_MAX_FILTERS = 6  # distinct filters of a per-model parameter: 2^6 - 1 overrides at most


def _per_model_settings(others: list[_Entry], raw: list, gs: Setting | None, default: Any, k: str,
                        name: str) -> list[Setting]:
    """Each model's own setting of ``k`` (its value over the global one over mergekit's default)."""
    out = []
    for e, r in zip(others, raw):
        s = _layered(parse_setting(r, f"{e.where}.parameters.{k}") if r is not None else None, gs,
                     None if default is REQUIRED else default)
        if s.fallback is None:
            raise _Refused(f"{e.where}.parameters.{k}", f"mergekit's {name} requires a {k} for every tensor: give "
                                                        "a value without a filter (or one in parameters)")
        out.append(s)
    return out


def _per_expert_overrides(target: str, per: list[Setting]) -> list[dict]:
    """Overrides that set the per-expert list ``target`` where a model's filters apply.

    A tensor's value for each model is its first filter that is a substring of the name (mergekit), so the
    value depends on which of the filters match: one override per set of matching filters, its pattern
    requiring those and excluding the others (the sets exclude each other, so their order does not matter).
    Sets that change no model's value are left out."""
    filters = list(dict.fromkeys(f for s in per for f, _ in s.conds))
    if len(filters) > _MAX_FILTERS:
        raise _Refused(f"parameters.{target}", f"more than {_MAX_FILTERS} distinct filters across the models' "
                                               "per-model values are not supported")
    out = []
    for mask in range(1, 1 << len(filters)):
        hit = [f for j, f in enumerate(filters) if mask >> j & 1]
        values = [next((v for f, v in s.conds if f in hit), s.fallback) for s in per]
        if values == [s.fallback for s in per]:
            continue
        if len(filters) == 1:
            pattern = re.escape(filters[0])
        else:
            pattern = "^" + "".join(f"(?=.*{re.escape(f)})" if f in hit else f"(?!.*{re.escape(f)})"
                                    for f in filters)
        out.append({"pattern": "re:" + pattern,
                    "parameters": {target: [list(v) if isinstance(v, list) else v for v in values]}})
    return out


def _plain_weights(raw: list, gs: Setting | None) -> bool:
    """Whether every model's weight (its own, else the global one) is a plain number."""
    return all(_layered(parse_setting(r, "weight") if r is not None else None, gs, None).plain()
               and _layered(parse_setting(r, "weight") if r is not None else None, gs, None).fallback is not None
               for r in raw)


def _experts_per_slice(others: list[_Entry], slices: list | None, base: str | None) -> list[_Entry]:
    if slices is None:
        return others
    return [s for s in slices[0] if s.model != base]


def _plain(s: Setting, key: str) -> Any:
    if not s.plain():
        raise _Refused(f"parameters.{key}", "a gradient or filter is not supported for this parameter")
    return s.fallback


def _method_params(name: str, spec: Method, st: dict[str, Setting], n: int, per_model: dict,
                   pm_settings: dict[str, list[Setting]] | None = None) -> tuple[dict, list]:
    """clmerge's parameters and overrides from mergekit's settings ``st`` (``n``: experts merged);
    ``pm_settings``: the parameters read per model (fed to a per-expert list, not set here)."""
    pm_settings = pm_settings or {}
    out: dict[str, Setting] = {k: Setting(v) for k, v in spec.fixed.items()}
    st = dict(st)
    st.pop("int8_mask", None)  # a storage choice of mergekit's masks: no effect on the result
    if spec.kind == "gta":
        lam, normalize = float(_plain(st.pop("lambda"), "lambda")), bool(_plain(st.pop("normalize"), "normalize"))
        rescale = bool(_plain(st.pop("rescale"), "rescale"))
        weight = st.pop("weight", None)
        if spec.consensus:
            out["merge_fn"] = Setting("mean" if normalize else "sum")
            # per-model weights weight the election and the merge themselves (the method's weights)
            out["scaling"] = Setting(lam) if normalize or weight is None else weight.map(lambda w: w * lam)
        elif weight is None:  # per-model weights: the method's weights, lambda as the scaling
            if normalize:
                raise _Refused("parameters.normalize", f"normalize: true with per-model weights that differ is not "
                                                       f"supported for {name} (a sum of weights per tensor)")
            out["scaling"] = Setting(lam)
        else:
            out["scaling"] = Setting(lam / n) if normalize and n else weight.map(lambda w: w * lam)
        density = st.pop("density", None)
        if spec.target == "dare":
            if density is not None:  # else per model (drop_rates)
                out["drop_rate"] = density.map(_drop_rate)
            out["rescale"] = Setting(rescale)
            if rescale:
                out["rescale_rule"] = Setting("l1")  # mergekit rescales to the tensor's L1 norm
        elif spec.target in ("della", "della_linear"):
            out["density"] = density
            out["epsilon"] = st.pop("epsilon").map(lambda e: 2.0 * e)  # mergekit's half-width, clmerge's width
            out["rescale"] = Setting("l1" if rescale else "none")
        else:
            if rescale:
                raise _Refused("parameters.rescale", f"mergekit's L1 rescale of {name}'s sparsified task vectors "
                                                     "is not supported (rescale: false is)")
            if spec.target != "task_arithmetic" and density is not None:  # task_arithmetic never uses it
                out["density"] = density
    elif spec.kind == "linear":
        normalize = bool(_plain(st.pop("normalize"), "normalize"))
        st.pop("weight", None)  # per model (plain numbers), or the same setting for every model: an equal average
        total = sum(p["weight"] for p in per_model.values()) if per_model else None
        if not normalize and (total is None or not math.isclose(total, 1.0, rel_tol=0, abs_tol=1e-12)):
            raise _Refused("parameters.normalize", "normalize: false with weights that do not sum to 1 (an "
                                                   "unnormalised sum of models) is not supported")
    elif spec.kind == "weights":
        st.pop("weight", None)  # equal weights unless given per model
    elif spec.kind == "passthrough":
        scale = st.pop("scale")
        if scale.fallback is not None or scale.conds:
            raise _Refused("parameters.scale", "passthrough's scale is not supported")
    if name == "model_stock" and _plain(st.pop("filter_wise"), "filter_wise"):
        raise _Refused("parameters.filter_wise", "model_stock's filter_wise (per-row ratios) is not supported")
    for k, s in st.items():
        out[_RENAMES.get(k, k)] = s
    return _emit(out)


def _emit(settings: dict[str, Setting]) -> tuple[dict, list]:
    params = {k: s.fallback for k, s in settings.items() if s.fallback is not None}
    overrides = []
    for k, s in settings.items():
        for flt, v in reversed(s.conds):  # a later override wins; mergekit's first matching filter wins
            overrides.append({"pattern": "re:" + re.escape(flt), "parameters": {k: v}})
    return params, overrides


def _layout(spec: Method, entries: list[_Entry], slices: list | None, base: str | None,
            per_model: dict[int, dict]) -> dict:
    """``models`` or ``slices`` (the base left out of the models of a method with a base)."""
    others = [e for e in entries if e.model != base] if spec.kind != "linear" else entries
    if slices is None:
        if spec.kind == "passthrough":
            if len(entries) != 1:
                raise _Refused("models", "passthrough with models copies one model; give slices to stack layers")
            return {"method": "weight_average", "models": [{"model": entries[0].model}]}
        if spec.kind == "linear" and base is not None and base not in [e.model for e in entries]:
            raise _Refused("base_model", "linear with a base_model that is not among the models is not supported "
                                         "(mergekit gives the base no weight)")
        return {"models": [{"model": e.model, **({"parameters": per_model[i]} if i in per_model else {})}
                           for i, e in enumerate(others)]}
    index = {id(e): i for i, e in enumerate(others)}
    return {"slices": [{"sources": [{"model": s.model, "layer_range": s.layer_range,
                                     **({"parameters": per_model[index[id(s)]]} if index.get(id(s)) in per_model
                                        else {})} for s in srcs]} for srcs in slices]}


def _dtypes(data: dict) -> dict:
    out = {}
    for key in ("out_dtype", "dtype"):
        v = data.get(key)
        if v is None:
            continue
        if v not in _DTYPES:
            raise _Refused(key, f"expected one of {', '.join(sorted(_DTYPES))}, got {v!r}")
        out.setdefault("out_dtype", _DTYPES[v])
    return out


def _tokenizer(data: dict, base: str | None, entries: list[_Entry]) -> dict:
    src = data.get("tokenizer_source")
    where = "tokenizer_source"
    tok = data.get("tokenizer")
    if tok is not None:
        if src is not None:
            raise _Refused("tokenizer", "give tokenizer_source or tokenizer, not both (as mergekit)")
        if not isinstance(tok, dict):
            raise _Refused("tokenizer", "expected {source: ...}")
        for k in tok:
            if k != "source":
                raise _Refused(f"tokenizer.{k}", UNSUPPORTED.get(f"tokenizer.{k}", "not a tokenizer key"))
        src, where = tok.get("source"), "tokenizer.source"
    out: dict[str, Any] = {}
    if src in ("base", "union"):
        out["embeddings"] = src
    elif src is not None:
        model = src[len("model:"):] if isinstance(src, str) and src.startswith("model:") else src
        out.update(tokenizer_from=_model_ref(model, where), embeddings="base")
    ct = data.get("chat_template")
    if ct is not None:
        names = {e.model for e in entries} | ({base} if base else set())
        if ct not in names:
            raise _Refused("chat_template", f"{str(ct)[:40]!r}: clmerge takes the chat template of one of the "
                                            "inputs (give its model name); a named or literal template, or "
                                            "'auto', is not supported")
        out["chat_template_from"] = ct
    return out
