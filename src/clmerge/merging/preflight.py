"""Pre-flight of a merge from headers alone: ``config.json`` and the safetensors headers of every input, checked
before any tensor is read, so a merge of things that cannot be merged fails in one message naming what differs.

:func:`preflight` names, in this order (and stops after the first kind that finds something):

1. **architecture mismatches**: ``model_type``, the layer count (``num_hidden_layers``) or the hidden size
   (``hidden_size``, the language part of a multimodal config) differ between an input and the reference (the
   base, else the first model): "models[0] (X) is a bert (12 layers, hidden size 768), the base (Y) is a llama
   (2 layers, hidden size 64)";
2. **vocabulary mismatches** that the recipe has no ``embeddings:`` policy for: the inputs' embedding matrices
   have different row counts (or their configs different ``vocab_size``);
3. **missing keys**: the keys an input lacks, or has in excess, against the reference, grouped by layer; and
   tensors of one key with different shapes.

An input without ``config.json`` (a weights file, a PEFT adapter over the base) is compared by its keys only.
Errors are :class:`~.io.base.MergeInputError` (exit code 3), every problem on its own line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..utils.inpaths import inside, read_json
from .io.base import MergeInputError
from .vocab import embedding_keys

__all__ = ["ARCH_FIELDS", "architecture", "check_architectures", "preflight"]

#: The config fields that make two checkpoints the same architecture for a merge, and how messages name them.
ARCH_FIELDS = (("model_type", "model type"), ("num_hidden_layers", "layers"), ("hidden_size", "hidden size"))
_SHOWN = 5


def _config(src: Any) -> dict | None:
    """An input's ``config.json`` (the language part of a multimodal one merged in), ``None`` without one."""
    folder = getattr(src, "folder", None)
    if folder is None or not os.path.lexists(Path(folder) / "config.json"):
        return None
    what = f"{folder}: model file"
    try:
        config = read_json(inside(folder, "config.json", what), within=folder, what=what)
    except InputError:
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    return {**text, **{k: v for k, v in config.items() if k in ("model_type",)}} if isinstance(text, dict) \
        else config


def architecture(config: dict) -> str:
    """``a llama (2 layers, hidden size 64)``: an input's architecture in words."""
    kind = config.get("model_type", "model of unknown type")
    parts = [f"{config['num_hidden_layers']} layers"] if "num_hidden_layers" in config else []
    parts += [f"hidden size {config['hidden_size']}"] if "hidden_size" in config else []
    return f"a {kind}" + (f" ({', '.join(parts)})" if parts else "")


def _grouped(keys: Sequence[str]) -> str:
    groups: dict[str, list[str]] = {}
    for k in keys:
        m = re.search(r"\.(\d+)\.", k)
        pattern = k[:m.start()] + ".{}." + k[m.end():] if m else k
        groups.setdefault(pattern, []).append(m.group(1) if m else "")
    shown = [p.replace("{}", "{" + ", ".join(sorted(set(ls), key=int)) + "}") if "{}" in p else p
             for p, ls in groups.items()]
    return ", ".join(shown[:_SHOWN]) + (f" and {len(shown) - _SHOWN} more" if len(shown) > _SHOWN else "")


def _fail(problems: list[str], what: str) -> None:
    if problems:
        raise MergeInputError(f"pre-flight (headers and config.json only, nothing merged): {what}: "
                              + "; ".join(problems))


def check_architectures(sources: Sequence[Any], labels: Sequence[str], *, fields: Sequence[str] | None = None,
                        configs: Sequence[dict | None] | None = None) -> None:
    """Step 1 of :func:`preflight` alone: the inputs' configs agree on ``fields`` (default: every field of
    :data:`ARCH_FIELDS`; a slice recipe stacks layers of models of different depths, so it checks
    ``model_type`` and ``hidden_size`` only). Inputs without ``config.json`` are not compared.

    Raises:
        MergeInputError: names each input whose architecture differs from the first's, and both architectures.
    """
    configs = list(configs) if configs is not None else [_config(s) for s in sources]
    wanted = [(f, n) for f, n in ARCH_FIELDS if fields is None or f in fields]
    problems = []
    if configs and configs[0] is not None:
        for label, cfg in zip(labels[1:], configs[1:]):
            if cfg is None:
                continue
            differ = [name for field, name in wanted
                      if field in cfg and field in configs[0] and cfg[field] != configs[0][field]]
            if differ:
                problems.append(f"{label} is {architecture(cfg)}, {labels[0]} is {architecture(configs[0])} "
                                f"({', '.join(differ)} differ{'s' if len(differ) == 1 else ''}); a merge combines "
                                "checkpoints of one architecture")
    _fail(problems, "the inputs are different architectures")


def preflight(sources: Sequence[Any], labels: Sequence[str], *, embeddings: str | None) -> None:
    """Check the opened inputs ``sources`` (the reference first: the base, else the first model) from their
    headers and configs; ``labels`` name them in messages (``the base (X)``, ``models[0] (Y)``).

    Raises:
        MergeInputError: every problem of the first kind found (the module docstring), one per line.
    """
    sources = [s for s in sources if s is not None]
    ref, ref_label = sources[0], labels[0]
    configs = [_config(s) for s in sources]
    check_architectures(sources, labels, configs=configs)
    problems: list[str] = []
    # 2. vocabularies (rows matched by index unless the recipe says how to match them by token)
    emb = embedding_keys(ref.keys(), lambda k: ref.meta(k)[0])
    if embeddings is None:
        ref_rows = {k: ref.meta(k)[0][0] for k in emb}
        for src, label, cfg in zip(sources[1:], labels[1:], configs[1:]):
            keys = set(src.keys())
            rows = {k: src.meta(k)[0][0] for k in emb if k in keys and len(src.meta(k)[0]) == 2}
            differ = sorted((k for k in rows if rows[k] != ref_rows[k]), key=lambda k: emb[k] != "input")
            vocab = (configs[0] or {}).get("vocab_size"), (cfg or {}).get("vocab_size")
            if differ:
                k = differ[0]
                problems.append(f"shape mismatch of {k}: {label} has {list(src.meta(k)[0])}, {ref_label} has "
                                f"{list(ref.meta(k)[0])}: their vocabularies differ ({rows[k]} and {ref_rows[k]} "
                                "rows)")
            elif None not in vocab and vocab[0] != vocab[1]:
                problems.append(f"{label} has vocab_size {vocab[1]} in its config.json, {ref_label} has {vocab[0]}")
        if problems:
            problems.append("rows are merged by index unless the recipe says how to match them by token: set "
                            "embeddings: union, base or intersection (docs/merging_checkpoints.md)")
    _fail(problems, "the vocabularies differ and the recipe has no embeddings: policy")
    # 3. keys and shapes
    ref_keys = ref.keys()
    for src, label in zip(sources[1:], labels[1:]):
        keys = set(src.keys())
        missing = [k for k in ref_keys if k not in keys]
        extra = [k for k in src.keys() if k not in set(ref_keys)]
        if missing:
            problems.append(f"{label} is missing {len(missing)} key(s) that {ref_label} has: {_grouped(missing)}")
        if extra:
            problems.append(f"{ref_label} is missing {len(extra)} key(s) that {label} has: {_grouped(extra)}")
        shapes = [k for k in ref_keys if k in keys and tuple(src.meta(k)[0]) != tuple(ref.meta(k)[0])
                  and not (embeddings is not None and k in emb)]  # rows matched by token: counts may differ
        if shapes:
            shown = "; ".join(f"{k} is {list(src.meta(k)[0])} there, {list(ref.meta(k)[0])} in {ref_label}"
                              for k in shapes[:3])
            problems.append(f"{label}: {len(shapes)} tensor(s) of another shape: {shown}")
    _fail(problems, "the inputs' tensors differ")
