"""PEFT LoRA adapter folders, read and written with safetensors + json (``peft`` itself is not needed).

A folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or ``adapter_model.bin``). For a
target module ``<mod>`` the weights are ``base_model.model.<mod>.lora_A.weight`` (``A``, shape ``r x in``)
and ``base_model.model.<mod>.lora_B.weight`` (``B``, ``out x r``); the module changes the base weight
``<mod>.weight`` by (Hu et al. 2021, Eq. 3; peft's ``get_delta_weight``)

    Delta W = s * B A,   s = lora_alpha / r   (rsLoRA, Kalajdzievski 2023: s = lora_alpha / sqrt(r)),

transposed when ``fan_in_fan_out`` is set (GPT-2's ``Conv1D`` stores ``in x out``). ``r`` and ``lora_alpha``
come from ``rank_pattern`` / ``alpha_pattern`` where a pattern matches the module name. Every variant is
read as the change that peft's ``merge_and_unload`` makes to each base tensor:

- ``nn.Conv1d/2d/3d``: ``A`` is ``(r, in, *kernel)``, ``B`` ``(out, r, 1, ...)``; ``Delta W = s B A`` with the
  factors flattened to ``(out, r)`` and ``(r, in * prod(kernel))``, reshaped to the kernel;
- DoRA (Liu et al. 2024, Eq. 5; peft's ``DoraLinearVariant.merge_safe``): ``W' = m / ||W + s B A||_c * (W +
  s B A)``, the norm taken per output channel, so ``Delta W = W' - W`` depends on ``W`` and is not low rank;
- ``lora_bias``: ``lora_B``'s bias ``b`` changes the base bias by ``s b``;
- ``modules_to_save`` and trained biases (``bias: all / lora_only``): the saved tensor replaces the base's,
  ``Delta = saved - W``.

:class:`AdapterSource` shows ``base + Delta W`` as a lazy parameter source over the base's keys, so every merge
method works on the Delta W's, never on ``A`` and ``B`` separately.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ...utils import inpaths
from ...utils.inpaths import inside
from .base import MergeInputError, ParamSource, torch_load_state_dict
from .checks import check_dtype, check_finite_output, is_finite, source_meta
from .peft_variants import check_supported, dora_delta

__all__ = ["ADAPTER_CONFIG", "is_peft_adapter", "AdapterSource", "LoraModule", "read_adapter",
           "write_adapter", "PREFIX"]

ADAPTER_CONFIG = "adapter_config.json"
PREFIX = "base_model.model."
_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_LORA_KEY = re.compile(r"^(?P<mod>.+)\.(?:lora_(?P<emb>embedding_)(?P<eab>[AB])|lora_(?P<ab>[AB])\.weight"
                       r"|lora_B\.(?P<bias>bias)|(?P<mag>lora_magnitude_vector)(?:\.weight)?)$")


def is_peft_adapter(path: str | Path) -> bool:
    """Whether ``path`` is a folder with an ``adapter_config.json``."""
    return Path(path).is_dir() and (Path(path) / ADAPTER_CONFIG).is_file()


@dataclass
class LoraModule:
    """One adapted module: ``Delta W = scale * B A`` (transposed if ``transpose``; reshaped to the kernel of a
    convolution), or DoRA's ``W' - W`` when ``magnitude`` is set.

    Args:
        name: the module's name in the adapted model (``<mod>`` of the adapter keys).
        lora_a: ``A``, shape ``(r, in)`` (``(r, in, *kernel)`` for a convolution).
        lora_b: ``B``, shape ``(out, r)`` (``(out, r, 1, ...)`` for a convolution).
        scale: ``s`` (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA).
        transpose: the base weight is stored ``(in, out)`` (``fan_in_fan_out``, and every embedding).
        embedding: an ``nn.Embedding`` (keys ``lora_embedding_A/B``; peft: ``Delta W = s (B A)^T`` with
            ``A`` of shape ``(r, num_embeddings)``).
        magnitude: DoRA's magnitude vector ``m`` (one entry per output channel), or ``None``.
        bias: ``lora_B``'s bias (``lora_bias``), or ``None``: the base bias changes by ``scale * bias``.
    """

    name: str
    lora_a: Tensor
    lora_b: Tensor
    scale: float
    transpose: bool = False
    embedding: bool = False
    magnitude: Tensor | None = None
    bias: Tensor | None = None

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]

    @property
    def weight_shape(self) -> tuple[int, ...]:
        """The base weight's shape that ``Delta W`` has."""
        shape = (self.lora_b.shape[0], *self.lora_a.shape[1:])
        return shape[::-1] if self.transpose else shape

    def delta(self, dtype: torch.dtype = torch.float32, base_weight: Tensor | None = None) -> Tensor:
        """``Delta W`` in ``dtype`` (float32: what peft applies; float64 for a merge that must recover the
        merged update to float64 rounding), in the base weight's layout; DoRA needs ``base_weight``."""
        r, out = self.rank, self.lora_b.shape[0]
        d = (self.lora_b.to(dtype).reshape(out, r) @ self.lora_a.to(dtype).reshape(r, -1)).mul_(self.scale)
        d = d.reshape(out, *self.lora_a.shape[1:])
        d = d.t().contiguous() if self.transpose else d
        if self.magnitude is None:
            return d
        if base_weight is None:
            raise ValueError(f"{self.name}: a DoRA module's Delta W needs the base weight")
        return dora_delta(base_weight.to(dtype), d, self.magnitude.to(dtype), self.transpose)

    def bias_delta(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The change of the base bias, ``scale * b`` (``lora_bias``)."""
        return self.bias.to(dtype) * self.scale


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """peft's rule for ``rank_pattern`` / ``alpha_pattern``: the first key that matches the end of the name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_config(adapter_dir: str | Path) -> dict:
    """``adapter_config.json`` of ``adapter_dir``, checked to be a plain LoRA adapter."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not os.path.lexists(path):  # anything there is read through the boundary (a FIFO is refused by name)
        raise MergeInputError(f"{adapter_dir}: not a PEFT adapter folder (no {ADAPTER_CONFIG})")
    inside(Path(adapter_dir), ADAPTER_CONFIG, f"{adapter_dir}: adapter config")
    cfg = inpaths.read_json(path, within=adapter_dir)
    if not isinstance(cfg, dict):
        raise MergeInputError(f"{path}: expected a JSON object (peft's LoraConfig fields), got {type(cfg).__name__}")
    check_supported(cfg, path)
    return cfg


def _weights_file(adapter_dir: Path) -> Path:
    for name in _WEIGHT_FILES:
        if os.path.lexists(adapter_dir / name):
            return inside(adapter_dir, name, f"{adapter_dir}: adapter weights")
    raise MergeInputError(f"{adapter_dir}: no adapter weights ({' or '.join(_WEIGHT_FILES)})")


def _load_weights(path: Path) -> dict[str, Tensor]:
    """The adapter's tensors, read through the input boundary (inside the adapter folder)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        with inpaths.checked_path(path, within=path.parent) as checked:
            try:
                return load_file(checked)
            except Exception as exc:  # safetensors raises several types for corrupt files
                raise MergeInputError(f"{path}: not a readable safetensors file ({exc})") from exc
    return torch_load_state_dict(path, within=path.parent)  # weights_only=True


def read_adapter(adapter_dir: str | Path) -> tuple[dict, dict[str, LoraModule], Path, dict[str, Tensor]]:
    """Parse a LoRA adapter folder.

    Returns:
        ``(config, {module name: LoraModule}, weights file, {parameter name: tensor})``, the last being the
        whole tensors the adapter saves to replace the base's: ``modules_to_save``, trained biases (``bias``
        ``all`` / ``lora_only``) and the base weights peft saves beside an adapted embedding (their names
        without ``base_layer``, e.g. ``lm_head.weight``).

    Raises:
        MergeInputError: an unsupported variant (named, with why), unreadable weights, a LoRA tensor of no
            known kind, ``A`` without ``B``, a grouped convolution, or a rank that disagrees with the config.
    """
    adapter_dir = Path(adapter_dir)
    cfg = read_config(adapter_dir)
    wfile = _weights_file(adapter_dir)
    pairs: dict[str, dict[str, Tensor]] = {}
    saved: dict[str, Tensor] = {}
    for key, tensor in _load_weights(wfile).items():
        if not key.startswith(PREFIX):
            raise MergeInputError(f"{wfile}: key {key!r} does not start with {PREFIX!r} (not a peft LoRA adapter)")
        name = key[len(PREFIX):]
        m = _LORA_KEY.match(name)
        if m is not None:
            kind = "bias" if m["bias"] else "mag" if m["mag"] else m["ab"] or "emb" + m["eab"]
            pairs.setdefault(m["mod"], {})[kind] = tensor
        elif "lora_" in name or "token_adapter" in name:
            raise MergeInputError(f"{wfile}: key {key!r} is a LoRA tensor of no kind clmerge merges (LoRA A/B, "
                                  "DoRA magnitudes, lora_B biases)")
        else:
            saved[name.replace(".base_layer.", ".")] = tensor
    modules = {mod: _lora_module(mod, ab, cfg, wfile) for mod, ab in pairs.items()}
    if not modules and not saved:
        raise MergeInputError(f"{wfile}: no LoRA weights")
    return cfg, modules, wfile, saved


def _lora_module(mod: str, ab: dict[str, Tensor], cfg: dict, wfile: Path) -> LoraModule:
    """One module's factors with its scale (peft's ``rank_pattern`` / ``alpha_pattern`` / rsLoRA rules)."""
    embedding = {"embA", "embB"} <= set(ab)
    if embedding:
        ab = {**{k: v for k, v in ab.items() if not k.startswith("emb")}, "A": ab["embA"], "B": ab["embB"]}
    if not {"A", "B"} <= set(ab) or ab["A"].dim() < 2 or ab["B"].dim() != ab["A"].dim():
        raise MergeInputError(f"{wfile}: module {mod!r} needs lora_A and lora_B weights of the same number of "
                              f"dimensions (found {sorted(ab)})")
    r = int(_pattern_value(cfg.get("rank_pattern"), mod, cfg.get("r", 8)))
    alpha = float(_pattern_value(cfg.get("alpha_pattern"), mod, cfg.get("lora_alpha", 8)))
    if ab["A"].shape[0] != r:
        raise MergeInputError(f"{wfile}: module {mod!r} has rank {ab['A'].shape[0]} but the config says r={r}")
    if ab["B"].shape[1] != r or any(k != 1 for k in ab["B"].shape[2:]):
        raise MergeInputError(f"{wfile}: module {mod!r} has lora_B of shape {list(ab['B'].shape)} for rank {r} "
                              "(a grouped convolution: not supported)")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    transpose = embedding or bool(cfg.get("fan_in_fan_out", False))
    return LoraModule(mod, ab["A"], ab["B"], scale, transpose, embedding, magnitude=ab.get("mag"),
                      bias=ab.get("bias"))


def match_param_key(param: str, base_keys: set[str] | dict, where: str, label: str | None = None) -> str:
    """The base key of the adapter's parameter name ``param``: itself, with or without a ``model.`` prefix,
    else the one base key ending in ``.<param>``."""
    candidates = [param, f"model.{param}"]
    if param.startswith("model."):
        candidates.append(param[len("model."):])
    for key in candidates:
        if key in base_keys:
            return key
    tail = [k for k in base_keys if k.endswith(f".{param}")]
    if len(tail) == 1:
        return tail[0]
    raise MergeInputError(f"{where}: {label or repr(param)} matches no base key (tried {', '.join(candidates)}"
                          f"{'; several keys end with it' if tail else ''})")


def match_base_key(module: str, base_keys: set[str] | dict, where: str) -> str:
    """The base key that module ``module`` changes: ``<mod>.weight``, with or without a ``model.`` prefix,
    else the one base key ending in ``.<mod>.weight``."""
    return match_param_key(f"{module}.weight", base_keys, where, f"LoRA module {module!r}")


def _same_model(named: str, given: str) -> bool:
    """Whether ``given`` (a path or hub id) plausibly is the model ``named`` (a hub id or path): the same
    string, path, last path component (a local copy of a hub model), or hub cache folder."""
    named, given = named.rstrip("/"), given.rstrip("/")
    if named == given or named.split("/")[-1] == given.split("/")[-1]:
        return True
    try:
        if Path(named).exists() and Path(named).resolve() == Path(given).resolve():
            return True
    except OSError:
        pass
    return f"models--{named.replace('/', '--')}" in str(Path(given).resolve())


def base_model_mismatch(adapter: str, config: dict, base: Any) -> str | None:
    """A warning when ``adapter_config.json`` names a base model other than ``base``, else ``None``.

    A warning, not an error: the name is often a hub id where the base is a local copy, and the shapes of
    every adapted module are checked against the base anyway (a different architecture is refused there).
    """
    named = config.get("base_model_name_or_path")
    given = str(getattr(base, "name", "") or "")
    if not named or not given or _same_model(str(named), given):
        return None
    return (f"warning: {adapter}: adapter_config.json names base model {named!r} but the base given is "
            f"{given!r}; merged anyway (the shapes match): check that it is the model the adapter was trained on")


class AdapterSource(ParamSource):
    """A PEFT LoRA adapter on top of ``base``, seen as a lazy parameter source over the base's keys.

    ``get(k)`` is ``base[k] + Delta W_k`` in float32 for the keys the adapter changes (``meta`` says float32
    there) and the base tensor unchanged elsewhere: ``Delta W_k`` is what peft's ``merge_and_unload`` adds to
    ``k`` (module docstring: LoRA, rsLoRA, patterns, convolutions, embeddings, DoRA, ``lora_bias``, saved
    modules and biases). It subclasses :class:`ParamSource` only so that :class:`~clmerge.merging.ModelSet`
    accepts it as a source; it reads nothing itself.

    Args:
        adapter_dir: the adapter folder.
        base: a lazy source with ``keys()``, ``meta(k)``, ``get(k)`` and ``name`` (the model the adapter
            was trained on).

    Attributes:
        name: the folder, for error messages.
        files: the adapter weight files.
        delta_keys: the base keys the adapter changes.
        modules: ``{base weight key: LoraModule}``.
        biases: ``{base bias key: LoraModule}`` for the modules with a ``lora_B`` bias.
        saved: ``{base key: tensor}``, the whole tensors that replace the base's (only those that differ).
        names: ``{base key: parameter name in the adapted model}`` for every key in ``delta_keys``.
        config: the adapter's ``adapter_config.json``.
        warning: a one-line warning when the config names another base model than ``base`` (else ``None``).

    Raises:
        MergeInputError: as :func:`read_adapter`, a module or tensor that matches no base key, or a Delta W
            whose shape is not the base tensor's (names it and both shapes).
    """

    def __init__(self, adapter_dir: str | Path, base: Any) -> None:  # noqa: D107 (no ParamSource.__init__)
        self.name = str(adapter_dir)
        self.base = base
        self.config, by_module, wfile, saved = read_adapter(adapter_dir)
        self.files = [wfile]
        base_keys = set(base.keys())
        self.modules: dict[str, LoraModule] = {}
        self.biases: dict[str, LoraModule] = {}
        self.names: dict[str, str] = {}
        for mod, lm in by_module.items():
            key = match_base_key(mod, base_keys, self.name)
            self._check_shape(key, lm.weight_shape, f"module {mod!r} gives a delta of shape")
            self.modules[key], self.names[key] = lm, f"{mod}.weight"
            if lm.bias is not None:
                bkey = self._bias_key(mod, base_keys)
                self._check_shape(bkey, tuple(lm.bias.shape), f"module {mod!r} gives a bias delta of shape")
                self.biases[bkey], self.names[bkey] = lm, f"{mod}.bias"
        self.saved: dict[str, Tensor] = {}
        for param, tensor in saved.items():
            key = match_param_key(param, base_keys, self.name, f"saved tensor {param!r}")
            self._check_shape(key, tuple(tensor.shape), f"saved tensor {param!r} has shape")
            if not torch.equal(tensor, self.base.get(key).to(tensor.dtype)):  # equal: the base's own copy
                self.saved[key], self.names[key] = tensor, param
        self.delta_keys = set(self.names)
        self.warning = base_model_mismatch(self.name, self.config, base)

    def _bias_key(self, mod: str, base_keys: set[str]) -> str:
        try:
            return match_param_key(f"{mod}.bias", base_keys, self.name)
        except MergeInputError:
            raise MergeInputError(f"{self.name}: module {mod!r} has a lora_B bias (lora_bias) but its base layer has "
                                  "no bias, so there is nothing to add it to (peft cannot merge it either)") from None

    def _check_shape(self, key: str, shape: tuple[int, ...], what: str) -> None:
        base_shape, dtype = source_meta(self.base, key)
        check_dtype(self.base, key, dtype)
        if tuple(base_shape) != tuple(shape):
            raise MergeInputError(f"{self.name}: {what} {list(shape)} but {self.base.name} has {key!r} of shape "
                                  f"{list(base_shape)}")

    def keys(self) -> list[str]:
        return list(self.base.keys())

    def meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        shape, dtype = self.base.meta(key)
        return (tuple(shape), torch.float32) if key in self.delta_keys else (tuple(shape), dtype)

    def delta(self, key: str, dtype: torch.dtype = torch.float32) -> Tensor:
        """``Delta W`` of base key ``key`` alone (float32 unless ``dtype`` says otherwise): the saved tensor's
        change, plus the LoRA (or DoRA) update or the ``lora_B`` bias's on top of it, as peft loads and merges."""
        start = self.saved[key].to(dtype) if key in self.saved else None
        d = torch.zeros(()) if start is None else start - self.base.get(key).to(dtype)
        if key in self.modules:
            lm = self.modules[key]
            w0 = None if lm.magnitude is None else (start if start is not None else self.base.get(key))
            d = lm.delta(dtype, w0).add_(d)
        elif key in self.biases:
            d = self.biases[key].bias_delta(dtype).add_(d)
        return d

    def get(self, key: str) -> Tensor:
        if key not in self.delta_keys:
            return self.base.get(key)
        return self.delta(key).add_(self.base.get(key))  # the fresh delta takes the sum: base is never modified


def write_adapter(out_dir: Path, modules: dict[str, tuple[Tensor, Tensor]], config: dict,
                  embeddings: set[str] = frozenset(), extra: dict[str, Tensor] | None = None) -> None:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``out_dir`` (an existing,
    private temporary folder; the caller renames it into place).

    Args:
        out_dir: the folder.
        modules: ``{module name: (A, B)}``, ``A`` of shape ``(r, in)`` and ``B`` of ``(out, r)`` (a
            convolution's ``(r, in, *kernel)`` and ``(out, r, 1, ...)``).
        config: the adapter config (written as is).
        embeddings: modules that are ``nn.Embedding`` (written as ``lora_embedding_A/B``; ``A`` is
            ``(r, num_embeddings)``, ``B`` ``(embedding_dim, r)``).
        extra: ``{parameter name: tensor}`` written as is under the adapter prefix: ``lora_B`` biases
            (``<mod>.lora_B.bias``) and the tensors of ``modules_to_save`` (``<mod>.weight``).
    """
    from safetensors.torch import save_file

    extra = extra or {}
    check_finite_output([f"{mod}.lora_{ab}" for mod, pair in modules.items() for ab, t in zip("AB", pair)
                         if not is_finite(t)] + [k for k, t in extra.items() if not is_finite(t)], "the adapter")
    tensors = {}
    for mod, (a, b) in modules.items():
        names = ("lora_embedding_A", "lora_embedding_B") if mod in embeddings else ("lora_A.weight", "lora_B.weight")
        tensors[f"{PREFIX}{mod}.{names[0]}"] = a.detach().contiguous()
        tensors[f"{PREFIX}{mod}.{names[1]}"] = b.detach().contiguous()
    tensors.update({f"{PREFIX}{k}": t.detach().contiguous() for k, t in extra.items()})
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def adapter_config(*, r: int, alpha: float, targets: list[str], fan_in_fan_out: bool = False,
                   rank_pattern: dict | None = None, alpha_pattern: dict | None = None,
                   base_model: str | None = None, task_type: str | None = None, lora_bias: bool = False,
                   modules_to_save: list[str] | None = None) -> dict:
    """A plain LoRA ``adapter_config.json`` that ``peft.PeftModel.from_pretrained`` reads.

    Pattern keys are escaped module names (peft reads them as regexes matched at the end of a name).
    ``lora_bias`` gives every ``lora_B`` a bias; ``modules_to_save`` names modules saved whole.
    """
    return {
        "peft_type": "LORA", "task_type": task_type, "base_model_name_or_path": base_model, "inference_mode": True,
        "r": int(r), "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": sorted(targets),
        "fan_in_fan_out": fan_in_fan_out, "bias": "none", "use_rslora": False, "use_dora": False,
        "modules_to_save": sorted(modules_to_save) if modules_to_save else None, "init_lora_weights": True,
        "lora_bias": bool(lora_bias),
        "rank_pattern": {re.escape(k): v for k, v in (rank_pattern or {}).items()},
        "alpha_pattern": {re.escape(k): v for k, v in (alpha_pattern or {}).items()},
    }
