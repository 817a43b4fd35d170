"""PEFT LoRA adapter folders, read and written with safetensors + json (``peft`` itself is not needed).

A folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or ``adapter_model.bin``). For a
target module ``<mod>`` the weights are ``base_model.model.<mod>.lora_A.weight`` (``A``, shape ``r x in``)
and ``base_model.model.<mod>.lora_B.weight`` (``B``, ``out x r``); the module changes the base weight
``<mod>.weight`` by (Hu et al. 2021, Eq. 3; peft's ``get_delta_weight``)

    Delta W = s * B A,   s = lora_alpha / r   (rsLoRA, Kalajdzievski 2023: s = lora_alpha / sqrt(r)),

transposed when ``fan_in_fan_out`` is set (GPT-2's ``Conv1D`` stores ``in x out``). ``r`` and ``lora_alpha``
come from ``rank_pattern`` / ``alpha_pattern`` where a pattern matches the module name.

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

__all__ = ["ADAPTER_CONFIG", "is_peft_adapter", "AdapterSource", "LoraModule", "read_adapter",
           "write_adapter", "PREFIX"]

ADAPTER_CONFIG = "adapter_config.json"
PREFIX = "base_model.model."
_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_LORA_KEY = re.compile(r"^(?P<mod>.+)\.lora_(?:(?P<emb>embedding_)(?P<eab>[AB])|(?P<ab>[AB])\.weight)$")


def is_peft_adapter(path: str | Path) -> bool:
    """Whether ``path`` is a folder with an ``adapter_config.json``."""
    return Path(path).is_dir() and (Path(path) / ADAPTER_CONFIG).is_file()


@dataclass
class LoraModule:
    """One adapted module: ``Delta W = scale * B A`` (transposed if ``transpose``).

    Args:
        name: the module's name in the adapted model (``<mod>`` of the adapter keys).
        lora_a: ``A``, shape ``(r, in)``.
        lora_b: ``B``, shape ``(out, r)``.
        scale: ``s`` (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA).
        transpose: the base weight is stored ``(in, out)`` (``fan_in_fan_out``, and every embedding).
        embedding: an ``nn.Embedding`` (keys ``lora_embedding_A/B``; peft: ``Delta W = s (B A)^T`` with
            ``A`` of shape ``(r, num_embeddings)``).
    """

    name: str
    lora_a: Tensor
    lora_b: Tensor
    scale: float
    transpose: bool = False
    embedding: bool = False

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]

    def delta(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``Delta W`` in ``dtype`` (float32: what peft applies; float64 for a merge that must recover the
        merged update to float64 rounding), in the base weight's layout."""
        d = (self.lora_b.to(dtype) @ self.lora_a.to(dtype)).mul_(self.scale)
        return d.t().contiguous() if self.transpose else d


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """peft's rule for ``rank_pattern`` / ``alpha_pattern``: the first key that matches the end of the name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _check_supported(cfg: dict, where: Path) -> None:
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise MergeInputError(f"{where}: peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    unsupported = {"use_dora": cfg.get("use_dora"), "modules_to_save": cfg.get("modules_to_save"),
                   "bias": cfg.get("bias") not in (None, "none") and cfg.get("bias")}
    for field, value in unsupported.items():
        if value:
            raise MergeInputError(f"{where}: {field}={value!r} is not supported for LoRA merging "
                                  "(only plain LoRA on weights: use_dora false, bias 'none', no modules_to_save)")


def read_config(adapter_dir: str | Path) -> dict:
    """``adapter_config.json`` of ``adapter_dir``, checked to be a plain LoRA adapter."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not os.path.lexists(path):  # anything there is read through the boundary (a FIFO is refused by name)
        raise MergeInputError(f"{adapter_dir}: not a PEFT adapter folder (no {ADAPTER_CONFIG})")
    inside(Path(adapter_dir), ADAPTER_CONFIG, f"{adapter_dir}: adapter config")
    cfg = inpaths.read_json(path, within=adapter_dir)
    if not isinstance(cfg, dict):
        raise MergeInputError(f"{path}: expected a JSON object (peft's LoraConfig fields), got {type(cfg).__name__}")
    _check_supported(cfg, path)
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
        ``(config, {module name: LoraModule}, weights file, {key: tensor})``, the last being the base weights
        peft saves beside an adapted embedding (``<mod>.base_layer.weight``, in case the vocabulary was resized).

    Raises:
        MergeInputError: not a plain LoRA adapter, unreadable weights, a key that is not a LoRA factor
            (DoRA magnitudes, biases, modules_to_save: named), ``A`` without ``B``, a convolution, or a rank that
            disagrees with the config.
    """
    adapter_dir = Path(adapter_dir)
    cfg = read_config(adapter_dir)
    wfile = _weights_file(adapter_dir)
    pairs: dict[str, dict[str, Tensor]] = {}
    saved_base: dict[str, Tensor] = {}
    for key, tensor in _load_weights(wfile).items():
        if key.startswith(PREFIX) and key.endswith(".base_layer.weight"):
            saved_base[key[len(PREFIX):].replace(".base_layer.weight", ".weight")] = tensor
            continue
        m = _LORA_KEY.match(key[len(PREFIX):]) if key.startswith(PREFIX) else None
        if m is None:
            raise MergeInputError(f"{wfile}: key {key!r} is not a LoRA A/B weight (only plain LoRA on Linear "
                                  "and Embedding layers is supported: no DoRA, bias or modules_to_save weights)")
        pairs.setdefault(m["mod"], {})[m["ab"] or "emb" + m["eab"]] = tensor
    modules = {mod: _lora_module(mod, ab, cfg, wfile) for mod, ab in pairs.items()}
    if not modules:
        raise MergeInputError(f"{wfile}: no LoRA weights")
    return cfg, modules, wfile, saved_base


def _lora_module(mod: str, ab: dict[str, Tensor], cfg: dict, wfile: Path) -> LoraModule:
    """One module's factors with its scale (peft's ``rank_pattern`` / ``alpha_pattern`` / rsLoRA rules)."""
    embedding = set(ab) == {"embA", "embB"}
    if embedding:
        ab = {"A": ab["embA"], "B": ab["embB"]}
    if set(ab) != {"A", "B"} or ab["A"].dim() != 2 or ab["B"].dim() != 2:
        raise MergeInputError(f"{wfile}: module {mod!r} needs 2-D lora_A and lora_B weights (convolutions "
                              "are not supported)")
    r = int(_pattern_value(cfg.get("rank_pattern"), mod, cfg.get("r", 8)))
    alpha = float(_pattern_value(cfg.get("alpha_pattern"), mod, cfg.get("lora_alpha", 8)))
    if ab["A"].shape[0] != r or ab["B"].shape[1] != r:
        raise MergeInputError(f"{wfile}: module {mod!r} has rank {ab['A'].shape[0]} but the config says r={r}")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    transpose = embedding or bool(cfg.get("fan_in_fan_out", False))
    return LoraModule(mod, ab["A"], ab["B"], scale, transpose, embedding)


def match_base_key(module: str, base_keys: set[str] | dict, where: str) -> str:
    """The base key that module ``module`` changes: ``<mod>.weight``, with or without a ``model.`` prefix,
    else the one base key ending in ``.<mod>.weight``."""
    candidates = [f"{module}.weight", f"model.{module}.weight"]
    if module.startswith("model."):
        candidates.append(f"{module[len('model.'):]}.weight")
    for key in candidates:
        if key in base_keys:
            return key
    tail = [k for k in base_keys if k.endswith(f".{module}.weight")]
    if len(tail) == 1:
        return tail[0]
    raise MergeInputError(f"{where}: LoRA module {module!r} matches no base key (tried {', '.join(candidates)}"
                          f"{'; several keys end with it' if tail else ''})")


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
    there) and the base tensor unchanged elsewhere. It subclasses :class:`ParamSource` only so that
    :class:`~clmerge.merging.ModelSet` accepts it as a source; it reads nothing itself.

    Args:
        adapter_dir: the adapter folder.
        base: a lazy source with ``keys()``, ``meta(k)``, ``get(k)`` and ``name`` (the model the adapter
            was trained on).

    Attributes:
        name: the folder, for error messages.
        files: the adapter weight files.
        delta_keys: the base keys the adapter changes.
        modules: ``{base key: LoraModule}``.
        config: the adapter's ``adapter_config.json``.
        warning: a one-line warning when the config names another base model than ``base`` (else ``None``).

    Raises:
        MergeInputError: as :func:`read_adapter`, a module that matches no base key, or a Delta W whose
            shape is not the base weight's (names the module and both shapes).
    """

    def __init__(self, adapter_dir: str | Path, base: Any) -> None:  # noqa: D107 (no ParamSource.__init__)
        self.name = str(adapter_dir)
        self.base = base
        self.config, by_module, wfile, saved_base = read_adapter(adapter_dir)
        self.files = [wfile]
        base_keys = set(base.keys())
        self.modules: dict[str, LoraModule] = {}
        for mod, lm in by_module.items():
            key = match_base_key(mod, base_keys, self.name)
            shape, dtype = source_meta(base, key)
            check_dtype(base, key, dtype)
            shape = tuple(shape)
            dshape = (lm.lora_b.shape[0], lm.lora_a.shape[1])
            dshape = dshape[::-1] if lm.transpose else dshape
            if shape != dshape:
                raise MergeInputError(f"{self.name}: module {mod!r} gives a delta of shape {list(dshape)} but "
                                      f"{base.name} has {key!r} of shape {list(shape)}")
            self.modules[key] = lm
        self.delta_keys = set(self.modules)
        self._check_saved_base(saved_base, base_keys)
        self.warning = base_model_mismatch(self.name, self.config, base)

    def _check_saved_base(self, saved: dict[str, Tensor], base_keys: set[str]) -> None:
        """The base weights peft saved beside an adapted embedding must be the base's own (no resized vocab)."""
        for mod_key, tensor in saved.items():
            key = match_base_key(mod_key[: -len(".weight")], base_keys, self.name)
            if not torch.equal(tensor, self.base.get(key).to(tensor.dtype)):
                raise MergeInputError(f"{self.name}: the adapter saves its own {key!r} (a resized or trained "
                                      f"embedding) that differs from {self.base.name}; not supported")

    def keys(self) -> list[str]:
        return list(self.base.keys())

    def meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        shape, dtype = self.base.meta(key)
        return (tuple(shape), torch.float32) if key in self.modules else (tuple(shape), dtype)

    def delta(self, key: str, dtype: torch.dtype = torch.float32) -> Tensor:
        """``Delta W`` of base key ``key`` alone (float32 unless ``dtype`` says otherwise)."""
        return self.modules[key].delta(dtype)

    def get(self, key: str) -> Tensor:
        if key not in self.modules:
            return self.base.get(key)
        return self.delta(key).add_(self.base.get(key))  # the fresh delta takes the sum: base is never modified


def write_adapter(out_dir: Path, modules: dict[str, tuple[Tensor, Tensor]], config: dict,
                  embeddings: set[str] = frozenset()) -> None:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``out_dir`` (an existing,
    private temporary folder; the caller renames it into place).

    Args:
        out_dir: the folder.
        modules: ``{module name: (A, B)}``, ``A`` of shape ``(r, in)`` and ``B`` of ``(out, r)``.
        config: the adapter config (written as is).
        embeddings: modules that are ``nn.Embedding`` (written as ``lora_embedding_A/B``; ``A`` is
            ``(r, num_embeddings)``, ``B`` ``(embedding_dim, r)``).
    """
    from safetensors.torch import save_file

    check_finite_output([f"{mod}.lora_{ab}" for mod, pair in modules.items() for ab, t in zip("AB", pair)
                         if not is_finite(t)], "the adapter")
    tensors = {}
    for mod, (a, b) in modules.items():
        names = ("lora_embedding_A", "lora_embedding_B") if mod in embeddings else ("lora_A.weight", "lora_B.weight")
        tensors[f"{PREFIX}{mod}.{names[0]}"] = a.detach().contiguous()
        tensors[f"{PREFIX}{mod}.{names[1]}"] = b.detach().contiguous()
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def adapter_config(*, r: int, alpha: float, targets: list[str], fan_in_fan_out: bool = False,
                   rank_pattern: dict | None = None, alpha_pattern: dict | None = None,
                   base_model: str | None = None, task_type: str | None = None) -> dict:
    """A plain LoRA ``adapter_config.json`` that ``peft.PeftModel.from_pretrained`` reads.

    Pattern keys are escaped module names (peft reads them as regexes matched at the end of a name).
    """
    return {
        "peft_type": "LORA", "task_type": task_type, "base_model_name_or_path": base_model, "inference_mode": True,
        "r": int(r), "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": sorted(targets),
        "fan_in_fan_out": fan_in_fan_out, "bias": "none", "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "init_lora_weights": True,
        "rank_pattern": {re.escape(k): v for k, v in (rank_pattern or {}).items()},
        "alpha_pattern": {re.escape(k): v for k, v in (alpha_pattern or {}).items()},
    }
