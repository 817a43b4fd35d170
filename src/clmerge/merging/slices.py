"""Layer slicing (frankenmerges): an output model whose layers are layer ranges of other models, stacked.

A recipe's ``slices`` (mergekit's ``slices:``) list output slices in order; each has ``sources``, each a model and
a half-open ``layer_range: [a, b]``. A slice of one source copies layers ``a..b-1``; a slice of several
sources (all covering the same number of layers) merges them layer by layer with the recipe's method, the
source whose model is the recipe's ``base`` serving as the base. The output's per-layer keys
(``model.layers.{i}.``) are renumbered ``0..N-1`` in slice order and ``num_hidden_layers`` in ``config.json``
becomes ``N``.

The non-layer tensors (embeddings, final norm, ``lm_head``) come from the recipe's ``base`` when it names one
(``outer_tensors: base``, the default then); otherwise, and with ``outer_tensors: slices``, as mergekit: the
embeddings come from the first slice's sources and the other non-layer tensors from the last slice's, merged
when that slice has several sources (the base among them serving as the base; keys without a layer number take
a gradient's first value). mergekit does this with or without a base, so a mergekit config read by
:mod:`.mergekit_config` sets ``outer_tensors: slices``. Depth gradients in ``overrides`` run over
each slice's own layers (``t = i / (n - 1)`` within the slice, as mergekit). Everything streams: one tensor
per source at a time.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ..errors import InputError
from ..utils import inpaths
from ..utils.dtypes import config_dtype, to_dtype
from ..utils.inpaths import read_bytes
from .methods.hparams import check_hyperparameters, method_hparams, per_model_params
from .io.base import MergeInputError
from .io.checks import is_finite
from .io.output import FolderJob, OutputFolder, model_files
from .preflight import check_architectures
from .io.readers import open_checkpoint, resolve_hub_id
from .io.writer import parse_size
from .recipes import PASSTHROUGH, Recipe, key_groups
from .methods.registry import MergeMethod
from .methods.sources import ModelSet
from .methods.trim import input_dtype_arithmetic

__all__ = ["LAYER_KEY", "SlicePlan", "plan_slices", "execute_slices", "split_layer_key"]

# a per-layer key: "<prefix>.layers.<i>.<rest>" (Llama, Mistral, Qwen), also GPT-2's ".h.<i>." and ".blocks.<i>."
LAYER_KEY = re.compile(r"^(?P<head>(?:.*\.)?(?:layers|h|blocks))\.(?P<i>\d+)\.(?P<tail>.+)$")
_EMBED = re.compile(r"embed|(?:^|\.)(?:wte|wpe)\.")
_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def split_layer_key(key: str) -> tuple[str, int, str] | None:
    """``model.layers.7.mlp.up_proj.weight`` -> ``("model.layers", 7, "mlp.up_proj.weight")``; else ``None``."""
    m = LAYER_KEY.match(key)
    return (m["head"], int(m["i"]), m["tail"]) if m else None


class RenamedSource:
    """A view of ``src`` under other key names: ``keys`` maps each output key to the key it reads."""

    def __init__(self, src: Any, keys: dict[str, str]) -> None:
        self.src, self._keys = src, keys
        self.name, self.files, self.folder = src.name, getattr(src, "files", []), getattr(src, "folder", None)

    def keys(self) -> list[str]:
        return list(self._keys)

    def meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        return self.src.meta(self._keys[key])

    def get(self, key: str) -> torch.Tensor:
        return self.src.get(self._keys[key])

    def source_key(self, key: str) -> str:
        """The input's name for the output key ``key``."""
        return self._keys[key]


@dataclass
class Segment:
    """Output keys made from the same sources: one slice's layers, or the non-layer keys before / after them."""

    label: str
    entries: list[Any]  # SliceSource-like (model, parameters) per source
    views: list[RenamedSource]
    local: dict[str, str] = field(default_factory=dict)  # output key -> the key as numbered within the slice


@dataclass
class SlicePlan:
    """A checked slice recipe: the segments in output order, the output tensors and the layer count."""

    recipe: Recipe
    sources: dict[str, Any]
    segments: list[Segment]
    plan: list[tuple[str, tuple[int, ...], torch.dtype]]
    num_layers: int
    layer_types: list[Any] | None = None
    method: Any = None  # the registered merge method (None: passthrough)
    model_folder: Path | None = None  # whose config is copied (the base's, else the first source's)
    tokenizer_folder: Path | None = None  # whose tokenizer files are copied
    config_dtype: torch.dtype | None = None  # what the output's config.json records
    config_updates: dict[str, Any] = field(default_factory=dict)  # the new layer count (and layer types)


def _open_all(recipe: Any) -> dict[str, Any]:
    refs = [(f"slices[{i}].sources[{j}]", s.model) for i, sl in enumerate(recipe.slices)
            for j, s in enumerate(sl.sources)]
    refs += [("base", recipe.base)] if recipe.base else []
    opened: dict[str, Any] = {}
    for where, model in refs:
        if model in opened:
            continue
        try:
            opened[model] = open_checkpoint(model, name=model)
        except (FileNotFoundError, MergeInputError) as exc:
            raise MergeInputError(f"{where}: model {model!r}: {exc}") from None
    return opened


def _layers(src: Any) -> dict[int, list[str]]:
    """``{layer index: [key tails]}`` of a source, in its key order."""
    out: dict[int, list[str]] = {}
    for key in src.keys():
        parts = split_layer_key(key)
        if parts is not None:
            out.setdefault(parts[1], []).append(key)
    return out


def _check_range(where: str, model: str, rng: list[int], n: int) -> None:
    a, b = rng
    if not 0 <= a < b <= n:
        raise MergeInputError(f"{where}: layer_range [{a}, {b}] does not fit {model}, which has {n} layers "
                              f"(expected 0 <= first < end <= {n}; the end is excluded)")


def _slice_segment(i: int, sl: Any, sources: dict[str, Any], start: int, ref: dict[str, tuple]) -> Segment:
    """The output keys of slice ``i`` (output layers from ``start``), checked against the reference shapes ``ref``
    (``{head.tail: shape}`` of the first slice's layers; filled by the first slice)."""
    where = f"slices[{i}]"
    counts = [s.layer_range[1] - s.layer_range[0] for s in sl.sources]
    for j, s in enumerate(sl.sources):
        _check_range(f"{where}.sources[{j}]", s.model, s.layer_range, len(_layers(sources[s.model])))
    if len(set(counts)) > 1:
        shown = ", ".join(f"{c} from {s.model}" for c, s in zip(counts, sl.sources))
        raise MergeInputError(f"{where}: its sources cover different numbers of layers ({shown}); expected the "
                              "same count from every source of a slice")
    seg = Segment(where, list(sl.sources), [])
    maps: list[dict[str, str]] = [{} for _ in sl.sources]
    for idx in range(counts[0]):
        first = sl.sources[0]
        for key in _layers(sources[first.model])[first.layer_range[0] + idx]:
            head, _, tail = split_layer_key(key)
            out_key = f"{head}.{start + idx}.{tail}"
            seg.local[out_key] = f"{head}.{idx}.{tail}"
            for j, s in enumerate(sl.sources):
                in_key = f"{head}.{s.layer_range[0] + idx}.{tail}"
                shape = _shape_of(sources[s.model], in_key, f"{where}.sources[{j}]", s.model)
                want = ref.setdefault(f"{head}.{tail}", (shape, f"{where}.sources[{j}] ({s.model})"))
                if tuple(shape) != tuple(want[0]):
                    raise MergeInputError(f"{where}.sources[{j}]: {s.model} key {in_key!r} has shape {list(shape)}, "
                                          f"but {want[1]} has {list(want[0])}; expected equal shapes in every "
                                          "output layer")
                maps[j][out_key] = in_key
    seg.views = [RenamedSource(sources[s.model], m) for s, m in zip(sl.sources, maps)]
    return seg


def _shape_of(src: Any, key: str, where: str, model: str) -> tuple[int, ...]:
    try:
        return tuple(src.meta(key)[0])
    except KeyError:
        raise MergeInputError(f"{where}: {model} has no key {key!r}; expected the same layer keys in every "
                              "source") from None


def _outer_segments(recipe: Any, sources: dict[str, Any]) -> tuple[Segment, Segment]:
    """The non-layer keys: embeddings (before the layers) and the rest (after), with the sources they come from."""
    if recipe.base and recipe.outer_tensors != "slices":
        first = last = [SimpleNamespace(model=recipe.base, parameters={})]
    else:
        first, last = recipe.slices[0].sources, recipe.slices[-1].sources
    ref = sources[first[0].model]
    outer = [k for k in ref.keys() if split_layer_key(k) is None]
    pre = [k for k in outer if _EMBED.search(k)]
    post = [k for k in outer if not _EMBED.search(k)]
    segs = []
    for label, entries, keys in (("embeddings", first, pre), ("final norm and head", last, post)):
        for j, e in enumerate(entries):
            for k in keys:
                _shape_of(sources[e.model], k, label, e.model)
        segs.append(Segment(label, list(entries), [RenamedSource(sources[e.model], {k: k for k in keys})
                                                    for e in entries]))
    return segs[0], segs[1]


def plan_slices(recipe: Recipe, method: MergeMethod | None) -> SlicePlan:
    """Open the slice recipe's models (headers only) and check every slice; raises one-line errors naming it.
    ``method``: the recipe's, resolved by :func:`clmerge.merging.run.plan` (``None`` for passthrough)."""
    if method is not None:  # checked once, before anything is opened
        check_hyperparameters(method, {k: v for k, v in recipe.parameters.items() if k != "task"}, "parameters.")
    sources = _open_all(recipe)
    names = list(dict.fromkeys([*([recipe.base] if recipe.base else []), *sources]))  # the reference first
    check_architectures([sources[n] for n in names], [f"model {n}" for n in names],
                        fields=("model_type", "hidden_size"))  # headers and configs only; depths may differ
    segments, ref, start = [], {}, 0
    for i, sl in enumerate(recipe.slices):
        if recipe.method == PASSTHROUGH and len(sl.sources) > 1:
            raise MergeInputError(f"slices[{i}]: method passthrough copies one source per slice, this slice has "
                                  f"{len(sl.sources)}; name a merge method (e.g. weight_average) to merge them")
        segments.append(_slice_segment(i, sl, sources, start, ref))
        start += sl.sources[0].layer_range[1] - sl.sources[0].layer_range[0]
    pre, post = _outer_segments(recipe, sources)
    segments = [pre, *segments, post]
    out_dtype = to_dtype(recipe.out_dtype)
    plan = []
    for seg in segments:
        for key in seg.views[0].keys():
            shape, dtype = seg.views[0].meta(key)
            plan.append((key, tuple(shape), out_dtype if out_dtype is not None and dtype.is_floating_point else dtype))
    layer_types = _layer_types(recipe, sources)
    ref = getattr(sources[recipe.base or recipe.slices[0].sources[0].model], "folder", None)
    tok = _tokenizer_folder(recipe.tokenizer_from) if recipe.tokenizer_from else ref
    updates = {key: start for key in _LAYER_COUNT_KEYS} | ({"layer_types": layer_types} if layer_types is not None
                                                            else {})
    return SlicePlan(recipe, sources, segments, plan, start, layer_types, method, ref, tok, config_dtype(plan),
                     updates)


def _layer_types(recipe: Any, sources: dict[str, Any]) -> list[Any] | None:
    """The output's ``layer_types`` (per-layer attention kinds in newer configs), sliced as the layers are."""
    out = []
    for sl in recipe.slices:
        s = sl.sources[0]
        config = _read_config(sources[s.model])
        types = config.get("layer_types") if config else None
        if not isinstance(types, list):
            return None
        out += types[s.layer_range[0]:s.layer_range[1]]
    return out


def _read_config(src: Any) -> dict | None:
    """A source's ``config.json`` (``None`` without one, or when it is not JSON), checked and read through the
    input boundary (one leading out of the folder, a FIFO or a loop is refused by name)."""
    folder = getattr(src, "folder", None)
    files = model_files(Path(folder), None) if folder is not None else {}
    if "config.json" not in files:
        return None
    raw = read_bytes(files["config.json"], within=folder, what=f"{folder}: model file")
    try:
        data = inpaths.loads_json(raw, str(files["config.json"]))
    except InputError:
        return None
    return data if isinstance(data, dict) else None


def _copy_segment(seg: Segment, writer: Any) -> None:
    view = seg.views[0]
    for key in view.keys():
        tensor = view.get(key)
        if not is_finite(tensor):
            raise MergeInputError(f"{seg.label}: key {view.source_key(key)!r} in {view.name} contains NaN or Inf; "
                                  "expected finite weights")
        writer.write(key, tensor)


def _merge_segment(sp: SlicePlan, seg: Segment, writer: Any) -> None:
    """Merge a segment's sources with the recipe's method (the recipe's base, if among them, as the base)."""
    recipe, method = sp.recipe, sp.method
    hps = method_hparams(method)
    is_base = [e.model == recipe.base for e in seg.entries]
    base = seg.views[is_base.index(True)] if any(is_base) else None
    experts = [v for v, b in zip(seg.views, is_base) if not b]
    entries = [e for e, b in zip(seg.entries, is_base) if not b]
    if method.needs_base and base is None:
        raise MergeInputError(f"{seg.label}: {method.name} needs a base: list the recipe's base ({recipe.base}) "
                              "among this slice's sources" if recipe.base else
                              f"{seg.label}: {method.name} needs a base: set the recipe's base to one of its sources")
    params = {k: v for k, v in recipe.parameters.items() if k != "task"}  # checked by plan_slices
    per_model = per_model_params(method, hps, entries)
    models = ModelSet(base, experts, compute_dtype=recipe.compute_dtype)
    local = seg.local or {k: k for k in models.keys()}
    back = {v: k for k, v in local.items()}
    list_params = {n for n, h in hps.items() if h.is_list}
    models.sink = writer
    for hp, keys in key_groups([local[k] for k in models.keys()], {**params, **per_model}, recipe.overrides,
                               list_params):
        with input_dtype_arithmetic(models.narrow):  # compute_dtype bfloat16 / float16 / input
            res = method.fn(base=models.base, experts=models.subset([back[k] for k in keys]), **hp)
        if isinstance(res, dict):
            for k, v in res.items():
                writer.write(k, v)
        elif hasattr(res, "flush"):
            res.flush()


def _tokenizer_folder(spec: str) -> Path:
    """``tokenizer_from``: a local folder, else a hub id (fetched or found in the cache)."""
    if Path(spec).is_dir():
        return Path(spec)
    if Path(spec).exists():
        raise MergeInputError(f"tokenizer_from {spec}: is a file; expected a model folder with tokenizer files")
    return resolve_hub_id(spec)


def execute_slices(sp: SlicePlan, output: OutputFolder, *, log: Callable[[str], None] = lambda s: None) -> dict:
    """Stream the checked slice plan's output model into ``output`` (a folder, its model files checked);
    returns a summary."""
    recipe = sp.recipe

    def fill(writer: Any) -> None:
        for seg in sp.segments:
            (_copy_segment if len(seg.views) == 1 else lambda s, w: _merge_segment(sp, s, w))(seg, writer)

    output.write([FolderJob(sp.plan, fill, parse_size(recipe.out_shard_size), {"clmerge_method": recipe.method},
                            files=dict(model_folder=sp.model_folder, tokenizer_folder=sp.tokenizer_folder,
                                       dtype=sp.config_dtype, recipe_file="clmerge_recipe.yaml",
                                       recipe_yaml=recipe.to_yaml(), base_model=recipe.base,
                                       inputs=[("model", name, getattr(src, "files", []))
                                               for name, src in sp.sources.items()],
                                       config_updates=sp.config_updates))])
    log(f"sliced {len(recipe.slices)} slices into {sp.num_layers} layers ({len(sp.plan)} tensors)")
    return {"method": recipe.method, "keys": len(sp.plan), "out": str(output.out), "layers": sp.num_layers}
