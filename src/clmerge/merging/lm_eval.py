"""Perplexity of a causal language model on the user's own texts (``clmerge eval``, ``clmerge merge --tune``).

Texts come from a local file: a ``.jsonl`` file of ``{"text": ...}`` lines, or any other file read as plain
text, one document or several separated by blank lines. Each document is tokenized on its own (with the
tokenizer's special tokens) and scored with a sliding window as in the Hugging Face perplexity guide
("Perplexity of fixed-length models"): windows of ``max_length`` tokens start every ``stride`` tokens, and
a window scores only the tokens that no earlier window scored; the tokens before them are context. With
``stride == max_length`` the windows are disjoint. Unlike the guide, the negative log-likelihood is summed
token by token (no window-mean times length approximation), so

    ppl = exp( sum_i NLL_i / N )

over the N scored tokens of every document (the first token of a document has no context and is not scored).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import InputError, UsageError
from ..utils import inpaths
from ..utils.inpaths import read_bytes
from ..utils.progress import Progress

__all__ = ["EvalOptions", "load_causal_lm", "perplexity", "read_texts", "windows"]

MAX_TEXT_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class EvalOptions:
    """The options of a perplexity evaluation (``clmerge eval`` flags, a tune file's ``eval:`` block)."""

    data: str
    max_length: int = 1024
    stride: int | None = None  # None: max_length (disjoint windows)
    batch_size: int = 4
    max_samples: int | None = None

    def check(self) -> "EvalOptions":
        for name in ("max_length", "batch_size", "max_samples", "stride"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise UsageError(f"--{name.replace('_', '-')}: expected a positive integer, got {value!r}")
        if self.stride is not None and self.stride > self.max_length:
            raise UsageError(f"--stride {self.stride}: expected at most --max-length ({self.max_length})")
        return self


def read_texts(path: str | Path, max_samples: int | None = None) -> list[str]:
    """The documents of ``path``: JSONL lines' ``text`` values, or blank-line-separated plain text."""
    path = Path(path)
    try:  # through the input boundary: a regular file (a FIFO or a folder is refused by name), under the cap
        data = read_bytes(path, what=f"--data {path}", max_bytes=MAX_TEXT_BYTES,
                                  kind="jsonl" if path.suffix.lower() == ".jsonl" else "text")
    except inpaths.InputMissing:
        raise InputError(f"--data {path}: no such file (expected a text file or a JSONL of {{\"text\": ...}})") \
            from None
    except inpaths.InputTooLarge:
        raise InputError(f"--data {path}: larger than {MAX_TEXT_BYTES >> 20} MiB") from None
    try:
        raw = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"--data {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    texts = _jsonl_texts(path, raw) if path.suffix.lower() == ".jsonl" else _plain_texts(raw)
    texts = texts[:max_samples] if max_samples else texts
    if not texts:
        raise InputError(f"--data {path}: no text in it")
    return texts


def _plain_texts(raw: str) -> list[str]:
    return [d.strip() for d in re.split(r"\n[ \t\r]*\n", raw) if d.strip()]


def _jsonl_texts(path: Path, raw: str) -> list[str]:
    texts = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"--data {path} line {n}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise InputError(f"--data {path} line {n}: expected an object with a string key \"text\"")
        if record["text"].strip():
            texts.append(record["text"])
    return texts


def windows(n_tokens: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, n_scored)`` of each window over ``n_tokens`` tokens: the last ``n_scored`` tokens of
    ``[begin, end)`` are scored (the HF guide's ``trg_len``), the rest are context."""
    out, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + max_length, n_tokens)
        out.append((begin, end, end - prev_end))
        prev_end = end
        if end == n_tokens:
            break
    return out


def load_causal_lm(folder: str | Path, *, quiet: bool = False, head: str = "causal") -> tuple[Any, Any]:
    """The model (eval mode, float32 on CPU) and tokenizer of an HF causal-LM folder; ``quiet``: without
    transformers' loading bar (a tune's trials); ``head="classification"``: the folder's sequence-classification
    model instead (labelled examples, :mod:`.task_eval`).

    The folder is read through the input boundary as ``merge`` reads it: transformers loads a private folder of
    links to the checked files (:func:`~clmerge.merging.io.staging.staged_model`: config, tokenizer, weights and
    the shards an index lists, each opened, checked to be a regular file inside ``folder`` and held open while
    it loads), so a shard index naming ``../x.safetensors``, a config or tokenizer file linked out of the
    folder, a FIFO or a symlink loop is refused by name before transformers reads anything.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from .io.staging import staged_model

    folder = Path(folder)
    if not os.path.lexists(folder / "config.json"):
        raise InputError(f"MODEL {folder}: not a model folder (no config.json)")
    with staged_model(folder) as staged:
        bars = hf_logging.is_progress_bar_enabled()
        if quiet:
            hf_logging.disable_progress_bar()
        try:
            tok = AutoTokenizer.from_pretrained(str(staged))
            auto = AutoModelForSequenceClassification if head == "classification" else AutoModelForCausalLM
            model = auto.from_pretrained(str(staged)).float()
        except (OSError, ValueError, KeyError) as exc:
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            what = "a sequence classifier" if head == "classification" else "a causal LM"
            raise InputError(f"MODEL {folder}: cannot load it as {what} with its tokenizer "
                             f"({why.replace(str(staged), str(folder))[:160]})") from None
        finally:
            if quiet and bars:
                hf_logging.enable_progress_bar()
    return model.eval(), tok


def _chunks(model: Any, tok: Any, texts: list[str], opts: EvalOptions) -> list[tuple[list[int], int]]:
    """Every window of every document as (token ids, number of scored tokens at its end)."""
    stride = opts.stride or opts.max_length
    out = []
    for text in texts:
        ids = tok(text)["input_ids"]
        out += [(ids[b:e], k) for b, e, k in windows(len(ids), opts.max_length, stride) if e - b > 1]
    return out


@torch.no_grad()
def _batch_nll(model: Any, batch: list[tuple[list[int], int]]) -> tuple[float, int]:
    """Summed NLL and count of the scored tokens of one batch of windows (right-padded)."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for i, (ids, k) in enumerate(batch):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
        labels[i, len(ids) - k: len(ids)] = torch.tensor(ids[len(ids) - k:])
    logits = model(input_ids=input_ids, attention_mask=mask).logits.float()
    target = labels[:, 1:]  # position t predicts token t+1; the window's first token is never a target
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), target, ignore_index=-100,
                                            reduction="sum")
    return float(nll), int((target != -100).sum())


def perplexity(model: Any, tok: Any, texts: list[str], opts: EvalOptions, *, progress: bool = True,
               on_batch: Callable[[int, int], None] | None = None) -> dict:
    """``{"metric": "perplexity", "value": ppl, "nll": mean NLL, "tokens": N, "documents": D}``."""
    chunks = _chunks(model, tok, texts, opts)
    if not chunks:
        raise InputError(f"--data {opts.data}: no document has two tokens or more to score")
    total, count = 0.0, 0
    starts = range(0, len(chunks), opts.batch_size)
    bar = Progress(starts, desc="eval", total=len(starts), enabled=progress)
    for i, s in enumerate(bar, 1):
        nll, n = _batch_nll(model, chunks[s: s + opts.batch_size])
        total, count = total + nll, count + n
        bar.set_postfix(ppl=f"{math.exp(total / count):.3f}")
        if i == len(starts) or i % 50 == 0:
            bar.line(f"eval batch {i}/{len(starts)} ppl {math.exp(total / count):.4f}")
    bar.close()
    mean = total / count
    return {"metric": "perplexity", "value": math.exp(mean), "nll": mean, "tokens": count,
            "documents": len(texts), "windows": len(chunks)}
