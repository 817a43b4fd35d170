"""A PEFT LoRA adapter from a full fine-tune: truncated SVD of ``Delta W = W_tuned - W_base`` per Linear weight.

For each 2-D ``<mod>.weight`` that differs (1-D norms skipped; embeddings unless asked), ``Delta W = U S V^T`` is cut at
rank ``r`` (Eckart-Young, see :mod:`.lora_svd`): ``B = U_r sqrt(S_r)``, ``A = sqrt(S_r) V_r^T``, written with
``lora_alpha = r`` (scale 1), so that ``PeftModel.from_pretrained(base, out)`` applies ``B A``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ...errors import UsageError
from ...utils.device import Device, parse_device, using_device
from .base import MergeInputError
from .checks import check_dtype, source_get, source_meta
from .lora_svd import (check_out_dir, check_svd, clamped_note, device_low_rank_factors, error_summary,
                       rank_pattern)
from .output import build_folder
from .peft import adapter_config, write_adapter
from .readers import open_checkpoint

__all__ = ["extract_lora", "EMBEDDING_NAMES", "REPORT_FILE"]

REPORT_FILE = "extract_report.json"
# Embedding tables (token, position, patch, T5's shared): a LoRA on them needs peft's embedding layout.
EMBEDDING_NAMES = re.compile(r"(^|\.)(embed\w*|\w*_embeddings?|wte|wpe|shared)(\.|$)")


def _candidates(base: Any, tuned: Any, include: re.Pattern | None, exclude: re.Pattern | None,
                embeddings: bool) -> list[tuple[str, bool]]:
    """``(key, is_embedding)`` for the 2-D floating ``*.weight`` tensors of Linear-like modules (and of
    embedding tables when ``embeddings``), checked against ``tuned``."""
    tuned_keys = set(tuned.keys())
    keys = []
    for k in base.keys():
        shape, dtype = source_meta(base, k)
        check_dtype(base, k, dtype)
        if not k.endswith(".weight") or len(shape) != 2 or not dtype.is_floating_point:
            continue
        is_embedding = bool(EMBEDDING_NAMES.search(k[: -len(".weight")]))
        if (is_embedding and not embeddings) or (exclude and exclude.search(k)):
            continue
        if include and not include.search(k):
            continue
        if k not in tuned_keys:
            raise MergeInputError(f"key {k!r} is in {base.name} but missing from {tuned.name}")
        tshape, tdtype = source_meta(tuned, k)
        check_dtype(tuned, k, tdtype)
        if tuple(tshape) != tuple(shape):
            raise MergeInputError(f"key {k!r}: shape {list(shape)} in {base.name} but "
                                  f"{list(tshape)} in {tuned.name}")
        keys.append((k, is_embedding))
    return keys


def _extract(base: Any, tuned: Any, keys: list[tuple[str, bool]], rank: int,
             svd: str) -> tuple[dict, dict, list[str], set[str]]:
    """``(factors, errors, unchanged keys, embedding modules)``: the truncated SVD of each key's update (on the
    device of the enclosing :func:`~clmerge.utils.device.using_device`, else the CPU)."""
    factors, errors, unchanged, emb = {}, {}, [], set()
    for key, is_embedding in keys:
        delta = source_get(tuned, key).to(torch.float64) - source_get(base, key).to(torch.float64)
        if not delta.any():
            unchanged.append(key)
            continue
        mod = key[: -len(".weight")]
        if is_embedding:
            emb.add(mod)
        low = device_low_rank_factors(delta.t() if is_embedding else delta, rank, svd)
        factors[mod], errors[mod] = (low.a, low.b), low
    return factors, errors, unchanged, emb


def extract_lora(*, base: Any, tuned: Any, rank: int, out: str | Path, include: str | None = None,
                 exclude: str | None = None, embeddings: bool = False, svd: str = "auto",
                 overwrite: bool = False, device: str | Device | None = None) -> dict:
    """Write a PEFT LoRA adapter of rank ``rank`` that approximates ``tuned - base``.

    Args:
        base: the pretrained model (path for ``open_checkpoint``, or a lazy source).
        tuned: the fine-tuned model with the same keys.
        rank: the LoRA rank ``r``; a module with ``min(out, in) < r`` gets rank ``min(out, in)`` (exact; in
            ``rank_pattern``, and named in the report's ``note``), never zero-padded factors.
        out: the new adapter folder (written atomically; must not exist or be empty).
        include: optional regex: only keys that match are considered.
        exclude: optional regex: keys that match are skipped.
        embeddings: also extract embedding tables (names like ``embed_tokens``, ``wte``,
            ``word_embeddings``), written as peft's ``lora_embedding_A/B`` (``Delta W^T = B A``).
        svd: ``"auto"``, ``"full"`` or ``"randomized"`` (:func:`.lora_svd.low_rank_factors`).
        overwrite: replace an existing non-empty ``out`` (``--overwrite``).
        device: ``cpu`` (default), ``cuda`` or ``cuda:N``: where the SVDs run (each matrix moved there and
            its factors back); an active one adds ``"device"`` (wall time, peak device memory) to the report.

    Returns:
        ``{"out", "rank", "modules", "skipped_unchanged", "ranks_clamped", "note", "per_module_rel_error",
        "overall_rel_error", "max_rel_error"}`` (also ``out/extract_report.json``).
    """
    if rank < 1:
        raise UsageError(f"--rank must be >= 1, got {rank}")
    check_svd(svd)
    dev = parse_device(device)
    paths = [Path(str(x)) for x in (base, tuned) if isinstance(x, (str, Path))]
    base = open_checkpoint(base) if isinstance(base, (str, Path)) else base
    tuned = open_checkpoint(tuned) if isinstance(tuned, (str, Path)) else tuned
    check_out_dir(Path(out), paths, overwrite)
    inc, exc = (re.compile(include) if include else None), (re.compile(exclude) if exclude else None)
    dev.start()
    with using_device(dev):
        factors, errors, unchanged, emb = _extract(base, tuned, _candidates(base, tuned, inc, exc, embeddings),
                                                   rank, svd)
    if not factors:
        raise MergeInputError(f"{tuned.name}: no Linear weight differs from {base.name}; nothing to extract")
    # a module whose min(out, in) is below rank is written at that rank (exact), named in rank_pattern
    pattern = rank_pattern(factors, rank)
    config = adapter_config(r=rank, alpha=rank, targets=list(factors), base_model=str(base.name),
                            rank_pattern=pattern, alpha_pattern=pattern)
    report = {"out": str(out), "rank": rank, "base": str(base.name), "tuned": str(tuned.name),
              "modules": sorted(factors), "embeddings": sorted(emb), "skipped_unchanged": unchanged,
              "ranks_clamped": pattern, "note": clamped_note(pattern, rank), **error_summary(errors)}
    if dev.active:
        report["device"] = dev.stats()

    def fill(tmp: Path) -> dict:
        write_adapter(tmp, factors, config, emb)
        return report

    return build_folder(Path(out), fill, REPORT_FILE)
