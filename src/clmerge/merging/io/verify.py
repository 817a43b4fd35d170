"""Verification of a written model or adapter folder: what a merge checks before it moves its output into place,
and what ``clmerge verify DIR [--against BASE]`` checks on any folder.

A model folder (``config.json`` + safetensors or ``.bin`` weights + tokenizer files) passes when:

- **transformers reloads it cleanly.** The folder is loaded with ``from_pretrained(..., output_loading_info=True,
  device_map="meta", ignore_mismatched_sizes=True)`` of the class its config names (``architectures[0]``, else
  ``AutoModelForCausalLM``) on the meta device: no tensor data is read, and transformers' own loading info is
  what is reported. A *missing* key is a tensor the architecture's config implies that the folder lacks
  (transformers would initialise it at random: e.g. ``q_norm``/``k_norm`` of a Qwen3 layer, or ``lm_head`` of
  an untied model); a *mismatched* one has another shape than the config says (it would be re-initialised too);
  an *unexpected* one is a tensor the architecture has no place for.
- **dtypes** of floating tensors are the config's ``dtype`` (or the dtype transformers gives that parameter, as
  for ``_keep_in_fp32_modules``), or the dtype the same key has in the reference model.
- **every tensor is finite** (a merge's writer checks each tensor as it writes it; ``clmerge verify`` reads
  each one).
- **tied embeddings agree with ``tie_word_embeddings``**: tied, a stored output projection that differs from
  the input embedding is refused (transformers ties the two and silently drops the stored one); untied, a
  missing output projection is refused (transformers would initialise it at random).
- **the tokenizer fits the embedding**: every token id (core vocabulary and added tokens) has a row of the
  input embedding (a truncated vocabulary, or an added token without a row, is refused).
- **special tokens and the chat template are preserved** against the reference tokenizer (the tokenizer a merge
  copied or built its own from, or ``--against``'s): each special token of the reference is in the output
  with the same string (and the same id where both have a ``tokenizer.json``); a reference's chat template is
  in the output unchanged.

An adapter folder (``adapter_config.json``) passes when its tensors and its config agree: every module has a
``lora_A``/``lora_B`` pair whose inner dimension is the module's rank (``rank_pattern``, else ``r``), every
module is named by ``target_modules``, every tensor is finite, and, given the base model, every module is a
base weight whose shape matches ``B @ A``.

Nothing here writes except :func:`card_section` (the model card's section). Every file is read through the
input boundary (:mod:`clmerge.utils.inpaths`); transformers reads only checked files (:func:`_staged`).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import InputError
from ...utils import inpaths
from .base import MergeInputError

__all__ = ["CHECKS", "Verification", "VerificationError", "card_section", "verify_adapter_folder", "verify_folder",
           "same_architecture", "verify_model_folder", "warm_up"]

#: The checks of a model folder, in the order the report lists them.
CHECKS = ("weights", "transformers reload", "dtypes", "finite", "tied embeddings", "tokenizer rows",
          "special tokens", "chat template")
ADAPTER_CHECKS = ("weights", "adapter config", "ranks", "target modules", "finite", "base shapes")

_SHOWN = 5
# module names of embedding matrices (input, output) used when transformers cannot name them
_INPUT_NAMES = ("embed_tokens", "wte", "word_embeddings", "embed_in", "shared")
_OUTPUT_NAMES = ("lm_head", "embed_out")
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class VerificationError(MergeInputError):
    """A written folder failed verification (exit code 3); the message names every problem."""

    def __init__(self, verification: Verification) -> None:
        self.verification = verification
        super().__init__(verification.message())


@dataclass
class Verification:
    """What :func:`verify_folder` found.

    Attributes:
        folder: the folder checked (as shown in messages).
        kind: ``"model"`` or ``"adapter"``.
        checks: per check, ``"passed"``, ``"failed"`` or ``"skipped: <why>"``.
        problems: one line per problem (each names the check, the key or token, and what was expected).
        notes: what passed with a remark (an output projection stored twice but equal, ...).
        seconds: how long the verification took.
    """

    folder: str
    kind: str = "model"
    checks: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def passed(self, check: str) -> None:
        self.checks.setdefault(check, "passed")

    def skipped(self, check: str, why: str) -> None:
        self.checks.setdefault(check, f"skipped: {why}")

    def fail(self, check: str, problem: str) -> None:
        self.checks[check] = "failed"
        self.problems.append(f"{check}: {problem}")

    def message(self) -> str:
        """The error of a failed verification, one line (the command line shows errors in at most 3 lines):
        the folder, then every problem, ``;``-separated (a merge also logs each on its own line)."""
        n = len(self.problems)
        return f"{self.folder}: verification failed ({n} problem{'s' if n != 1 else ''}): " + "; ".join(self.problems)

    def summary(self) -> str:
        """One line: passed / failed / skipped counts."""
        states = list(self.checks.values())
        skipped = sum(s.startswith("skipped") for s in states)
        verdict = "passed" if self.ok else f"FAILED ({len(self.problems)} problems)"
        passed = sum(s.startswith("passed") for s in states)
        return (f"verification {verdict}: {passed} checks passed, {states.count('failed')} failed, "
                f"{skipped} skipped ({self.seconds:.2f} s)")

    def to_dict(self) -> dict:
        return {"ok": self.ok, "kind": self.kind, "checks": dict(self.checks), "problems": list(self.problems),
                "notes": list(self.notes), "seconds": round(self.seconds, 3)}


def card_section(v: Verification) -> str:
    """The model card's ``## Verification`` section (Markdown)."""
    lines = ["## Verification", "",
             f"Checked by clmerge before this folder was written ({v.summary()}); "
             "re-run with `clmerge verify` (docs/verify.md).", "", "| check | result |", "|---|---|"]
    lines += [f"| {name} | {state} |" for name, state in v.checks.items()]
    lines += [""] + [f"- note: {n}" for n in v.notes] + ([""] if v.notes else [])
    lines += [f"- problem: {p}" for p in v.problems] + ([""] if v.problems else [])
    return "\n".join(lines)


def _shown(items: Iterable[Any]) -> str:
    items = sorted(map(str, items))
    return ", ".join(items[:_SHOWN]) + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def _grouped(keys: Iterable[str]) -> str:
    """``model.layers.{0, 1}.self_attn.q_norm.weight``: keys that differ only in their layer number, as one."""
    groups: dict[str, list[str]] = {}
    for k in keys:
        m = re.search(r"\.(\d+)\.", k)
        pattern = k[:m.start()] + ".{}." + k[m.end():] if m else k
        groups.setdefault(pattern, []).append(m.group(1) if m else "")
    shown = []
    for pattern, layers in groups.items():
        layers = sorted(layers, key=lambda s: int(s) if s.isdigit() else -1)
        shown.append(pattern.replace("{}", "{" + ", ".join(layers) + "}") if "{}" in pattern else pattern)
    return _shown(shown)


# --- reading a folder (headers, config, tokenizer files) ---


def _json(folder: Path, name: str, kind: str = "json") -> Any:
    path = folder / name
    if not path.exists():
        return None
    what = f"{folder}: model file"
    return inpaths.read_json(inpaths.inside(folder, name, what), within=folder, what=what, kind=kind)


def _text(folder: Path, name: str) -> str | None:
    path = folder / name
    if not path.exists():
        return None
    what = f"{folder}: model file"
    return inpaths.read_text(inpaths.inside(folder, name, what), within=folder, what=what, kind="tokenizer")


def _text_config(config: dict) -> dict:
    """A config with its language part (``text_config``) merged in, the top level winning."""
    text = config.get("text_config")
    return {**text, **config} if isinstance(text, dict) else config


def _is_source(obj: Any) -> bool:
    return obj is not None and not isinstance(obj, (str, Path)) and hasattr(obj, "meta")


def _open(folder: Path) -> Any:
    from .readers import open_checkpoint

    return open_checkpoint(folder, name=str(folder))


# --- transformers' loading info ---

_WARM: dict[str, Any] = {}
_WARM_LOCK = threading.Lock()


def _model_class(config: dict) -> tuple[Any, str] | str:
    """The transformers class that loads this config (``architectures[0]``, else ``AutoModelForCausalLM``), or
    why there is none (transformers missing, an unknown or remote-code architecture)."""
    try:
        import transformers
    except ImportError:
        return "transformers is not installed"
    arch = (config.get("architectures") or [None])[0]
    if isinstance(arch, str):
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls, arch
    model_type = config.get("model_type")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        return f"transformers {transformers.__version__} does not know model_type {model_type!r}" + \
            (f" (architecture {arch})" if arch else "") + " (remote code is never run)"
    return transformers.AutoModelForCausalLM, "AutoModelForCausalLM"


def warm_up(config: dict | None, tensors: dict[str, tuple] | None = None) -> threading.Thread | None:
    """Import transformers and the model class of ``config`` in a background thread (a merge starts this
    while it merges, so the reload check at the end costs only the meta-device load). Not started when the
    cache holds transformers' answer for this config and these ``tensors`` (``{key: (shape, dtype)}`` of the
    input: a merge's output has the same ones) already: the check at the end then imports nothing."""
    if tensors is not None and _seen(config or {}, tensors):
        return None

    def run() -> None:
        with contextlib.suppress(Exception):  # the check at the end reports any problem itself
            with _WARM_LOCK:
                if config:
                    _model_class(config)
                else:
                    import transformers  # noqa: F401
    thread = threading.Thread(target=run, name="clmerge-verify-warmup", daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' load report and progress bars off for the call (restored after)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


@dataclass
class _Loaded:
    """What the checks need of transformers' load (cached as JSON: :func:`_cache_file`)."""

    name: str  # the class that loaded it
    missing: list[str]
    unexpected: list[str]
    mismatched: list[list]  # [key, shape in the folder, shape the config implies]
    errors: list[str]
    tie: bool
    ins: str | None  # the input embedding's key (transformers' get_input_embeddings)
    outs: str | None  # the output projection's key
    dtypes: dict[str, str]  # key -> the dtype transformers gives that parameter
    cached: bool = False


def _dtype_names(tensors: dict[str, tuple]) -> list:
    return sorted([k, list(shape), str(dtype).removeprefix("torch.")] for k, (shape, dtype) in tensors.items())


def _cache_root() -> Path | None:
    """``$XDG_CACHE_HOME/clmerge/verify`` (``~/.cache/...``); ``None`` with ``CLMERGE_VERIFY_CACHE=0``."""
    import os

    if os.environ.get("CLMERGE_VERIFY_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "clmerge" / "verify"


def _digest(*parts: Any) -> str | None:
    """sha256 of the installed transformers' version and ``parts`` (``None`` without transformers)."""
    import hashlib
    import json
    from importlib import metadata

    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None
    blob = json.dumps([version, *parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


_DTYPE_KEYS = ("dtype", "torch_dtype", "transformers_version")


def _architecture(config: dict, meta: dict[str, tuple]) -> tuple[dict, dict]:
    """What transformers' missing / unexpected / mismatched keys are a function of: the config without its dtype
    (and the version that wrote it) and every tensor's name and shape (not its dtype, not its values)."""
    return ({k: v for k, v in config.items() if k not in _DTYPE_KEYS},
            {k: tuple(shape) for k, (shape, _) in meta.items()})


def _cache_file(config: dict, tensors: dict[str, tuple]) -> Path | None:
    """Where transformers' loading info for this config and these tensors' names, shapes and dtypes is kept:
    it is a function of exactly those and of the transformers version (no tensor value enters it), so a
    folder with the same ones gets the same answer without importing transformers again."""
    root, key = _cache_root(), _digest("loading-info", config, _dtype_names(tensors))
    return root / f"{key}.json" if root is not None and key is not None else None


def _seen_file(config: dict, tensors: dict[str, tuple]) -> Path | None:
    """A marker that this architecture (config without its dtype) and these tensors' names and shapes were
    loaded before: a merge of such inputs skips the warm-up import."""
    root, key = _cache_root(), _digest("seen", *_architecture(config, tensors))
    return root / f"seen-{key}" if root is not None and key is not None else None


def _seen(config: dict, tensors: dict[str, tuple]) -> bool:
    marker = _seen_file(config, tensors)
    return marker is not None and marker.exists()


def _cached(config: dict, tensors: dict[str, tuple]) -> _Loaded | None:
    path = _cache_file(config, tensors)
    if path is None or not path.is_file():
        return None
    try:
        data = inpaths.read_json(path, within=path.parent, what="verification cache")
        return _Loaded(**{**data, "cached": True})
    except (InputError, TypeError):  # torn or from another version of this module: load again
        return None


def _store(loaded: _Loaded, config: dict, tensors: dict[str, tuple]) -> None:
    import dataclasses

    from ...utils.io import write_json

    path, marker = _cache_file(config, tensors), _seen_file(config, tensors)
    if path is None or marker is None:
        return
    with contextlib.suppress(OSError):  # a read-only home: the next verification loads again
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {k: v for k, v in dataclasses.asdict(loaded).items() if k != "cached"})
        marker.touch()


def _load(folder: Path, config: dict, v: Verification, check: str) -> _Loaded | None:
    """transformers' load on the meta device (no tensor data read), reduced to :class:`_Loaded`."""
    with _WARM_LOCK:
        found = _model_class(config)
    if isinstance(found, str):
        v.skipped(check, found)
        return None
    cls, name = found
    try:
        with _staged(folder) as staged, _quiet_transformers():
            model, info = cls.from_pretrained(str(staged), output_loading_info=True, device_map="meta",
                                              ignore_mismatched_sizes=True, trust_remote_code=False,
                                              local_files_only=True)
    except (InputError, OSError) as exc:
        v.fail(check, f"{name}.from_pretrained cannot read the folder ({exc})")
        return None
    except Exception as exc:  # transformers raises many types for a folder it cannot load
        why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        v.fail(check, f"{name}.from_pretrained fails: {type(exc).__name__}: {why}")
        return None
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    ins = outs = None
    with contextlib.suppress(Exception):
        ins = _param_name(model, model.get_input_embeddings())
        outs = _param_name(model, model.get_output_embeddings())
    return _Loaded(name, sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ()),
                   sorted([k, list(a), list(b)] for k, a, b in info.get("mismatched_keys") or ()),
                   [str(e).splitlines()[0][:200] for e in info.get("error_msgs") or () if e],
                   bool(getattr(text_config, "tie_word_embeddings", False)), ins, outs,
                   {k: str(t.dtype).removeprefix("torch.") for k, t in model.state_dict().items()})


def _loading_info(folder: Path, config: dict, meta: dict[str, tuple], v: Verification,
                  check: str) -> _Loaded | None:
    loaded = _cached(config, meta)
    if loaded is None:
        loaded = _load(folder, config, v, check)
        if loaded is not None:
            _store(loaded, config, meta)
    return loaded


def _inherited(loaded: _Loaded, ref: _Loaded, v: Verification) -> None:
    """Move what the reference model reports too (a base that transformers itself loads with missing or
    unexpected keys) from ``loaded`` into a note: the merge did not introduce it."""
    same = {"missing": set(loaded.missing) & set(ref.missing),
            "unexpected": set(loaded.unexpected) & set(ref.unexpected)}
    ref_mismatched = {k: (a, b) for k, a, b in ref.mismatched}
    same_mm = [m for m in loaded.mismatched if ref_mismatched.get(m[0]) == (m[1], m[2])]
    for what, keys in same.items():
        if keys:
            v.notes.append(f"transformers reports {len(keys)} {what} key(s) in the reference too (not introduced "
                           f"here): {_grouped(keys)}")
    if same_mm:
        v.notes.append(f"transformers reports {len(same_mm)} tensor(s) of another shape than the config implies in "
                       f"the reference too: {_shown(m[0] for m in same_mm)}")
    loaded.missing = [k for k in loaded.missing if k not in same["missing"]]
    loaded.unexpected = [k for k in loaded.unexpected if k not in same["unexpected"]]
    loaded.mismatched = [m for m in loaded.mismatched if m not in same_mm]


def same_architecture(models: Iterable[tuple[dict, dict[str, tuple]]]) -> bool:
    """Whether every ``(config, tensors)`` pair has one :func:`_architecture` (a merge of such inputs writes it
    too); False for none."""
    archs = [_architecture(config, meta) for config, meta in models]
    return bool(archs) and all(a == archs[0] for a in archs[1:])


def _as_reference(v: Verification, check: str, reference: tuple[Path, dict, dict]) -> _Loaded | None:
    """The reload check of a folder with the reference's :func:`_architecture`, answered from the reference
    (``reload="auto"``): transformers reports for the folder exactly what it reports for the reference, which the
    merge did not introduce (notes, not problems), so it is not loaded again. Returns the reference's cached
    loading info where there is one (its dtypes and embedding names serve the later checks), else ``None``."""
    ref_folder, ref_config, ref_meta = reference
    ref = _cached(ref_config, ref_meta)
    if ref is not None:
        import dataclasses

        loaded = dataclasses.replace(ref)
        _inherited(loaded, ref, v)
        v.checks[check] = f"passed (the reference's config and tensors: loaded as {ref_folder} loads, cached)"
        return loaded
    v.checks[check] = (f"passed (the reference's config and tensor names and shapes: transformers loads it as it "
                       f"loads {ref_folder}, so it was not loaded again)")
    v.notes.append(f"transformers was not asked about {ref_folder} itself (the merge changed no key, shape or "
                   f"config entry but the dtype); `clmerge verify` asks it")
    return None


def _reload(folder: Path, config: dict, meta: dict[str, tuple], v: Verification,
            reference: tuple[Path, dict, dict] | None = None, mode: str = "always") -> _Loaded | None:
    """transformers' loading info (cached: :func:`_cache_file`); records the reload check. ``None`` when the
    check was skipped, answered from the reference (``mode="auto"``: :func:`_as_reference`) or the load failed.
    ``reference``: ``(folder, config, tensors)`` of the reference model, whose own missing / unexpected /
    mismatched keys are notes here, not problems."""
    import dataclasses

    check = "transformers reload"
    loaded = None
    if mode == "auto" and reference is not None and \
            _architecture(config, meta) == _architecture(reference[1], reference[2]):
        loaded = _cached(config, meta)  # this folder's own answer, where an earlier load gave one
        if loaded is None:
            return _as_reference(v, check, reference)
    if loaded is None:
        loaded = _loading_info(folder, config, meta, v, check)
    if loaded is None:
        return None
    if reference is not None and (loaded.missing or loaded.unexpected or loaded.mismatched):  # only then asked
        scratch = Verification(str(reference[0]))
        ref = _loading_info(*reference, scratch, check)
        if ref is not None and (ref.missing or ref.unexpected or ref.mismatched):
            loaded = dataclasses.replace(loaded)
            _inherited(loaded, ref, v)
    name = loaded.name
    if loaded.missing:
        v.fail(check, f"{len(loaded.missing)} tensor(s) that {name} expects from this config are missing, so "
                      f"transformers would initialise them at random: {_grouped(loaded.missing)}")
    if loaded.mismatched:
        shown = "; ".join(f"{k} is {a}, the config implies {b}" for k, a, b in loaded.mismatched[:_SHOWN])
        v.fail(check, f"{len(loaded.mismatched)} tensor(s) have another shape than the config implies "
                      f"(transformers would initialise them at random): {shown}")
    if loaded.unexpected:
        v.fail(check, f"{len(loaded.unexpected)} tensor(s) that {name} has no place for (unexpected: "
                      f"transformers ignores them): {_grouped(loaded.unexpected)}")
    if loaded.errors:
        v.fail(check, f"transformers reports: {loaded.errors[0]}")
    v.checks.setdefault(check, "passed (cached loading info)" if loaded.cached else "passed")
    return loaded


_STAGED = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
           "pytorch_model.bin", "pytorch_model.bin.index.json")


@contextlib.contextmanager
def _staged(folder: Path) -> Iterator[Path]:
    """A private folder of links to the checked config and weights files of ``folder`` (the shards an index
    lists included), so transformers reads exactly what was checked (as :func:`.staging.staged_model`, which
    this module cannot import: it imports the writer, which imports this)."""
    import os
    import tempfile

    from .readers import shard_map

    entries: dict[str, tuple[Path, int | None]] = {}
    for name in _STAGED:
        if not os.path.lexists(folder / name):
            continue
        path = inpaths.inside(folder, name, f"{folder}: model file")
        weights = name.endswith((".safetensors", ".bin"))
        entries[name] = (path, None if weights else inpaths.LIMITS["json"])
        if name.endswith(".index.json"):
            entries.update({entry: (shard, None) for entry, shard in shard_map(path).items()})
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="clmerge-verify-")))
        for name, (path, cap) in entries.items():
            checked = stack.enter_context(inpaths.checked_path(path, within=folder, what=f"{folder}: model file",
                                                               max_bytes=cap if cap is not None else 1 << 62))
            link = tmp / name
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(checked if checked.startswith("/proc/") else os.path.abspath(path), link)
        yield tmp


def _param_name(model: Any, module: Any) -> str | None:
    if module is None:
        return None
    for name, mod in model.named_modules():
        if mod is module:
            return f"{name}.weight" if name else "weight"
    return None


def _embedding_names(meta: dict[str, tuple], model: _Loaded | None) -> tuple[str | None, str | None]:
    """``(input embedding key, output projection key)``: transformers' own when the model loaded, else by name."""
    if model is not None:
        return model.ins, model.outs
    ins = outs = None
    for k, (shape, _) in meta.items():
        m = re.search(r"(?:^|\.)([A-Za-z_]+)\.weight$", k)
        if m is None or len(shape) != 2 or re.search(r"\.\d+\.", k):
            continue
        ins = ins or (k if m.group(1) in _INPUT_NAMES else None)
        outs = outs or (k if m.group(1) in _OUTPUT_NAMES else None)
    return ins, outs


# --- the checks ---


def _config_dtype(config: dict) -> Any:
    import torch

    name = config.get("dtype") or config.get("torch_dtype")
    if isinstance(name, str) and isinstance(getattr(torch, name.removeprefix("torch."), None), torch.dtype):
        return getattr(torch, name.removeprefix("torch."))
    return None


def _check_dtypes(v: Verification, config: dict, meta: dict[str, tuple], model: _Loaded | None,
                  ref_meta: dict[str, tuple] | None) -> None:
    check = "dtypes"
    want = _config_dtype(_text_config(config))
    if want is None:
        v.skipped(check, "config.json records no dtype")
        return
    expected = model.dtypes if model is not None else {}
    bad = []
    for k, (_, dtype) in meta.items():
        if not dtype.is_floating_point or dtype == want or expected.get(k) == str(dtype).removeprefix("torch."):
            continue
        if ref_meta is not None and k in ref_meta and ref_meta[k][1] == dtype:
            continue
        bad.append(f"{k} ({str(dtype).removeprefix('torch.')})")
    if bad:
        v.fail(check, f"{len(bad)} floating tensor(s) are not the config's dtype {str(want).removeprefix('torch.')}"
                      f" (nor the reference's dtype for that key): {_shown(bad)}")
    v.passed(check)


def _check_finite(v: Verification, src: Any, meta: dict[str, tuple], finite_checked: bool) -> None:
    check = "finite"
    if finite_checked:
        v.checks[check] = "passed (each tensor checked as it was written)"
        return
    from .checks import is_finite

    bad = [k for k, (_, d) in meta.items() if d.is_floating_point and not is_finite(src.get(k))]
    if bad:
        v.fail(check, f"{len(bad)} tensor(s) hold NaN or Inf: {_shown(bad)}")
    v.passed(check)


def _check_tied(v: Verification, config: dict, meta: dict[str, tuple], model: _Loaded | None, src: Any) -> None:
    import torch

    check = "tied embeddings"
    if model is not None:
        tie = model.tie
    else:
        tie = _text_config(config).get("tie_word_embeddings")
    ins, outs = _embedding_names(meta, model)
    if tie is None:
        v.skipped(check, "config.json does not say tie_word_embeddings and transformers did not load it")
        return
    if outs is None or ins is None:
        v.skipped(check, "the model has no separate input embedding and output projection")
        return
    if tie and outs in meta and ins in meta:
        if meta[outs] != meta[ins] or not torch.equal(src.get(outs), src.get(ins)):
            v.fail(check, f"tie_word_embeddings is true but {outs} is stored and differs from {ins}: transformers "
                          f"ties them and drops the stored {outs} (the merged output projection would be lost); "
                          f"expected {outs} absent or equal to {ins}")
        else:
            v.notes.append(f"{outs} is stored although tied; it equals {ins}")
    elif not tie and outs not in meta and ins in meta:
        v.fail(check, f"tie_word_embeddings is false but {outs} is missing: transformers would initialise the output "
                      f"projection at random; expected {outs} (or tie_word_embeddings: true)")
    v.passed(check)


@dataclass
class _Tok:
    """What the checks need of a saved tokenizer."""

    ids: dict[str, int]  # token -> id (empty when only a size is known)
    size: int  # largest id + 1 of the core vocabulary
    added: dict[str, int]  # added tokens
    specials: dict[str, str]  # bos_token etc. and additional ones (name -> token string)
    template: Any  # the chat template (a string, or a list of named ones), None when there is none
    source: str = ""


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_tokenizer(folder: Path) -> _Tok | None:
    """The vocabulary, added tokens, special tokens and chat template saved in ``folder`` (no transformers), or
    ``None`` when it holds no tokenizer whose vocabulary can be read this way."""
    ids: dict[str, int] = {}
    added: dict[str, int] = {}
    size, source = 0, ""
    data = _json(folder, "tokenizer.json", "tokenizer")
    if isinstance(data, dict):
        vocab = (data.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):
            ids = {str(t): int(i) for t, i in vocab.items()}
        elif isinstance(vocab, list):  # Unigram: [piece, score] in id order
            ids = {str(p[0]): i for i, p in enumerate(vocab)}
        size = max(ids.values(), default=-1) + 1
        added = {e["content"]: int(e["id"]) for e in data.get("added_tokens") or () if "content" in e}
        source = "tokenizer.json"
    elif (vocab_json := _json(folder, "vocab.json", "tokenizer")) is not None and isinstance(vocab_json, dict):
        ids = {str(t): int(i) for t, i in vocab_json.items()}
        size, source = max(ids.values(), default=-1) + 1, "vocab.json"
    elif (vocab_txt := _text(folder, "vocab.txt")) is not None:
        ids = {t: i for i, t in enumerate(vocab_txt.splitlines())}
        size, source = len(ids), "vocab.txt"
    extra = _json(folder, "added_tokens.json", "tokenizer")
    if isinstance(extra, dict):
        added.update({str(t): int(i) for t, i in extra.items()})
    tok_config = _json(folder, "tokenizer_config.json", "tokenizer") or {}
    special_map = _json(folder, "special_tokens_map.json", "tokenizer") or {}
    if not source and not tok_config and not special_map:
        return None
    specials: dict[str, str] = {}
    for cfg in (special_map, tok_config):  # the tokenizer config wins, as in transformers
        for name in _SPECIAL_NAMES:
            text = _token_text(cfg.get(name)) if isinstance(cfg, dict) else None
            if text is not None:
                specials[name] = text
        for key in ("additional_special_tokens", "extra_special_tokens"):
            extra_tokens = cfg.get(key) if isinstance(cfg, dict) else None
            items = extra_tokens.values() if isinstance(extra_tokens, dict) else extra_tokens or []
            for t in items:
                if (text := _token_text(t)) is not None:
                    specials[f"{key}: {text}"] = text
    decoder = tok_config.get("added_tokens_decoder") if isinstance(tok_config, dict) else None
    for i, entry in (decoder or {}).items():
        if isinstance(entry, dict) and isinstance(entry.get("content"), str) and str(i).isdigit():
            added.setdefault(entry["content"], int(i))
    template = tok_config.get("chat_template") if isinstance(tok_config, dict) else None
    jinja = _text(folder, "chat_template.jinja")
    template = jinja if jinja is not None else template
    chat_json = _json(folder, "chat_template.json", "tokenizer")
    if template is None and isinstance(chat_json, dict):
        template = chat_json.get("chat_template")
    return _Tok(ids, size, added, specials, template or None, source)


def _check_tokenizer(v: Verification, folder: Path, meta: dict[str, tuple], model: _Loaded | None,
                     tok_ref: Path | None, template_ref: Path | None) -> None:
    tok = _read_tokenizer(folder)
    if tok is None:
        for check in ("tokenizer rows", "special tokens", "chat template"):
            v.skipped(check, "the folder holds no tokenizer files")
        return
    ins, _ = _embedding_names(meta, model)
    check = "tokenizer rows"
    if ins is None or ins not in meta:
        v.skipped(check, "no input embedding found")
    elif not tok.source:
        v.skipped(check, "no vocabulary file this check reads (tokenizer.json, vocab.json, vocab.txt)")
    else:
        rows = meta[ins][0][0]
        if tok.size > rows:
            v.fail(check, f"the tokenizer's vocabulary ({tok.source}) has ids 0..{tok.size - 1} but {ins} has "
                          f"{rows} rows: a truncated vocabulary (token ids {rows}..{tok.size - 1} have no row)")
        rowless = {t: i for t, i in tok.added.items() if i >= rows}
        if rowless:
            shown = _shown(f"{t!r} (id {i})" for t, i in rowless.items())
            v.fail(check, f"{len(rowless)} added token(s) have no row in {ins} ({rows} rows): {shown}")
        v.passed(check)
    ref = _read_tokenizer(tok_ref) if tok_ref is not None else None
    check = "special tokens"
    if ref is None:
        v.skipped(check, "no reference tokenizer" if tok_ref is None else f"{tok_ref} holds no tokenizer")
    else:
        out_ids = {**tok.ids, **tok.added}
        ref_ids = {**ref.ids, **ref.added}
        for name, text in ref.specials.items():
            got = tok.specials.get(name)
            if got != text:
                v.fail(check, f"{name} is {text!r} in the reference ({tok_ref}) but "
                              f"{'absent' if got is None else repr(got)} here")
            elif text in ref_ids and text in out_ids and ref_ids[text] != out_ids[text]:
                v.fail(check, f"{name} {text!r} has id {ref_ids[text]} in the reference ({tok_ref}) but "
                              f"{out_ids[text]} here")
        v.passed(check)
    template_src = template_ref if template_ref is not None else tok_ref
    tref = (ref if template_src == tok_ref else _read_tokenizer(template_src)) if template_src is not None else None
    check = "chat template"
    if tref is None:
        v.skipped(check, "no reference tokenizer" if template_src is None else f"{template_src} holds no tokenizer")
    elif tref.template is None:
        v.skipped(check, f"the reference ({template_src}) has no chat template")
    elif tok.template is None:
        v.fail(check, f"the chat template of the reference ({template_src}) was dropped; expected it in "
                      "tokenizer_config.json or chat_template.jinja")
    elif tok.template != tref.template:
        v.fail(check, f"the chat template differs from the reference's ({template_src})")
    else:
        v.passed(check)


def verify_model_folder(folder: str | Path, *, reference: Any = None,
                        tokenizer_reference: str | Path | None = None, template_reference: str | Path | None = None,
                        finite_checked: bool = False, name: str | None = None,
                        reload: str = "always") -> Verification:
    """Verify a model folder (the module docstring's checks).

    Args:
        reference: a model folder (or an opened source) whose dtypes per key are accepted (the base,
            ``--against``).
        tokenizer_reference: the tokenizer folder whose special tokens must be preserved (default: ``reference``).
        template_reference: the folder whose chat template must be preserved (default: ``tokenizer_reference``).
        finite_checked: every tensor was checked finite as it was written (a merge's writer): not read again.
        name: how messages name the folder (default: its path).
        reload: ``"always"`` loads the folder in transformers (from the cache when it answered for this config
            and these tensors before); ``"auto"`` (a merge's check) does not when the folder has the
            ``reference``'s config (but its dtype) and tensor names and shapes: transformers would report for it
            what it reports for the reference, which the merge did not introduce.
    """
    if reload not in ("always", "auto"):
        raise ValueError(f"reload must be 'always' or 'auto', not {reload!r}")
    t0 = time.perf_counter()
    folder = Path(folder)
    v = Verification(name or str(folder), "model")
    ref_folder = getattr(reference, "folder", None) if _is_source(reference) else reference
    tok_ref = Path(tokenizer_reference) if tokenizer_reference is not None else \
        (Path(ref_folder) if ref_folder is not None else None)
    try:
        config = _json(folder, "config.json")
        if config is not None and not isinstance(config, dict):
            v.fail("weights", "config.json is not a JSON object")
        if not isinstance(config, dict):  # weights files merged into a folder have none: nothing to check against
            config = {}
            v.notes.append("no config.json: the architecture checks were skipped")
        src = _open(folder)
        meta = {k: src.meta(k) for k in src.keys()}
    except (InputError, FileNotFoundError) as exc:
        v.fail("weights", str(exc))
        v.seconds = time.perf_counter() - t0
        return v
    v.passed("weights")
    ref_meta = ref_model = None
    if reference is not None:
        ref_src = reference if _is_source(reference) else _open(Path(reference))
        ref_meta = {k: ref_src.meta(k) for k in ref_src.keys()}
        lost = sorted(set(ref_meta) - set(meta))
        if lost:
            v.notes.append(f"{len(lost)} key(s) of the reference are not here: {_grouped(lost)}")
        ref_config = _json(Path(ref_folder), "config.json") if ref_folder is not None else None
        if isinstance(ref_config, dict):
            ref_model = (Path(ref_folder), ref_config, ref_meta)
    model = _reload(folder, config, meta, v, ref_model, reload) if config else None
    if not config:
        v.skipped("transformers reload", "no config.json")
        v.skipped("dtypes", "no config.json")
    _check_dtypes(v, config, meta, model, ref_meta)
    _check_finite(v, src, meta, finite_checked)
    _check_tied(v, config, meta, model, src)
    _check_tokenizer(v, folder, meta, model, tok_ref,
                     Path(template_reference) if template_reference is not None else None)
    v.checks = {c: v.checks[c] for c in CHECKS if c in v.checks}
    v.seconds = time.perf_counter() - t0
    return v


# --- adapters ---

_LORA = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+?)\.(?P<kind>lora_A|lora_B|lora_embedding_A|"
                   r"lora_embedding_B|lora_magnitude_vector)(?:\.(?!weight$|bias$)[A-Za-z0-9_-]+)?"
                   r"(?:\.(?P<leaf>weight|bias))?$")


def _targets_match(module: str, targets: Any) -> bool:
    """Whether peft's ``target_modules`` (a list of names matched as suffixes, a regex string, or
    ``all-linear``) names ``module``."""
    if targets in (None, "all-linear"):
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


def _pattern_value(module: str, pattern: dict, default: Any) -> Any:
    for key, value in (pattern or {}).items():  # peft: a key matches the module name, or as a regex suffix
        if module == key or module.endswith("." + key) or re.search(rf"(^|\.){key}$", module):
            return value
    return default


def verify_adapter_folder(folder: str | Path, *, base: Any = None, finite_checked: bool = False,
                          name: str | None = None) -> Verification:
    """Verify a PEFT LoRA adapter folder: config against tensors, ranks, target modules, finite values, and
    (given ``base``) every module's ``B @ A`` shape against the base weight."""
    t0 = time.perf_counter()
    folder = Path(folder)
    v = Verification(name or str(folder), "adapter")
    try:
        config = _json(folder, "adapter_config.json")
        weights = next((folder / n for n in ("adapter_model.safetensors", "adapter_model.bin")
                        if (folder / n).exists()), None)
        if weights is None:
            raise MergeInputError("no adapter_model.safetensors or adapter_model.bin")
        from .base import ParamSource

        src = ParamSource(inpaths.inside(folder, weights.name, f"{folder}: adapter file"), within=folder)
        meta = {k: src.meta(k) for k in src.keys()}
    except (InputError, FileNotFoundError) as exc:
        v.fail("weights", str(exc))
        v.seconds = time.perf_counter() - t0
        return v
    v.passed("weights")
    if not isinstance(config, dict):
        v.fail("adapter config", "adapter_config.json is missing or not a JSON object")
        config = {}
    elif str(config.get("peft_type", "LORA")).upper() != "LORA":
        v.skipped("adapter config", f"peft_type {config.get('peft_type')}: only LoRA adapters are checked")
        v.seconds = time.perf_counter() - t0
        return v
    elif not isinstance(config.get("r"), int) or config["r"] < 1:
        v.fail("adapter config", f"r must be a positive integer, got {config.get('r')!r}")
    v.passed("adapter config")
    modules: dict[str, dict[str, tuple]] = {}
    other = []
    for k, m in meta.items():
        hit = _LORA.match(k)
        if hit is None:
            other.append(k)
            continue
        modules.setdefault(hit.group("module"), {})[hit.group("kind") + ("." + hit.group("leaf")
                                                                          if hit.group("leaf") == "bias" else "")] = m
    saved = config.get("modules_to_save") or []
    stray = [k for k in other if not any(f".{s}." in f".{k}" for s in saved)]
    if stray:
        v.fail("adapter config", f"{len(stray)} tensor(s) are neither LoRA factors nor modules_to_save: "
                                 f"{_shown(stray)}")
    r0 = config.get("r") if isinstance(config.get("r"), int) else None
    bad_rank, unpaired = [], []
    for module, parts in modules.items():
        a = parts.get("lora_A") or parts.get("lora_embedding_A")
        b = parts.get("lora_B") or parts.get("lora_embedding_B")
        if a is None or b is None:
            unpaired.append(module)
            continue
        (sa, _), (sb, _) = a, b
        rank = sa[0]
        inner_b = sb[1] if len(sb) >= 2 else None
        want = _pattern_value(module, config.get("rank_pattern"), r0)
        if inner_b != rank or (want is not None and rank != want):
            bad_rank.append(f"{module} (A {list(sa)}, B {list(sb)}, config rank {want})")
    if unpaired:
        v.fail("ranks", f"{len(unpaired)} module(s) lack their lora_A or lora_B: {_shown(unpaired)}")
    if bad_rank:
        v.fail("ranks", f"{len(bad_rank)} module(s) whose factors disagree with each other or with r / "
                        f"rank_pattern: {_shown(bad_rank)}")
    v.passed("ranks")
    targets = config.get("target_modules")
    unnamed = [m for m in modules if not _targets_match(m, targets)]
    if unnamed:
        v.fail("target modules", f"{len(unnamed)} module(s) have factors but are not in target_modules "
                                 f"({targets!r}), so peft would not load them: {_shown(unnamed)}")
    if not modules:
        v.fail("target modules", "the adapter holds no LoRA factors")
    v.passed("target modules")
    _check_finite(v, src, meta, finite_checked)
    if base is None:
        v.skipped("base shapes", "no base model given")
    else:
        base_src = base if _is_source(base) else _open(Path(base))
        base_keys = set(base_src.keys())
        wrong = []
        for module, parts in modules.items():
            a = parts.get("lora_A") or parts.get("lora_embedding_A")
            b = parts.get("lora_B") or parts.get("lora_embedding_B")
            key = f"{module}.weight"
            if a is None or b is None:
                continue
            if key not in base_keys:
                wrong.append(f"{module} (no {key} in the base)")
                continue
            shape = tuple(base_src.meta(key)[0])
            emb = "lora_embedding_A" in parts
            delta = (a[0][1], b[0][0]) if emb else (b[0][0], a[0][1])
            if config.get("fan_in_fan_out") and not emb:  # GPT-2's Conv1D stores (in, out)
                delta = delta[::-1]
            if shape[:2] != delta:
                wrong.append(f"{module} (B @ A is {list(delta)}, the base weight {list(shape)})")
        if wrong:
            v.fail("base shapes", f"{len(wrong)} module(s) do not fit the base: {_shown(wrong)}")
        v.passed("base shapes")
    v.checks = {c: v.checks[c] for c in ADAPTER_CHECKS if c in v.checks}
    v.seconds = time.perf_counter() - t0
    return v


def verify_folder(folder: str | Path, *, against: Any = None, **kwargs: Any) -> Verification:
    """Verify a model folder (:func:`verify_model_folder`, ``against`` its ``reference``) or, when it holds
    ``adapter_config.json``, an adapter folder (:func:`verify_adapter_folder`, ``against`` its base)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"{folder}: not a folder (clmerge verify checks a model or adapter folder)")
    if (folder / "adapter_config.json").exists():
        keep = {k: v for k, v in kwargs.items() if k in ("finite_checked", "name")}
        return verify_adapter_folder(folder, base=against, **keep)
    return verify_model_folder(folder, reference=against, **kwargs)
