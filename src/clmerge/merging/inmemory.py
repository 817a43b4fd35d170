"""Merges on loaded objects: a merged adapter added to a loaded ``peft.PeftModel``, and merges of loaded
``nn.Module``s / Hugging Face models / state dicts.

Both run the code that merges files, not a copy of it:

- :func:`add_merged_adapter` hands the adapters of the loaded model, as peft would save them, to
  :func:`.lora_merge.merge_adapters` (every merge method runs on ``Delta W = s B A``, the same checks and
  refusals as for adapter folders), and loads the merged adapter back into the model under a new name;
- :func:`merge_models` runs :func:`.methods.registry.merge` (the method's kernel over the key driver) on the
  modules' state dicts.

peft's ``add_weighted_adapter(combination_type=...)`` names are accepted as methods
(:data:`PEFT_COMBINATIONS`); docs/python_api.md compares the two.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..utils.device import Device, parse_device, using_device
from .io.base import MergeInputError
from .io.peft import AdapterSource
from .lora_merge import LINEAR_METHODS, merge_adapters
from .methods.registry import get_method, merge

__all__ = ["PEFT_COMBINATIONS", "add_merged_adapter", "merge_models", "peft_combination"]

#: peft ``combination_type`` -> (clmerge method, its fixed hyperparameters). Each computes what peft's does on
#: ``Delta W`` (peft's ``_svd_generalized_task_arithmetic_weighted_adapter``); ``density`` is peft's fraction
#: kept (DARE: ``drop_rate = 1 - density``). ``cat`` is exact: the concatenated factors (``exact=True``).
PEFT_COMBINATIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "svd": ("task_arithmetic", {"scaling": 1.0}),
    "cat": ("task_arithmetic", {"scaling": 1.0}),
    "ties_svd": ("ties", {"scaling": 1.0, "trim_scope": "per_tensor"}),
    "dare_linear_svd": ("dare", {"scaling": 1.0, "combine": "task_arithmetic"}),
    "dare_ties_svd": ("dare", {"scaling": 1.0, "combine": "ties", "density": 1.0}),
    "magnitude_prune_svd": ("breadcrumbs", {"scaling": 1.0, "beta": 0.0}),
}
# peft combinations that combine the A and the B factors separately (mean(B) mean(A) is not mean(B A))
_FACTOR_LEVEL = ("linear", "ties", "dare_linear", "dare_ties", "magnitude_prune")


def peft_combination(name: str, params: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The clmerge method and hyperparameters of peft's ``combination_type`` ``name`` (``None``: not one of
    :data:`PEFT_COMBINATIONS`); ``params`` are the caller's (``density``, ``majority_sign_method``)."""
    if name not in PEFT_COMBINATIONS:
        return None
    method, fixed = PEFT_COMBINATIONS[name]
    hp = dict(params)
    sign = hp.pop("majority_sign_method", "total")
    if sign != "total":
        raise ValueError(f"majority_sign_method {sign!r}: only 'total' (sign of the summed updates, TIES's "
                         "election) is available")
    if name not in ("svd", "cat"):
        if hp.get("density") is None:
            raise ValueError(f"method {name!r} needs density= (the fraction of each update kept, as in peft)")
        density = float(hp.pop("density"))
        if name.startswith("dare"):
            hp["drop_rate"] = 1.0 - density
        else:
            hp["density"] = density
    return method, {**fixed, **hp}


def _resolve(method: str, params: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    translated = peft_combination(method, params)
    if translated is not None:
        return get_method(translated[0]), translated[1]
    try:
        return get_method(method), dict(params)
    except KeyError:
        if method in _FACTOR_LEVEL:
            hint = f"{method}_svd"
            raise ValueError(f"method {method!r}: peft's {method!r} combines the A and B factors "
                             "separately, which is not a merge of the updates; use "
                             f"{hint!r} (the same rule on Delta W) or a clmerge method") from None
        raise


def _check_unmerged(peft_model: Any) -> None:
    """Refuse a model whose LoRA layers hold merged adapters (their base weights are not the base's)."""
    from peft.tuners.lora import LoraLayer

    for name, mod in peft_model.base_model.model.named_modules():
        if isinstance(mod, LoraLayer) and getattr(mod, "merged_adapters", None):
            merged = ", ".join(mod.merged_adapters)
            raise MergeInputError(f"module {name!r} has adapters merged into its weight ({merged}): call "
                                  "unmerge_adapter() first (the merge needs the base weights)")


class _BaseWeights:
    """The base model under a ``PeftModel`` as a lazy parameter source, under the names a saved adapter's
    keys use (peft's ``base_layer`` and ``original_module`` left out; LoRA and saved-module copies skipped);
    ``get`` brings one tensor to the CPU at a time."""

    def __init__(self, peft_model: Any) -> None:
        self.name, self.files = "the PeftModel's base weights", []
        self._tensors: dict[str, Tensor] = {}
        for key, t in peft_model.base_model.model.state_dict().items():
            peft_own = ".lora_" in key or ".modules_to_save." in key or "token_adapter" in key
            if peft_own or not isinstance(t, Tensor):
                continue
            self._tensors[key.replace(".base_layer.", ".").replace(".original_module.", ".")] = t

    def keys(self) -> list[str]:
        return list(self._tensors)

    def meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        t = self._tensors[key]
        return tuple(t.shape), t.dtype

    def get(self, key: str) -> Tensor:
        return self._tensors[key].detach().to("cpu")

    def device(self) -> str:
        """Where the model's weights are (the first floating tensor's device)."""
        return next((str(t.device) for t in self._tensors.values() if t.is_floating_point()), "cpu")


def _json_config(cfg: Any) -> dict:
    """A peft config as ``adapter_config.json`` holds it (sets as lists, enums as their values)."""
    def other(o: Any) -> Any:
        return sorted(o) if isinstance(o, (set, frozenset)) else str(o)

    return json.loads(json.dumps(cfg.to_dict(), default=other))


def _save_adapter(peft_model: Any, adapter: str, folder: Path) -> None:
    """Write ``adapter`` of the loaded model as ``save_pretrained`` would (its config and LoRA weights)."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    from ..utils.io import write_json

    cfg = peft_model.peft_config[adapter]
    if getattr(cfg, "target_parameters", None):
        raise MergeInputError(f"adapter {adapter!r}: LoRA on parameters (target_parameters) is not supported")
    state = get_peft_model_state_dict(peft_model, adapter_name=adapter, save_embedding_layers=False)
    folder.mkdir(parents=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()},
              str(folder / "adapter_model.safetensors"))
    write_json(folder / "adapter_config.json", _json_config(cfg))


def _full_rank(shape: Sequence[int]) -> int:
    """The largest rank of an update of a weight of ``shape`` (a kernel's dimensions count as inputs)."""
    return min(shape[0], math.prod(shape[1:]))


def _check_args(peft_model: Any, adapters: Sequence[str], weights: Sequence[float] | None,
                new_name: str) -> None:
    import peft

    if not isinstance(peft_model, peft.PeftModel):
        raise TypeError(f"add_merged_adapter: expected a peft.PeftModel, got {type(peft_model).__name__}")
    if isinstance(adapters, str) or not adapters:
        raise ValueError("adapters: need a non-empty list of adapter names")
    known = list(peft_model.peft_config)
    for a in adapters:
        if a not in known:
            raise ValueError(f"adapter {a!r} is not in the model (its adapters: {', '.join(known)})")
    if len(set(adapters)) != len(adapters):
        raise ValueError(f"adapters: a name is listed twice ({', '.join(adapters)})")
    if new_name in known:
        raise ValueError(f"new_name {new_name!r}: the model has an adapter of that name already")
    if weights is not None and (len(weights) != len(adapters)
                                or not all(math.isfinite(float(w)) for w in weights)):
        raise ValueError(f"weights: need {len(adapters)} finite numbers, one per adapter, got "
                         f"{list(weights)}")


def _plain(src: Any) -> bool:
    """Whether every change of the adapter ``src`` is ``s B A`` (no DoRA, ``lora_bias`` or saved tensors)."""
    return (not getattr(src, "biases", None) and not getattr(src, "saved", None)
            and all(getattr(m, "magnitude", None) is None for m in src.modules.values()))


def _weighted(src: Any, weight: float, factored: bool) -> None:
    """Multiply every change the adapter ``src`` makes by ``weight``: its modules' scale ``s`` where the
    factors themselves are combined (``form="factored"``, plain adapters only), else its ``delta``, which
    every variant's change goes through (DoRA's, biases', saved tensors')."""
    if factored:
        src.modules = {k: dataclasses.replace(m, scale=m.scale * weight) for k, m in src.modules.items()}
        return
    plain = src.delta  # the bound method; the instance attribute below shadows it for every caller

    def delta(key: str, dtype: torch.dtype = torch.float32) -> Tensor:
        return plain(key, dtype).mul_(weight)

    src.delta = delta


def add_merged_adapter(peft_model: Any, adapters: Sequence[str], *, method: str,
                       weights: Sequence[float] | None = None, new_name: str = "merged",
                       rank: int | None = None, exact: bool = False, svd: str = "auto",
                       device: str | Device | None = None, **method_params: Any) -> dict:
    """Merge adapters of a loaded ``peft.PeftModel`` and add the result to it as a new LoRA adapter.

    Every merge method runs on the adapters' updates ``Delta W_t = s_t B_t A_t`` (never on ``A`` and ``B``
    separately), through :func:`.lora_merge.merge_adapters`; the merged update is written back as LoRA factors
    (truncated SVD, scale 1) and loaded with peft's ``load_adapter`` (not activated: call
    ``peft_model.set_adapter(new_name)``).

    Args:
        peft_model: the loaded model holding the adapters (not merged into the base weights).
        adapters: names of its LoRA adapters to merge.
        method: a clmerge merge method (``clmerge.merging.available()``), or one of peft's combination types
            ``svd``, ``cat``, ``ties_svd``, ``dare_linear_svd``, ``dare_ties_svd``, ``magnitude_prune_svd``
            (:data:`PEFT_COMBINATIONS`; ``cat`` implies ``exact``).
        weights: one number per adapter. A method with per-expert ``weights`` of its own (``weight_average``,
            ``karcher``, ...) takes them as those; for every other method (``ties`` and ``dare`` too, whose own
            ``weights`` are mergekit's) each adapter's ``Delta W`` is multiplied by its weight before the merge
            (peft's convention). ``None``: unweighted.
        new_name: the new adapter's name (must not exist).
        rank: the rank of the written adapter. ``None``: the sum of the adapters' ranks (exact for methods
            linear in the updates); a module whose ``min(out, in)`` is smaller gets that (exact there).
        exact: store the merged update without loss: the concatenated factors for ``weight_average`` and
            ``task_arithmetic`` of plain LoRA adapters (rank: the sum of the ranks), else the SVD at rank
            ``min(out, in)``.
        svd: ``"auto"``, ``"full"`` or ``"randomized"`` (the SVD that re-factorises).
        device: ``cpu`` (default), ``cuda`` or ``cuda:N``: where the merge and the SVDs compute.
        **method_params: the method's hyperparameters (``density=``, ``scaling=``, ...).

    Returns:
        The report of :func:`.lora_merge.merge_adapters` with ``adapter`` (``new_name``) and ``adapters`` (the
        names merged): ``rank``, ``ranks`` per module, ``max_rel_error``, ``overall_rel_error`` and
        ``per_module_rel_error`` (the write-back loss ``||Delta W - B'A'||_F / ||Delta W||_F``), ``warnings``.

    Raises:
        TypeError: not a ``PeftModel``, or a hyperparameter the method does not have.
        ValueError: unknown adapter names, an existing ``new_name``, weights of the wrong length.
        MergeInputError: a variant the adapter-folder reader refuses (:mod:`.io.peft`; one line naming the
            adapter), LoRA on parameters, a base weight that is not floating (quantized), or adapters
            already merged into the base weights.
    """
    _check_args(peft_model, adapters, weights, new_name)
    name, meth_params = method, dict(method_params)
    exact = exact or name == "cat"
    meth, hp = _resolve(name, meth_params)
    # ties' and dare's own weights are mergekit's (a weighted disjoint mean); peft's scale each update first
    own_weights = "weights" in meth.hyperparameters() and meth.name not in ("ties", "dare")
    if weights is not None and own_weights:
        hp["weights"] = [float(w) for w in weights]
    _check_unmerged(peft_model)
    base = _BaseWeights(peft_model)
    with tempfile.TemporaryDirectory(prefix="clmerge-adapters-") as tmp:
        srcs = []
        for i, a in enumerate(adapters):
            folder = Path(tmp) / f"in{i}"
            _save_adapter(peft_model, a, folder)
            try:
                src = AdapterSource(folder, base)
            except MergeInputError as exc:  # the folder is ours: name the adapter instead
                where = re.compile(re.escape(str(folder)) + r"(/[\w.]+)?")
                raise MergeInputError(where.sub(f"adapter {a!r}", str(exc))) from None
            src.name, src.warning = f"adapter {a!r}", None  # all sit on this model's base
            srcs.append(src)
        # exact: the concatenated factors where they exist (a linear method, plain LoRA), else the full SVD
        factored = exact and meth.name in LINEAR_METHODS and all(_plain(s) for s in srcs)
        form = "factored" if factored else "peft"
        if weights is not None and not own_weights:
            for src, weight in zip(srcs, weights):
                if float(weight) != 1.0:
                    _weighted(src, float(weight), factored)
        if form == "peft" and exact:
            rank = max(_full_rank(base.meta(k)[0]) for s in srcs for k in s.modules)
        elif form == "peft" and rank is None:
            rank = sum(max((m.rank for m in s.modules.values()), default=0) for s in srcs) or None
        out = Path(tmp) / "merged"
        report = merge_adapters(method=meth.name, base=base, adapters=srcs, hyperparameters=hp, out=out,
                                form=form, rank=rank, svd=svd, device=device)
        peft_model.load_adapter(str(out), adapter_name=new_name, torch_device=base.device())
    report.pop("out", None)
    # the report's hints name the command's flag; here it is this function's argument
    report["warnings"] = [w.replace("--adapter-rank ", "rank=") for w in report.get("warnings", [])]
    return {"adapter": new_name, **report, "adapters": list(adapters)}


def _state(obj: Any, what: str) -> dict[str, Tensor]:
    """The tensors of a module's state dict (on the CPU), or a mapping's."""
    if isinstance(obj, torch.nn.Module):
        obj = obj.state_dict()
    if not isinstance(obj, Mapping):
        raise TypeError(f"{what}: expected an nn.Module or a state dict, got {type(obj).__name__}")
    return {k: v.detach().to("cpu") for k, v in obj.items() if isinstance(v, Tensor)}


def merge_models(base: Any, experts: Sequence[Any], *, method: str, device: str | Device | None = None,
                 as_module: bool = False, **hyperparameters: Any) -> dict[str, Tensor] | torch.nn.Module:
    """Merge loaded models (``nn.Module``s, Hugging Face models, or state dicts) with a registered method.

    The method runs as on checkpoint files (:func:`clmerge.merging.merge`: its kernel over the key driver), on
    the state dicts' tensors; the inputs are not modified.

    Args:
        base: the pretrained model (``None`` for a method that needs none).
        experts: the fine-tuned models, same architecture (same state-dict keys and shapes).
        method: a name from ``clmerge.merging.available()``.
        device: ``cpu`` (default), ``cuda`` or ``cuda:N``: where the kernels compute, key by key.
        as_module: return a copy of ``base`` (else of the first expert) holding the merged weights, instead of
            the state dict.
        **hyperparameters: the method's (``density=``, ``scaling=``, ``weights=``, ...).

    Returns:
        ``{key: merged tensor}`` (on the CPU, in the inputs' dtypes), or the merged module.
    """
    if isinstance(experts, (torch.nn.Module, Mapping)) or not experts:
        raise ValueError("experts: need a non-empty list of models or state dicts")
    states = [_state(e, f"expert {i}") for i, e in enumerate(experts)]
    base_state = None if base is None else _state(base, "base")
    with using_device(parse_device(device, "device=")):
        merged = merge(method, base=base_state, experts=states, **hyperparameters)
    if not as_module:
        return merged
    template = base if base is not None else experts[0]
    if not isinstance(template, torch.nn.Module):
        raise TypeError("as_module=True needs the base (or the first expert) to be an nn.Module")
    out = copy.deepcopy(template)
    out.load_state_dict(merged, strict=False)
    return out
