"""Merging models whose vocabularies differ: embedding rows matched by token string, not by row index.

A recipe's ``embeddings`` key (``base``, ``union`` or ``intersection``) sets the output vocabulary
(:func:`~clmerge.merging.io.tokenizers.output_tokenizer`). Every input's embedding matrices (the input
embeddings and ``lm_head``, found by name and by their row count) are then reindexed into that vocabulary as
they are read: row ``r`` of the output is the row of the token ``r`` in that input, and a token the input lacks
gets a stand-in row (``fill``):

- ``present`` (default): the base's row when the input is a model and the base has the token (the model's
  task vector for that token is zero: it does not move it); otherwise the mean of the rows of the models that
  have the token. So averaging merges such a token over the models that have it, task-vector methods over the
  task vectors of the models that have it, and a token only one input has keeps that input's row.
- ``mean``: the mean of the input's own rows (the rows its tokenizer names).
- ``zero``: zeros.

Each input is then a source like any other (:class:`ReindexedSource`), so every merge method works unchanged
and still streams: one embedding matrix is reindexed at a time. ``present`` needs the other inputs' rows of
the missing tokens; they are gathered once per key, reading the inputs one after another, and kept as small
``(missing tokens, hidden)`` matrices.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .io.checks import source_get

__all__ = ["EMBEDDING_NAMES", "ReindexedSource", "VocabPlan", "embedding_keys", "plan_vocab", "prepare_vocab"]

# module names of embedding matrices whose rows are tokens: (input embeddings, output projections)
EMBEDDING_NAMES = (("embed_tokens", "wte", "word_embeddings", "embed_in", "shared"),
                   ("lm_head", "embed_out", "output"))
_NAME = re.compile(r"(?:^|\.)([A-Za-z_]+)\.weight$")
_SHOWN = 5  # tokens the report lists per count


def embedding_keys(keys: Sequence[str], rows_of: Any) -> dict[str, str]:
    """``{key: "input" | "output"}`` of the 2-D embedding matrices among ``keys`` (``rows_of(key)`` gives its
    shape): named as in :data:`EMBEDDING_NAMES` (``model.embed_tokens.weight``, ``lm_head.weight``), outside the
    numbered layers (``layers.3.attention.output.weight`` is not one)."""
    from .recipes import layer_index

    out = {}
    for key in keys:
        m = _NAME.search(key)
        if m is None or len(rows_of(key)) != 2 or layer_index(key) is not None:
            continue
        for role, names in zip(("input", "output"), EMBEDDING_NAMES):
            if m.group(1) in names:
                out[key] = role
    return out


@dataclass
class VocabPlan:
    """Where every output row of every input comes from.

    Attributes:
        mode, fill: the recipe's ``embeddings`` and ``fill``.
        vocab: the output vocabulary ``{token: row}`` (rows ``0..rows-1``).
        keys: the embedding keys, ``{key: "input" | "output"}``.
        index: per input (base first, then the models), a ``(rows,)`` tensor of its row for each output
            row, ``-1`` where it lacks the token.
        known: per input, its rows that a token of its tokenizer names (what ``fill: mean`` averages).
        has_base: whether input 0 is the base.
        tied: the input and output embeddings are tied (the output gets one matrix, copied to both keys).
        report: what the merge report lists (rows added, dropped, filled).
    """

    mode: str
    fill: str
    vocab: dict[str, int]
    keys: dict[str, str]
    index: list[Tensor]
    known: list[Tensor]
    has_base: bool
    tied: bool = False
    report: dict = field(default_factory=dict)
    ref_vocab: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    _standins: dict[str, list[Tensor | None]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def rows(self) -> int:
        return len(self.vocab)

    def summary(self) -> str:
        """One line: the mode, the output's rows and the counts of the report."""
        rep = self.report
        return (f"vocabulary ({rep['embeddings']}, fill {rep['fill']}): {rep['rows']} rows; {rep['added']['count']} "
                f"added, {rep['dropped']['count']} dropped, {rep['filled_rows']} filled")

    def renumbered(self, config: dict) -> dict:
        """A model config (``config.json``, ``generation_config.json``) for the output vocabulary:
        ``vocab_size`` its rows, the token ids moved with their tokens."""
        return _renumber(config, self)

    def tied_pair(self) -> tuple[str, str] | None:
        """``(input key, output key)`` when tied and both are in the checkpoint."""
        ins = [k for k, r in self.keys.items() if r == "input"]
        outs = [k for k, r in self.keys.items() if r == "output"]
        return (ins[0], outs[0]) if self.tied and ins and outs else None

    def standins(self, key: str, sources: Sequence[Any]) -> list[Tensor | None]:
        """Per input, the rows (float32) that fill its missing tokens of ``key`` under ``fill: present``,
        gathered once (reading the inputs one after another) and cached."""
        with self._lock:
            if key not in self._standins:
                self._standins[key] = self._gather(key, sources)
            return self._standins[key]

    def _gather(self, key: str, sources: Sequence[Any]) -> list[Tensor | None]:
        missing = torch.zeros(self.rows, dtype=torch.bool)
        for idx in self.index:
            missing |= idx < 0
        pos = missing.nonzero().squeeze(1)
        first = 1 if self.has_base else 0
        total, count, base_rows = None, torch.zeros(len(pos)), None
        for i, src in enumerate(sources):
            raw = source_get(src, key)
            idx = self.index[i][pos]
            have = idx >= 0
            rows = torch.zeros(len(pos), *raw.shape[1:], dtype=torch.float32)
            rows[have] = raw[idx[have]].to(torch.float32)
            del raw
            if i < first:
                base_rows = (rows, have)
                continue
            total = rows if total is None else total + rows
            count += have.to(torch.float32)
        mean = total / count.clamp(min=1).reshape(-1, *([1] * (total.dim() - 1)))
        out: list[Tensor | None] = []
        for i, idx in enumerate(self.index):
            lack = idx[pos] < 0
            rows = mean.clone()
            if base_rows is not None and i >= first:  # a model's missing token: the base's row where it has one
                b_rows, b_have = base_rows
                rows[b_have] = b_rows[b_have]
            out.append(rows[lack] if bool(lack.any()) else None)
        return out

    def reindex(self, i: int, key: str, raw: Tensor, sources: Sequence[Any]) -> Tensor:
        """Input ``i``'s matrix ``key`` in the output vocabulary's row order, missing rows filled."""
        idx = self.index[i]
        have = idx >= 0
        out = raw.index_select(0, idx.clamp(min=0))  # the only full-size copy; missing rows are set below
        if bool(have.all()):
            return out
        if self.fill == "zero":
            out[~have] = 0
        elif self.fill == "mean":
            known = self.known[i]
            rows = raw if len(known) == raw.shape[0] else raw.index_select(0, known)
            out[~have] = (rows.sum(0, dtype=torch.float32) / max(len(known), 1)).to(raw.dtype)
        else:
            out[~have] = self.standins(key, sources)[i].to(raw.dtype)
        return out


class ReindexedSource:
    """An input seen through a :class:`VocabPlan`: its embedding matrices come out in the output's rows.

    Args:
        src: the input's lazy source.
        plan: the shared plan.
        i: this input's position in ``sources`` (the base first, then the models).
        sources: every input's (unwrapped) source, for the stand-in rows of ``fill: present``.
    """

    def __init__(self, src: Any, plan: VocabPlan, i: int, sources: Sequence[Any]) -> None:
        self._src, self._plan, self._i, self._sources = src, plan, i, sources

    def __getattr__(self, name: str) -> Any:  # name, files, folder, warning: the input's own
        return getattr(self._src, name)

    def keys(self) -> list[str]:
        return self._src.keys()

    def meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        shape, dtype = self._src.meta(key)
        if key in self._plan.keys:
            shape = (self._plan.rows, *tuple(shape)[1:])
        return tuple(shape), dtype

    def get(self, key: str) -> Tensor:
        raw = self._src.get(key)
        if key not in self._plan.keys:
            return raw
        return self._plan.reindex(self._i, key, raw, self._sources)


def _index(vocab: dict[str, int], rows: int, out_vocab: dict[str, int]) -> tuple[Tensor, Tensor]:
    """An input's row per output row (``-1``: missing; ids past its rows count as missing) and its rows
    that a token names."""
    idx = torch.full((len(out_vocab),), -1, dtype=torch.long)
    for token, row in out_vocab.items():
        j = vocab.get(token)
        if j is not None and j < rows:
            idx[row] = j
    known = torch.tensor(sorted({j for j in vocab.values() if j < rows}), dtype=torch.long)
    return idx, known


def _shown(tokens: list[str]) -> dict:
    return {"count": len(tokens), "first": tokens[:_SHOWN]}


def _input_report(name: str, vocab: dict[str, int], rows: int, out_vocab: dict[str, int],
                  idx: Tensor) -> dict:
    by_id = sorted(vocab, key=vocab.get)
    by_row = sorted(out_vocab, key=out_vocab.get)
    return {"name": name, "rows": rows, "tokens": len(vocab),
            "beyond_rows": _shown([t for t in by_id if vocab[t] >= rows]),
            "dropped": _shown([t for t in by_id if t not in out_vocab and vocab[t] < rows]),
            "filled": _shown([by_row[r] for r in (idx < 0).nonzero().squeeze(1).tolist()])}


def plan_vocab(*, mode: str, fill: str, out_vocab: dict[str, int], added: list[str],
               inputs: Sequence[tuple[str, dict[str, int], int]], keys: dict[str, str], has_base: bool,
               tied: bool) -> VocabPlan:
    """The :class:`VocabPlan` for ``inputs`` (``(name, vocabulary, embedding rows)``, base first)."""
    index, known, per_input = [], [], []
    for name, vocab, rows in inputs:
        idx, kn = _index(vocab, rows, out_vocab)
        index.append(idx)
        known.append(kn)
        per_input.append(_input_report(name, vocab, rows, out_vocab, idx))
    dropped = [t for _, vocab, rows in inputs for t in sorted(vocab, key=vocab.get)
               if t not in out_vocab and vocab[t] < rows]
    filled = sum(r["filled"]["count"] for r in per_input)
    report = {"embeddings": mode, "fill": fill, "rows": len(out_vocab), "keys": sorted(keys), "tied": tied,
              "added": _shown(added), "dropped": _shown(list(dict.fromkeys(dropped))),
              "filled_rows": filled, "inputs": per_input}
    return VocabPlan(mode, fill, out_vocab, keys, index, known, has_base, tied, report)


def _config(src: Any) -> dict:
    """An input's ``config.json`` (``{}`` without one, or when it is not JSON), read through the input boundary
    (one that leads out of the folder, a FIFO or a loop is refused by name); the text part of a multimodal
    config merged in."""
    import os

    from ..errors import InputError
    from ..utils.inpaths import inside, loads_json, read_bytes

    folder = getattr(src, "folder", None)
    if folder is None or not os.path.lexists(Path(folder) / "config.json"):
        return {}
    what = f"{folder}: model file"
    data = read_bytes(inside(folder, "config.json", what), within=folder, what=what)
    try:
        config = loads_json(data, f"{folder}/config.json")
    except InputError:
        return {}
    return {**config.get("text_config", {}), **config} if isinstance(config, dict) else {}


def _tied(ref: Any, sources: Sequence[Any], keys: dict[str, str]) -> bool:
    """Tied input and output embeddings: the reference's config says so, or every input's two matrices are
    equal (read one input at a time; an untied model stops at the first input)."""
    if _config(ref).get("tie_word_embeddings") is True:
        return True
    ins = [k for k, r in keys.items() if r == "input"]
    outs = [k for k, r in keys.items() if r == "output"]
    if not ins or not outs:
        return False
    return all(torch.equal(source_get(s, ins[0]), source_get(s, outs[0])) for s in sources)


def _rows(src: Any, keys: dict[str, str]) -> int:
    counts = {src.meta(k)[0][0] for k in keys}
    if len(counts) > 1:
        from .io.base import MergeInputError

        raise MergeInputError(f"{src.name}: its embedding matrices ({', '.join(sorted(keys))}) have different "
                              f"row counts {sorted(counts)}; expected one row per token in each")
    return counts.pop()


def prepare_vocab(base: Any, experts: list[Any], names: list[str], *, embeddings: str | None, fill: str,
                  tokenizer_from: str | None, chat_template_from: str | None
                  ) -> tuple[VocabPlan | None, Any, Any, list[Any]]:
    """The vocabulary plan, the output tokenizer, and the inputs wrapped to match.

    Args:
        base, experts: the opened inputs (``base`` may be ``None``).
        names: the inputs' names in the recipe, the base's first when there is one.
        embeddings, fill, tokenizer_from, chat_template_from: the recipe's values.

    Returns:
        ``(None, None, base, experts)`` when neither ``embeddings`` nor ``chat_template_from`` is set.
    """
    from .io.tokenizers import check_union, load_tokenizer, output_tokenizer

    if embeddings is None and chat_template_from is None:
        return None, None, base, experts
    sources = ([base] if base is not None else []) + list(experts)
    listed = ", ".join(map(repr, names))
    if chat_template_from is not None and chat_template_from not in names:
        raise ValueError(f"chat_template_from: {chat_template_from!r} is not one of the inputs ({listed})")
    own = tokenizer_from is not None and tokenizer_from not in names  # a tokenizer of a model not merged
    if own and embeddings is not None:
        raise ValueError(f"tokenizer_from: {tokenizer_from!r} is not one of the inputs; with embeddings set it must "
                         f"name the base or a model ({listed})")
    r = names.index(tokenizer_from) if tokenizer_from is not None and not own else 0  # the reference tokenizer
    t = names.index(chat_template_from) if chat_template_from is not None else None
    # embeddings: every input's tokenizer; only the chat template changes: the reference's and the template's
    wanted = range(len(sources)) if embeddings is not None else sorted({t} | ({r} if not own else set()))
    toks = {i: load_tokenizer(getattr(sources[i], "folder", None), names[i]) for i in wanted}
    template = None
    if t is not None:
        template = getattr(toks[t].tokenizer, "chat_template", None)
        if not template:
            from .io.base import MergeInputError

            raise MergeInputError(f"{chat_template_from}: chat_template_from: its tokenizer has no chat template")
    if embeddings is None:
        ref = load_tokenizer(Path(tokenizer_from), tokenizer_from) if own else toks[r]
        return None, output_tokenizer("base", ref, [], template), base, experts
    ordered = [toks[i] for i in range(len(sources))]
    warnings = check_union(embeddings, ordered)  # an empty vocabulary is refused here
    out = output_tokenizer(embeddings, ordered[r], ordered[:r] + ordered[r + 1:], template)
    keys = embedding_keys(sources[0].keys(), lambda k: sources[0].meta(k)[0])
    if not keys:
        from .io.base import MergeInputError

        raise MergeInputError(f"{names[0]}: embeddings: {embeddings}: no embedding matrix found (looked for "
                              f"2-D '*.<name>.weight' with <name> one of {', '.join(sum(EMBEDDING_NAMES, ()))})")
    inputs = [(n, tok.vocab, _rows(s, keys)) for n, tok, s in zip(names, ordered, sources)]
    plan = plan_vocab(mode=embeddings, fill=fill, out_vocab=out.vocab, added=out.added,
                      inputs=inputs, keys=keys, has_base=base is not None, tied=_tied(sources[r], sources, keys))
    plan.ref_vocab = ordered[r].vocab
    plan.warnings = warnings
    wrapped = [ReindexedSource(s, plan, i, sources) for i, s in enumerate(sources)]
    return plan, out, (wrapped[0] if base is not None else None), wrapped[1 if base is not None else 0:]


_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "decoder_start_token_id")


def _renumber(config: dict, plan: VocabPlan) -> dict:
    """A config with ``vocab_size`` set to the output's rows and its token ids moved with their tokens."""
    by_id = {j: t for t, j in plan.ref_vocab.items()}

    def move(v: Any) -> Any:
        if isinstance(v, list):
            return [move(x) for x in v]
        return plan.vocab.get(by_id.get(v), v) if isinstance(v, int) and not isinstance(v, bool) else v

    out = {k: move(v) if k in _TOKEN_IDS else v for k, v in config.items()}
    if "vocab_size" in out:
        out["vocab_size"] = plan.rows
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = _renumber(out["text_config"], plan)
    return out
