"""Tokenizers of a merge whose inputs' vocabularies differ: read each input's vocabulary, build the output's.

A vocabulary here is what ``tokenizer.get_vocab()`` of ``transformers`` gives: ``{token string: id}``, the
added tokens included. The output tokenizer is the reference tokenizer (the base's), changed as the recipe's
``embeddings`` asks, and is built in a temporary folder at planning time; its files are kept in memory
(a few MB) and written into the merged model's folder at the end, so what the rows were merged for is exactly
what is saved. Every tokenizer file is checked before it is read, and ``transformers`` reads only the checked
files (:func:`~clmerge.merging.io.staging.staged_model`): a file leading out of its folder, a FIFO, a device or
a symlink loop is refused by name. Errors are one line naming the input.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...utils.inpaths import read_bytes
from .base import MergeInputError

__all__ = ["InputTokenizer", "OutputTokenizer", "check_union", "load_tokenizer", "output_tokenizer"]

# the files that hold a vocabulary (a tokenizer_config.json alone does not), the first found named in errors
_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


@dataclass
class InputTokenizer:
    """One input's tokenizer: its name in the recipe, its vocabulary and the ``transformers`` object;
    ``file``: the file that holds its vocabulary; ``model_type``: the ``tokenizers`` model (``BPE``,
    ``WordPiece``, ``WordLevel``, ``Unigram``; ``None`` for a slow tokenizer)."""

    name: str
    vocab: dict[str, int]
    tokenizer: Any
    file: Path | None = None
    model_type: str | None = None


@dataclass
class OutputTokenizer:
    """The merged model's tokenizer: ``files`` (name -> bytes) to write and ``vocab`` (token -> row)."""

    files: dict[str, bytes]
    vocab: dict[str, int]
    added: list[str] = field(default_factory=list)


def load_tokenizer(folder: Path | None, name: str) -> InputTokenizer:
    """The tokenizer saved in an input's model folder (``AutoTokenizer``, local files only, from the checked
    files staged by :func:`~.staging.staged_files`).

    Raises:
        MergeInputError: no folder or no tokenizer files there, or ``transformers`` cannot read them.
        InputError: a model file there leads out of the folder, is not a regular file or is over its size cap.
    """
    if folder is None:
        raise MergeInputError(f"{name}: a weights file has no tokenizer: give its model folder; matching rows by "
                              "token needs every input's tokenizer")
    from transformers import AutoTokenizer

    from .staging import staged_files

    with staged_files(Path(folder)) as (staged, files):
        vocab_files = [files[n] for n in _VOCAB_FILES if n in files]
        if not vocab_files:
            raise MergeInputError(f"{name}: no tokenizer in {folder} (looked for tokenizer.json, tokenizer.model, "
                                  "vocab.json); matching rows by token needs every input's tokenizer")
        try:
            tok = AutoTokenizer.from_pretrained(str(staged), local_files_only=True, trust_remote_code=False)
        except Exception as exc:  # transformers raises many types for a broken or unknown tokenizer
            why = str(exc).splitlines()[0].replace(str(staged), str(folder)) if str(exc) else "no message"
            raise MergeInputError(f"{name}: cannot read the tokenizer in {folder} ({type(exc).__name__}: "
                                  f"{why[:160]})") from None
    backend = getattr(tok, "backend_tokenizer", None)
    model_type = type(backend.model).__name__ if backend is not None else None
    return InputTokenizer(name, dict(tok.get_vocab()), tok, vocab_files[0], model_type)


def _saved(tok: Any, chat_template: str | None) -> dict[str, bytes]:
    """``tok`` saved with ``save_pretrained`` (in a temporary folder), as ``{file name: bytes}``."""
    if chat_template is not None:
        tok.chat_template = chat_template
    with tempfile.TemporaryDirectory(prefix="clmerge-tok-") as tmp:
        tok.save_pretrained(tmp)
        return {p.name: read_bytes(p, within=tmp, kind="tokenizer") for p in sorted(Path(tmp).iterdir())
                if p.is_file()}


def _reloaded_vocab(files: dict[str, bytes]) -> dict[str, int]:
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="clmerge-tok-") as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        return dict(AutoTokenizer.from_pretrained(tmp, local_files_only=True).get_vocab())


def _union_added(ref: InputTokenizer, others: Sequence[InputTokenizer]) -> list[Any]:
    """The tokens to add for a union, in the documented order: input by input (recipe order), each input's
    tokens by id; an added token keeps its settings (special, strip flags), any other token is added as a
    plain (non-special) added token."""
    from transformers import AddedToken

    seen, out = set(ref.vocab), []
    for other in others:
        decoder = {t.content: t for t in getattr(other.tokenizer, "added_tokens_decoder", {}).values()}
        for token, _ in sorted(other.vocab.items(), key=lambda kv: kv[1]):
            if token in seen:
                continue
            seen.add(token)
            out.append(decoder.get(token) or AddedToken(token, special=False, normalized=False))
    return out


def _drop_added(files: dict[str, bytes], drop: set[str], ref: InputTokenizer) -> dict[str, bytes]:
    """``tokenizer.json`` without the added tokens ``drop``; the added tokens after them move down.

    Raises:
        MergeInputError: a token to drop is in the tokenizer model's own vocabulary (a BPE, WordPiece or
            sentencepiece model cannot lose an entry without changing how text is split), or is one of the
            tokenizer's special tokens (bos, eos, pad, unk).
    """
    if "tokenizer.json" not in files:
        raise MergeInputError(f"{ref.name}: intersection needs a fast tokenizer (tokenizer.json) to remove tokens")
    data = json.loads(files["tokenizer.json"])
    added = {e["content"]: e for e in data.get("added_tokens", [])}
    core = data.get("model", {}).get("vocab", {})
    core = set(core) if isinstance(core, dict) else {piece[0] for piece in core}  # Unigram: [piece, score]
    specials = set(getattr(ref.tokenizer, "all_special_tokens", []))
    bad = sorted((t for t in drop if t not in added or t in core or t in specials), key=ref.vocab.get)
    if bad:
        raise MergeInputError(
            f"{ref.name}: embeddings: intersection would remove {len(bad)} token(s) of its tokenizer's own "
            f"vocabulary or special tokens (first: {bad[0]!r}); only added tokens can be removed without "
            "changing how text is split: use embeddings: base or union")
    kept = sorted((e for e in data["added_tokens"] if e["content"] not in drop), key=lambda e: e["id"])
    first = min((e["id"] for e in data["added_tokens"] if e["content"] in drop), default=0)
    next_id = first
    for e in kept:
        if e["id"] > first:
            e["id"], next_id = next_id, next_id + 1
    data["added_tokens"] = kept
    return {**files, "tokenizer.json": json.dumps(data, ensure_ascii=False, indent=2).encode()}


def output_tokenizer(mode: str, ref: InputTokenizer, others: Sequence[InputTokenizer],
                     chat_template: str | None) -> OutputTokenizer:
    """The output tokenizer of ``embeddings: mode`` (``base``, ``union`` or ``intersection``).

    ``ref`` is the reference (the base's tokenizer, else the first model's) and ``others`` every other input
    in recipe order. ``union``: ``ref`` plus every other token, appended in :func:`_union_added`'s order.
    ``intersection``: ``ref`` without the tokens some input lacks, possible only for added tokens.
    """
    import copy

    tok = copy.deepcopy(ref.tokenizer)
    added: list[str] = []
    if mode == "union":
        extra = _union_added(ref, others)
        tok.add_tokens(extra)
        added = [str(getattr(t, "content", t)) for t in extra]
    files = _saved(tok, chat_template if chat_template is not None else getattr(ref.tokenizer, "chat_template",
                                                                                   None))
    if mode == "intersection":
        drop = {t for t in ref.vocab if not all(t in o.vocab for o in others)}
        files = _drop_added(files, drop, ref) if drop else files
    vocab = _reloaded_vocab(files)
    ids = sorted(vocab.values())
    if ids != list(range(len(ids))):
        raise MergeInputError(f"{ref.name}: the output tokenizer's ids are not 0..{len(ids) - 1} without gaps; "
                              "expected one embedding row per id")
    return OutputTokenizer(files, vocab, added)


def check_union(mode: str, toks: Sequence[InputTokenizer]) -> list[str]:
    """Refuse an input tokenizer with an empty vocabulary (its embedding rows would all be dropped: no token
    names them); under ``union``, warnings (``"warning: ..."`` lines) when the inputs' tokenizer models differ
    (a WordPiece and a WordLevel tokenizer may split the same text differently, so one token string need not
    mean the same text in both).

    Raises:
        MergeInputError: names the input and its tokenizer file.
    """
    for t in toks:
        if not t.vocab:
            raise MergeInputError(f"{t.name}: its tokenizer ({t.file}) has an empty vocabulary; embeddings: {mode} "
                                  "matches embedding rows by token, so none of this input's rows would be kept")
    if mode != "union":
        return []
    typed = [t for t in toks if t.model_type is not None]
    return [f"warning: embeddings: union merges tokenizers of different models: {typed[0].name!r} is "
            f"{typed[0].model_type} ({typed[0].file}), {t.name!r} is {t.model_type} ({t.file}); the same token "
            "string may stand for different text in each" for t in typed[1:] if t.model_type != typed[0].model_type]
