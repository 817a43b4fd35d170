"""Merge recipes: the YAML that ``clmerge merge RECIPE.yaml`` reads (the flag form builds the same object).

```yaml
method: ties
base: path/or/org-name
models:
  - model: path/to/expert_a
    parameters: {weight: 1.0}          # per-model values feed the method's per-expert list (weights)
  - model: path/to/expert_b
parameters: {density: 0.2, scaling: 1.0}   # global hyperparameters
overrides:                              # later entries win; "re:" starts a regular expression
  - pattern: "*.self_attn.*"
    parameters: {density: [0.1, 0.5]}   # a list: interpolated over the layer index (a depth gradient)
out_dtype: bfloat16                     # default: the base's dtype
compute_dtype: float32                  # float32 | float64 | bfloat16 | float16 | input
tokenizer_from: path                    # default: the base
out_shard_size: 5GB
# models whose vocabularies differ (docs/merging_checkpoints.md, "Models with different vocabularies"):
embeddings: union                       # base | union | intersection; unset: rows merged by index
fill: present                           # a token an input lacks: present | mean | zero
chat_template_from: path/to/expert_a    # the chat template of this input (default: the reference's)
```

A mergekit config (a mapping with mergekit's ``merge_method`` key) is read as it is: :mod:`.mergekit_config`
translates it into this format first (the one place that reads mergekit keys). Method names that other tools
use (``linear``, ``ta``, ``dare_ties``, ``dare_linear``) name the clmerge method of the same definition
(:data:`~.methods.registry.ALIASES`).

A frankenmerge lists ``slices`` instead of ``models`` (mergekit's ``slices:``): each slice's ``sources`` give a model
and a half-open ``layer_range: [a, b]``; one source is copied (``method: passthrough``), several are merged
with ``method`` layer by layer. A recipe can also define named ``stages`` (each a full recipe with a ``name``)
whose results later stages and the final merge use as inputs by that name (:mod:`.slices`, :mod:`.run`).

Keys are grouped by equal hyperparameters and each group is merged on its own (a method's global statistics,
such as TIES's model-wide top-k, are then per group).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from typing import Any, Literal

import yaml
from pydantic import Field, PrivateAttr, field_validator, model_validator

from ..utils.dtypes import DtypeName
from ..config import ConfigError, StrictModel, check_keys, read_yaml_mapping, validate_strict

__all__ = ["PASSTHROUGH", "PINNED", "ModelEntry", "Override", "Recipe", "Slice", "SliceSource", "key_groups",
           "layer_index", "load_recipe", "recipe_of"]



class ModelEntry(StrictModel):
    model: str
    parameters: dict[str, Any] = Field(default_factory=dict)


class Override(StrictModel):
    pattern: str
    parameters: dict[str, Any]

    @field_validator("pattern")
    @classmethod
    def _valid_regex(cls, v: str) -> str:
        if v.startswith("re:"):
            try:
                re.compile(v[3:])
            except re.error as exc:
                raise ValueError(f"invalid regular expression {v[3:]!r}: {exc}") from None
        return v

    def matches(self, key: str) -> bool:
        if self.pattern.startswith("re:"):
            return re.search(self.pattern[3:], key) is not None
        return fnmatch.fnmatchcase(key, self.pattern)


# --- layer slices and stages (frankenmerges, multi-stage recipes) ---

PASSTHROUGH = "passthrough"  # the method name of a slice recipe whose slices each copy one source


class SliceSource(StrictModel):
    model: str
    layer_range: list[int] = Field(min_length=2, max_length=2)  # [first, end): half-open, as mergekit
    parameters: dict[str, Any] = Field(default_factory=dict)


class Slice(StrictModel):
    sources: list[SliceSource] = Field(min_length=1)


def _check_layout(recipe: Recipe) -> Recipe:
    """Exactly one of ``models`` and ``slices``; stage names given, unique, and only at the top level."""
    if bool(recipe.models) == bool(recipe.slices):
        raise ValueError("give either models (a merge of whole models) or slices (layer ranges), not "
                         + ("both" if recipe.models else "neither"))
    if recipe.outer_tensors is not None and not recipe.slices:
        raise ValueError("outer_tensors applies to slice recipes (slices:), not to models:")
    if recipe.method == PASSTHROUGH and not recipe.slices:
        raise ValueError("method passthrough copies layer ranges: it needs slices, not models")
    names = [s.name for s in recipe.stages]
    for i, stage in enumerate(recipe.stages):
        if not stage.name:
            raise ValueError(f"stages[{i}]: needs a name (the name later stages use as a model)")
        if stage.stages:
            raise ValueError(f"stages[{i}] ({stage.name}): stages cannot hold stages of their own")
        if names.index(stage.name) != i:
            first = names.index(stage.name)
            raise ValueError(f"stages[{i}]: the name {stage.name!r} is already used by stages[{first}]")
    return recipe


# --- end of layer slices and stages ---


class Recipe(StrictModel):
    method: str
    base: str | None = None
    models: list[ModelEntry] = Field(default_factory=list)
    parameters: dict[str, Any] = Field(default_factory=dict)
    overrides: list[Override] = Field(default_factory=list)
    out_dtype: DtypeName | None = None
    # the merge arithmetic: float32 (one rounding, when writing), float64, or mergekit's narrow arithmetic:
    # bfloat16 / float16 (inputs cast on reading), input (each key's own dtype); clmerge.merging.methods.trim
    compute_dtype: Literal["float32", "float64", "bfloat16", "float16", "input"] = "float32"
    tokenizer_from: str | None = None
    out_shard_size: str | int = "5GB"
    # vocabularies that differ: rows matched by token string (clmerge.merging.vocab)
    embeddings: Literal["base", "union", "intersection"] | None = None
    fill: Literal["present", "mean", "zero"] = "present"
    chat_template_from: str | None = None
    slices: list[Slice] = Field(default_factory=list)
    # a slice recipe's embeddings, final norm and head: copied from the base ("base", the default when a base
    # is given) or merged from the first / last slice's sources ("slices": mergekit's rule, also without a base)
    outer_tensors: Literal["base", "slices"] | None = None
    # a vision-language folder: which tower is merged and which kept from the base (clmerge.merging.towers)
    towers: dict[Literal["language", "vision"], Literal["merge", "base"]] | None = None
    name: str | None = None
    stages: list[Recipe] = Field(default_factory=list)

    _layout = model_validator(mode="after")(_check_layout)
    _recorded: str | None = PrivateAttr(default=None)

    def recorded_as(self, text: str | None) -> Recipe:
        """Record ``text`` in the output folder instead of this recipe (the final merge of a multi-stage
        recipe records the whole recipe, stage names and all, not the stages' temporary folders)."""
        self._recorded = text
        return self

    def to_yaml(self) -> str:
        """The recipe as YAML, as recorded in the output folder: defaults left out, except the keys of
        :data:`PINNED` set explicitly (:func:`~.run.effective_recipe` sets them: the recorded recipe merges the
        same after a later clmerge changes their default)."""
        if self._recorded is not None:
            return self._recorded
        return yaml.safe_dump(_dump(self), sort_keys=False)


#: recipe keys whose default decides the output (its arithmetic, its files, a slice recipe's outer tensors, a
#: merged vocabulary's stand-in rows): written out when set, even at their default
PINNED = ("compute_dtype", "out_shard_size", "fill", "outer_tensors")


def _dump(recipe: Recipe) -> dict[str, Any]:
    """``recipe`` as a mapping without its defaults, the explicitly set :data:`PINNED` keys kept (field order)."""
    data = recipe.model_dump(exclude_defaults=True)
    kept = [k for k in PINNED if k in recipe.model_fields_set and k not in data]
    if kept:
        every = recipe.model_dump()
        data = {k: every[k] for k in every if k in data or k in kept}
    if recipe.stages:
        data["stages"] = [_dump(s) for s in recipe.stages]
    return data


def load_recipe(path: str, data: dict | None = None) -> Recipe:
    """Read and validate a recipe file (or validate ``data`` read from ``path``): :func:`recipe_of`."""
    return recipe_of(read_yaml_mapping(path, "merge recipe") if data is None else data, path)


def recipe_of(data: dict, path: str = "") -> Recipe:
    """Validate a recipe mapping (read from ``path``, named in errors): unknown keys name the nearest valid key,
    bad values name their key. A mergekit config is translated first (:func:`.mergekit_config.translate`)."""
    from .mergekit_config import is_mergekit, translate

    if is_mergekit(data):
        data = translate(data, path)
    data = _normalize(_aliased(data), "")
    try:
        return validate_strict(Recipe, data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}" if path else str(exc)) from None


def _aliased(data: dict) -> dict:
    """``method: linear`` -> ``weight_average`` (and ``dare_ties`` -> ``dare`` with ``combine: ties``): an alias
    names its method, its fixed hyperparameters fill in what the recipe does not give."""
    from .methods.registry import ALIASES

    method = data.get("method")
    if not isinstance(method, str) or method not in ALIASES:
        return data
    target, fixed = ALIASES[method]
    params = data.get("parameters")
    params = {**fixed, **params} if isinstance(params, dict) else params if params is not None else dict(fixed)
    return {**data, "method": target, **({"parameters": params} if params else {})}


def _normalize(data: dict, where: str) -> dict:
    """Plain model strings become ``{model: ...}``; unknown keys in nested entries name the nearest valid key."""
    models = data.get("models")
    if isinstance(models, list):
        data = {**data, "models": [{"model": m} if isinstance(m, str) else m for m in models]}
        for i, m in enumerate(data["models"]):
            check_keys(m, ModelEntry, f"{where}models[{i}].")
    for i, o in enumerate(data.get("overrides") or []):
        check_keys(o, Override, f"{where}overrides[{i}].")
    for i, sl in enumerate(data.get("slices") or []):
        if isinstance(sl, list):  # a bare list of sources
            data = {**data, "slices": [*data["slices"][:i], {"sources": sl}, *data["slices"][i + 1:]]}
            sl = data["slices"][i]
        check_keys(sl, Slice, f"{where}slices[{i}].")
        for j, src in enumerate(sl.get("sources") or [] if isinstance(sl, dict) else []):
            check_keys(src, SliceSource, f"{where}slices[{i}].sources[{j}].")
    stages = data.get("stages")
    if isinstance(stages, list):
        data = {**data, "stages": [_normalize(st, f"{where}stages[{i}].") if isinstance(st, dict) else st
                                   for i, st in enumerate(stages)]}
    return data


_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_index(key: str) -> int | None:
    """The layer number in a parameter name (``model.layers.7.mlp.up_proj.weight`` -> 7), or ``None``."""
    m = _LAYER.search(key)
    return int(m.group(1)) if m else None


def _interpolate(values: Sequence[float], t: float) -> float:
    """Piecewise-linear value at ``t`` in [0, 1] of ``values`` spread evenly over [0, 1]."""
    if len(values) == 1:
        return float(values[0])
    pos = t * (len(values) - 1)
    i = min(int(pos), len(values) - 2)
    return float(values[i]) + (pos - i) * (float(values[i + 1]) - float(values[i]))


def key_groups(keys: Sequence[str], parameters: dict[str, Any], overrides: Sequence[Override],
               list_params: set[str]) -> list[tuple[dict[str, Any], list[str]]]:
    """Partition ``keys`` into groups with equal hyperparameters.

    Each key starts from ``parameters``; every override whose pattern matches it updates them (in order). A
    list value for a hyperparameter that is not a per-expert list (``list_params``) is a depth gradient: the
    value at ``t = layer / (num_layers - 1)`` of the list spread evenly over [0, 1]; keys without a layer
    number take the first value. An entry of a per-expert list that is itself a list is that expert's depth
    gradient, interpolated the same way (``densities: [[1, 0.5], 0.3]``).

    Returns:
        ``[(hyperparameters, keys)]`` in the order each group's first key appears.
    """
    layers = [i for i in map(layer_index, keys) if i is not None]
    span = max(layers) if layers else 0
    groups: dict[tuple, tuple[dict[str, Any], list[str]]] = {}
    for key in keys:
        hp = dict(parameters)
        for o in overrides:
            if o.matches(key):
                hp.update(o.parameters)
        layer = layer_index(key)
        t = (layer or 0) / span if span else 0.0
        for name, v in hp.items():
            if isinstance(v, list) and name not in list_params:
                hp[name] = _interpolate(v, t)
            elif isinstance(v, list) and any(isinstance(e, list) for e in v):  # an expert's own gradient
                hp[name] = [_interpolate(e, t) if isinstance(e, list) else e for e in v]
        sig = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in hp.items()))
        groups.setdefault(sig, (hp, []))[1].append(key)
    return list(groups.values())
