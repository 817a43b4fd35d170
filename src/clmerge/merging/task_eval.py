"""Task metrics of a model on the user's own labelled data (``clmerge eval``, ``clmerge merge --tune``), and
lm-evaluation-harness tasks when ``lm_eval`` is installed (docs/tuning.md).

Built in, from a ``.jsonl`` file (:func:`read_examples`; the kind is read from the records' keys):

- **multiple choice**: ``{"question": ..., "choices": [...], "answer": i}`` (or ``"context"`` for
  ``"question"``). Each choice is scored as lm-evaluation-harness scores a ``multiple_choice`` task: the
  request is ``(context, delimiter + choice)``, trailing spaces of the context move to the continuation, the
  continuation's tokens are those of ``tokenize(context + continuation)`` after ``tokenize(context)``, and its
  score is the summed log-likelihood of those tokens given everything before them (lm_eval/api/model.py
  ``_encode_pair``). ``acc``: the top-scoring choice is the answer; ``acc_norm``: the top score divided by the
  choice's length in characters (lm_eval/api/task.py, ``completion_len`` and ``pred_norm``);
- **labelled examples**: ``{"text": ..., "label": y}`` with ``y`` a class index or a name in the model's
  ``label2id``, scored by a sequence-classification head (``AutoModelForSequenceClassification``): the
  arg-max of its logits.

Accuracies are percentages. lm-evaluation-harness tasks (:func:`harness_tasks`) run through its Python API,
``simple_evaluate`` on an ``HFLM`` that wraps the loaded model; their numbers are the harness's own (0-1).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError, UsageError
from ..utils import inpaths
from ..utils.extras import require_extra
from ..utils.inpaths import read_bytes
from ..utils.progress import phase

__all__ = ["KINDS", "MC_METRICS", "EvalSpec", "TaskOptions", "classification_accuracy", "data_kind",
           "evaluate_folder", "harness_tasks", "multiple_choice_accuracy", "read_examples", "score_requests"]

MAX_BYTES = 512 * 1024 * 1024
KINDS = ("perplexity", "multiple_choice", "classification")
MC_METRICS = ("acc", "acc_norm")


@dataclass(frozen=True)
class TaskOptions:
    """How a task metric is computed (``clmerge eval`` flags, a tune file's ``eval:`` block)."""

    metric: str = "acc"  # multiple choice: acc | acc_norm; lm-eval tasks: the harness's metric name
    delimiter: str = " "  # between a question and a choice (lm-eval's target_delimiter)
    max_length: int = 1024
    batch_size: int = 4
    max_samples: int | None = None


def data_kind(path: str | Path) -> str:
    """``multiple_choice`` (records with ``choices``), ``classification`` (records with ``label``) or
    ``perplexity`` (a text file, or a JSONL of ``{"text": ...}``), from the first record of a ``.jsonl``."""
    path = Path(path)
    if path.suffix.lower() != ".jsonl":
        return "perplexity"
    for n, line in enumerate(_lines(path), 1):
        if line.strip():
            record = _record(path, n, line)
            return "multiple_choice" if "choices" in record else "classification" if "label" in record \
                else "perplexity"
    raise InputError(f"--data {path}: no record in it")


def _lines(path: Path) -> list[str]:
    try:
        data = read_bytes(path, what=f"--data {path}", max_bytes=MAX_BYTES, kind="jsonl")
    except inpaths.InputMissing:
        raise InputError(f"--data {path}: no such file") from None
    except inpaths.InputTooLarge:
        raise InputError(f"--data {path}: larger than {MAX_BYTES >> 20} MiB") from None
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise InputError(f"--data {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _record(path: Path, n: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"--data {path} line {n}: not JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise InputError(f"--data {path} line {n}: expected a JSON object")
    return record


def _check_mc(path: Path, n: int, r: dict) -> dict:
    where = f"--data {path} line {n}"
    context = r.get("question", r.get("context"))
    choices, answer = r.get("choices"), r.get("answer")
    if not isinstance(context, str):
        raise InputError(f"{where}: expected a string \"question\" (or \"context\")")
    if not (isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) and c for c in choices)):
        raise InputError(f"{where}: \"choices\": expected a list of at least two non-empty strings")
    if not (isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices)):
        raise InputError(f"{where}: \"answer\": expected the index of the right choice, 0 to {len(choices) - 1}, "
                         f"got {answer!r}")
    return {"context": context, "choices": choices, "answer": answer}


def _check_labelled(path: Path, n: int, r: dict) -> dict:
    label = r.get("label")
    if not isinstance(r.get("text"), str) or not (isinstance(label, (int, str)) and not isinstance(label, bool)):
        raise InputError(f"--data {path} line {n}: expected a string \"text\" and a \"label\" (a class index or "
                         "name)")
    return {"text": r["text"], "label": label}


def read_examples(path: str | Path, max_samples: int | None = None) -> tuple[str, list[dict]]:
    """``(kind, examples)`` of a JSONL of multiple-choice or labelled examples; every record must be of the
    first record's kind (a mix names the line)."""
    path = Path(path)
    kind = data_kind(path)
    if kind == "perplexity":
        raise UsageError(f"--data {path}: holds texts (perplexity), not multiple-choice (\"choices\", \"answer\") "
                         "or labelled (\"text\", \"label\") examples")
    check, key = (_check_mc, "choices") if kind == "multiple_choice" else (_check_labelled, "label")
    out = []
    for n, line in enumerate(_lines(path), 1):
        if not line.strip():
            continue
        record = _record(path, n, line)
        if key not in record:
            raise InputError(f"--data {path} line {n}: no \"{key}\", but the first record is a "
                             f"{kind.replace('_', '-')} example (one kind per file)")
        out.append(check(path, n, record))
        if max_samples and len(out) == max_samples:
            break
    return kind, out


# --- multiple choice: log-likelihood of each choice, as lm-eval computes it ---

def _encode(tok: Any, text: str) -> list[int]:
    return list(tok(text)["input_ids"])


def choice_tokens(tok: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """``(context ids, continuation ids)`` as lm-eval's ``_encode_pair`` splits them (module docstring); an
    empty context is the BOS (else EOS) token, as lm-eval's ``prefix_token_id``."""
    if not context:
        prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        ids = _encode(tok, continuation)
        return [prefix], ids[1:] if ids and ids[0] == prefix else ids
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    ctx = _encode(tok, context)
    return ctx, _encode(tok, context + continuation)[len(ctx):]


@torch.no_grad()
def score_requests(model: Any, requests: list[tuple[list[int], list[int]]], max_length: int) -> list[float]:
    """Summed log-likelihood of each request's continuation tokens given the tokens before them (the sequence
    cut to its last ``max_length`` + 1 tokens, as lm-eval does), in one right-padded batch."""
    inputs = [(ctx + cont)[-(max_length + 1):][:-1] for ctx, cont in requests]
    width = max(len(x) for x in inputs)
    ids = torch.zeros(len(inputs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, x in enumerate(inputs):
        ids[i, : len(x)], mask[i, : len(x)] = torch.tensor(x), 1
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.double(), -1)
    out = []
    for i, ((_, cont), x) in enumerate(zip(requests, inputs)):
        pos = torch.arange(len(x) - len(cont), len(x))
        out.append(float(logp[i, pos, torch.tensor(cont)].sum()))
    return out


def multiple_choice_accuracy(model: Any, tok: Any, examples: list[dict], opts: TaskOptions, *,
                             progress: bool = True) -> dict:
    """``acc`` and ``acc_norm`` (percent) of ``examples``; ``value`` is ``opts.metric``'s."""
    if opts.metric not in MC_METRICS:
        raise UsageError(f"metric {opts.metric!r}: a multiple-choice file is scored by {' or '.join(MC_METRICS)}")
    requests, owner = [], []
    for i, ex in enumerate(examples):
        for choice in ex["choices"]:
            ctx, cont = choice_tokens(tok, ex["context"], opts.delimiter + choice)
            if not cont:
                raise InputError(f"--data example {i + 1}: choice {choice!r} has no token after the question")
            requests.append((ctx, cont))
            owner.append(i)
    scores: list[float] = []
    with phase(range(0, len(requests), opts.batch_size), "eval: choices", enabled=None if progress else False) \
            as bar:
        for s in bar:
            scores += score_requests(model, requests[s: s + opts.batch_size], opts.max_length)
    hits = {"acc": 0, "acc_norm": 0}
    k = 0
    for ex in examples:
        lls = scores[k: k + len(ex["choices"])]
        k += len(ex["choices"])
        hits["acc"] += int(max(range(len(lls)), key=lls.__getitem__) == ex["answer"])
        normed = [ll / len(c) for ll, c in zip(lls, ex["choices"])]
        hits["acc_norm"] += int(max(range(len(lls)), key=normed.__getitem__) == ex["answer"])
    acc = {m: 100.0 * h / len(examples) for m, h in hits.items()}
    return {"metric": opts.metric, "value": acc[opts.metric], **acc, "examples": len(examples),
            "kind": "multiple_choice"}


# --- labelled examples: a sequence-classification head ---

def _label_index(model: Any, label: int | str, n: int) -> int:
    n_labels = model.config.num_labels
    if isinstance(label, str):
        ids = getattr(model.config, "label2id", None) or {}
        if label not in ids:
            raise InputError(f"--data example {n}: label {label!r} is not one of the model's labels "
                             f"({', '.join(map(str, ids)) or 'none named'}; config.json label2id)")
        return int(ids[label])
    if not 0 <= label < n_labels:
        raise InputError(f"--data example {n}: label {label} is not a class of the model's {n_labels} outputs")
    return label


@torch.no_grad()
def classification_accuracy(model: Any, tok: Any, examples: list[dict], opts: TaskOptions, *,
                            progress: bool = True) -> dict:
    """Accuracy (percent) of the arg-max of a sequence-classification head. Examples are batched when the
    model knows its padding token (``config.pad_token_id``: a decoder's head reads the last real token), one
    at a time otherwise."""
    targets = [_label_index(model, ex["label"], i + 1) for i, ex in enumerate(examples)]
    pad = getattr(model.config, "pad_token_id", None)
    size = opts.batch_size if pad is not None and tok.pad_token_id is not None else 1
    correct = 0
    with phase(range(0, len(examples), size), "eval: examples", enabled=None if progress else False) as bar:
        for s in bar:
            batch = [ex["text"] for ex in examples[s: s + size]]
            enc = tok(batch, return_tensors="pt", padding=size > 1, truncation=True, max_length=opts.max_length)
            pred = model(input_ids=enc["input_ids"], attention_mask=enc.get("attention_mask")).logits.argmax(-1)
            correct += int((pred == torch.tensor(targets[s: s + size])).sum())
    return {"metric": "acc", "value": 100.0 * correct / len(examples), "acc": 100.0 * correct / len(examples),
            "examples": len(examples), "kind": "classification"}


# --- lm-evaluation-harness ---

def harness_tasks(model: Any, tok: Any, tasks: list[str], *, metric: str = "acc", num_fewshot: int | None = None,
                  limit: int | None = None, batch_size: int = 1) -> dict:
    """lm-evaluation-harness ``tasks`` on the loaded ``model`` (``simple_evaluate`` with an ``HFLM`` wrapping
    it); ``value`` is the mean over the tasks of ``metric`` (the harness's ``"<metric>,none"`` entry)."""
    lm_eval = require_extra("lm_eval", "lm-eval", what="lm-evaluation-harness tasks (--tasks)")
    from importlib import import_module

    hflm = import_module("lm_eval.models.huggingface").HFLM
    out = lm_eval.simple_evaluate(model=hflm(pretrained=model, tokenizer=tok, batch_size=batch_size), tasks=tasks,
                                  num_fewshot=num_fewshot, limit=limit)
    results = out["results"]
    values = []
    for task in tasks:
        got = results.get(task, {})
        key = next((k for k in (f"{metric},none", metric) if k in got), None)
        if key is None:
            names = sorted({k.split(",")[0] for k in got if not k.endswith("_stderr,none")} - {"alias"})
            raise UsageError(f"--tasks {task}: the harness reports no {metric!r} (it reports: "
                             f"{', '.join(names) or 'nothing'}); choose one with --metric")
        values.append(float(got[key]))
    return {"metric": f"lm_eval {metric}", "value": sum(values) / len(values), "tasks": list(tasks),
            "results": _plain(results)}


def _plain(value: Any) -> Any:
    """The harness's results as JSON-safe values (NaN and numpy scalars become None and floats)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, bool)) or value is None:
        return value
    try:
        f = float(value)
    except (TypeError, ValueError):
        return str(value)
    return None if math.isnan(f) else (int(f) if isinstance(value, int) else f)


# --- one entry point: what ``clmerge eval MODEL`` and a tune's trials measure ---

@dataclass(frozen=True)
class EvalSpec:
    """What to measure on a model folder: ``tasks`` (lm-evaluation-harness), else the file ``data`` (texts:
    perplexity; multiple-choice or labelled examples: accuracy). ``metric``: ``acc`` or ``acc_norm`` for
    multiple choice, the harness's metric name for its tasks (default ``acc``)."""

    data: str | None = None
    tasks: tuple[str, ...] = ()
    metric: str | None = None
    max_length: int = 1024
    stride: int | None = None
    batch_size: int = 4
    max_samples: int | None = None
    num_fewshot: int | None = None
    delimiter: str = " "

    @property
    def kind(self) -> str:
        """``lm_eval``, or the data's kind (:data:`KINDS`)."""
        return "lm_eval" if self.tasks else data_kind(self.data)

    @property
    def higher_is_better(self) -> bool:
        """Accuracy is maximised, perplexity minimised."""
        return self.kind != "perplexity"

    def check(self) -> "EvalSpec":
        """Refuse a bad combination, read the data once and import the harness if needed (before any work)."""
        if not self.tasks and not self.data:
            raise UsageError("--data: give a file of texts or examples, or --tasks for lm-evaluation-harness tasks")
        if self.tasks and self.data:
            raise UsageError("--tasks and --data: give one (lm-evaluation-harness tasks, or your own file)")
        if self.num_fewshot is not None and not self.tasks:
            raise UsageError("--num-fewshot: only with --tasks (lm-evaluation-harness)")
        if self.num_fewshot is not None and (not isinstance(self.num_fewshot, int) or self.num_fewshot < 0):
            raise UsageError(f"--num-fewshot: expected a whole number >= 0, got {self.num_fewshot!r}")
        if not isinstance(self.metric, (str, type(None))) or not isinstance(self.delimiter, str):
            raise UsageError(f"metric, delimiter: expected strings, got {self.metric!r}, {self.delimiter!r}")
        self.perplexity_options().check()  # the positive integers: max_length, stride, batch_size, max_samples
        kind = self.kind
        if kind == "perplexity":
            from .lm_eval import read_texts

            if self.metric not in (None, "perplexity"):
                raise UsageError(f"--metric {self.metric}: a file of texts is scored by perplexity")
            read_texts(self.data, self.max_samples)
        elif kind == "lm_eval":
            require_extra("lm_eval", "lm-eval", what="lm-evaluation-harness tasks (--tasks)")
        else:
            if kind == "classification" and self.metric not in (None, "acc"):
                raise UsageError(f"--metric {self.metric}: labelled examples are scored by acc")
            if kind == "multiple_choice" and self.metric not in (None, *MC_METRICS):
                raise UsageError(f"--metric {self.metric}: multiple-choice examples are scored by acc or acc_norm")
            read_examples(self.data, self.max_samples)
        return self

    def perplexity_options(self) -> Any:
        from .lm_eval import EvalOptions

        return EvalOptions(self.data, self.max_length, self.stride, self.batch_size, self.max_samples)

    def task_options(self) -> TaskOptions:
        return TaskOptions(self.metric or "acc", self.delimiter, self.max_length, self.batch_size, self.max_samples)


def evaluate_folder(folder: str | Path, spec: EvalSpec, *, progress: bool = True, quiet: bool = False) -> dict:
    """Load the model of ``folder`` as ``spec`` needs it and measure it: ``{"metric", "value", ...}``."""
    from .lm_eval import load_causal_lm, perplexity, read_texts

    kind = spec.kind
    model, tok = load_causal_lm(folder, quiet=quiet, head="classification" if kind == "classification" else "causal")
    if kind == "lm_eval":
        return harness_tasks(model, tok, list(spec.tasks), metric=spec.metric or "acc", num_fewshot=spec.num_fewshot,
                             limit=spec.max_samples, batch_size=spec.batch_size)
    if kind == "perplexity":
        opts = spec.perplexity_options()
        res = perplexity(model, tok, read_texts(spec.data, spec.max_samples), opts, progress=progress)
        return {**res, "max_length": opts.max_length, "stride": opts.stride or opts.max_length}
    _, examples = read_examples(spec.data, spec.max_samples)
    score = multiple_choice_accuracy if kind == "multiple_choice" else classification_accuracy
    return score(model, tok, examples, spec.task_options(), progress=progress)
