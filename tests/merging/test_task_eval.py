"""Task metrics (``clmerge.merging.task_eval``): multiple-choice accuracy scored as lm-evaluation-harness scores
a ``multiple_choice`` task, classification accuracy of a sequence-classification head, and lm-evaluation-harness
tasks through its Python API (a fake ``lm_eval`` module records the call; the real one is not installed here).

lm-eval rules transcribed (EleutherAI/lm-evaluation-harness at 4e7e0d4, 2026-08-21):
- lm_eval/api/model.py lines 390-400 (``_encode_pair``): trailing spaces of the context move to the
  continuation; the continuation's tokens are those of ``tok(context + continuation)`` after ``tok(context)``;
- lm_eval/api/task.py line 1390: the request of each choice is ``(ctx, target_delimiter + choice)``;
- lm_eval/api/task.py lines 1494 and 1511: ``acc_norm`` is the arg-max of ``ll / len(choice)`` (characters).
"""

from __future__ import annotations

import copy
import json
import sys
import types

import pytest
import torch
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.errors import InputError, UsageError
from clmerge.merging.lm_eval import load_causal_lm
from clmerge.merging.task_eval import (EvalSpec, TaskOptions, choice_tokens, classification_accuracy, data_kind,
                                       evaluate_folder, harness_tasks, multiple_choice_accuracy, read_examples,
                                       score_requests)
from clmerge.utils.extras import MissingExtraError
from vocab_helpers import CORE, tiny_lm, tiny_tokenizer

runner = CliRunner()


@pytest.fixture(scope="module")
def lm_folder(tmp_path_factory):
    return tiny_lm(tmp_path_factory.mktemp("lm") / "m", seed=3)


@pytest.fixture(scope="module")
def lm(lm_folder):
    return load_causal_lm(lm_folder)


def _hand_ll(model, tok, context: str, choice: str) -> float:
    """log p(choice tokens | context) from one forward pass over context + " " + choice."""
    ctx = tok(context)["input_ids"]
    ids = tok(context + " " + choice)["input_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    return sum(float(logp[p - 1, ids[p]]) for p in range(len(ctx), len(ids)))


def _greedy(model, tok, context: str) -> str:
    ids = torch.tensor([tok(context)["input_ids"]])
    with torch.no_grad():
        nxt = int(model(input_ids=ids).logits[0, -1, 3:].argmax()) + 3  # a word, not <unk>/<s>/</s>
    return tok.convert_ids_to_tokens(nxt)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_choice_scores_are_the_summed_log_likelihood_of_the_choice_tokens(lm):
    model, tok = lm
    ctx, cont = choice_tokens(tok, "w1 w2 w3 ", "w4 w5")  # the trailing space moves to the continuation
    assert ctx == tok("w1 w2 w3")["input_ids"] and len(cont) == 2
    reqs = [choice_tokens(tok, "w1 w2 w3", " " + c) for c in ("w4 w5", "w6", "w7 w8 w9")]
    got = score_requests(model, reqs, max_length=64)  # one right-padded batch of three lengths
    want = [_hand_ll(model, tok, "w1 w2 w3", c) for c in ("w4 w5", "w6", "w7 w8 w9")]
    assert got == pytest.approx(want, rel=1e-9, abs=1e-9)


def test_the_greedy_answer_scores_100_and_acc_norm_divides_by_characters(lm, tmp_path):
    model, tok = lm
    records = []
    for i in range(12):
        q = " ".join(f"w{(i * 7 + k) % 20}" for k in range(4))
        right = _greedy(model, tok, q)
        wrong = [w for w in ("w0", "w1", "w2", "w11") if w != right][:3]
        records.append({"question": q, "choices": wrong[:1] + [right] + wrong[1:], "answer": 1})
    kind, examples = read_examples(_write(tmp_path / "mc.jsonl", records))
    assert kind == "multiple_choice" and len(examples) == 12
    res = multiple_choice_accuracy(model, tok, examples, TaskOptions(batch_size=5), progress=False)
    assert res["acc"] == 100.0 and res["value"] == 100.0 and res["examples"] == 12
    # acc_norm: by hand, ll / len(choice) (the two-character w0, w1, w2 against the three-character w11 ...)
    hits = 0
    for ex in examples:
        normed = [_hand_ll(model, tok, ex["context"], c) / len(c) for c in ex["choices"]]
        hits += int(max(range(len(normed)), key=normed.__getitem__) == ex["answer"])
    assert res["acc_norm"] == pytest.approx(100.0 * hits / 12)
    flipped = copy.deepcopy(model)
    with torch.no_grad():
        flipped.lm_head.weight.neg_()  # the greedy word is now the least likely one
    worse = multiple_choice_accuracy(flipped, tok, examples, TaskOptions(metric="acc_norm"), progress=False)
    assert worse["acc"] == 0.0 and worse["value"] == worse["acc_norm"]


def test_kinds_are_read_from_the_records(tmp_path):
    assert data_kind(_write(tmp_path / "a.jsonl", [{"text": "w1"}])) == "perplexity"
    assert data_kind(_write(tmp_path / "b.jsonl", [{"text": "w1", "label": 0}])) == "classification"
    assert data_kind(_write(tmp_path / "c.jsonl", [{"context": "w1", "choices": ["a", "b"], "answer": 0}])) \
        == "multiple_choice"
    (tmp_path / "d.txt").write_text("w1 w2\n")
    assert data_kind(tmp_path / "d.txt") == "perplexity"


@pytest.mark.parametrize("records, words", [
    ([{"question": "q", "choices": ["a", "b"], "answer": 2}], ["line 1", "answer", "0 to 1"]),
    ([{"question": "q", "choices": ["a"], "answer": 0}], ["line 1", "at least two"]),
    ([{"question": 3, "choices": ["a", "b"], "answer": 0}], ["line 1", "question"]),
    ([{"question": "q", "choices": ["a", "b"], "answer": 0}, {"text": "t", "label": 1}], ["line 2", "one kind"]),
    ([{"text": "t", "label": True}], ["line 1", "label"]),
])
def test_a_bad_example_names_the_file_and_line(tmp_path, records, words):
    path = _write(tmp_path / "x.jsonl", records)
    with pytest.raises(InputError) as err:
        read_examples(path)
    assert all(w in str(err.value) for w in ["x.jsonl", *words])


def _classifier(folder, pad: bool):
    import transformers as tf

    tok = tiny_tokenizer(CORE + (["<pad>"] if pad else []))
    vocab = tok.get_vocab()
    if pad:
        tok.pad_token = "<pad>"
    cfg = tf.LlamaConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=3,
                         pad_token_id=vocab["<pad>"] if pad else None,
                         id2label={0: "neg", 1: "neu", 2: "pos"}, label2id={"neg": 0, "neu": 1, "pos": 2})
    torch.manual_seed(0)
    tf.LlamaForSequenceClassification(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("pad", [True, False])
def test_classification_accuracy_is_the_argmax_of_the_head(tmp_path, pad):
    folder = _classifier(tmp_path / "cls", pad)
    model, tok = load_causal_lm(folder, head="classification")
    texts = ["w1 w2 w3", "w4", "w5 w6", "w7 w8 w9 w10", "w11 w12", "w13"]
    with torch.no_grad():
        preds = [int(model(input_ids=torch.tensor([tok(t)["input_ids"]])).logits.argmax()) for t in texts]
    labels = [p if i % 2 else (p + 1) % 3 for i, p in enumerate(preds)]  # every second one right
    names = ["neg", "neu", "pos"]
    records = [{"text": t, "label": names[y] if i < 3 else y} for i, (t, y) in enumerate(zip(texts, labels))]
    spec = EvalSpec(data=str(_write(tmp_path / "l.jsonl", records)), batch_size=4).check()
    res = evaluate_folder(folder, spec, progress=False)
    assert res["kind"] == "classification" and res["value"] == pytest.approx(50.0) and res["examples"] == 6
    with pytest.raises(InputError, match="label 'happy' is not one of the model's labels"):
        _, ex = read_examples(_write(tmp_path / "bad.jsonl", [{"text": "w1", "label": "happy"}]))
        classification_accuracy(model, tok, ex, TaskOptions(), progress=False)


class FakeHarness:
    """``lm_eval`` and ``lm_eval.models.huggingface`` as sys.modules entries that record the call."""

    def __init__(self, monkeypatch, results):
        self.calls = {}
        top = types.ModuleType("lm_eval")
        hf = types.ModuleType("lm_eval.models.huggingface")

        def simple_evaluate(**kw):
            self.calls["simple_evaluate"] = kw
            return {"results": results, "config": {}}

        class HFLM:
            def __init__(inner, **kw):
                self.calls["HFLM"] = kw

        top.simple_evaluate, hf.HFLM = simple_evaluate, HFLM
        for name, mod in (("lm_eval", top), ("lm_eval.models", types.ModuleType("lm_eval.models")),
                          ("lm_eval.models.huggingface", hf)):
            monkeypatch.setitem(sys.modules, name, mod)


RESULTS = {"hellaswag": {"alias": "hellaswag", "acc,none": 0.25, "acc_stderr,none": 0.01, "acc_norm,none": 0.5},
           "arc_easy": {"alias": "arc_easy", "acc,none": 0.75, "acc_norm,none": float("nan")}}


def test_harness_tasks_call_simple_evaluate_with_an_hflm_of_the_loaded_model(lm, monkeypatch):
    model, tok = lm
    fake = FakeHarness(monkeypatch, RESULTS)
    res = harness_tasks(model, tok, ["hellaswag", "arc_easy"], num_fewshot=5, limit=10, batch_size=2)
    assert fake.calls["HFLM"] == {"pretrained": model, "tokenizer": tok, "batch_size": 2}
    call = fake.calls["simple_evaluate"]
    assert call["tasks"] == ["hellaswag", "arc_easy"] and call["num_fewshot"] == 5 and call["limit"] == 10
    assert type(call["model"]).__name__ == "HFLM"
    assert res["value"] == pytest.approx(0.5) and res["metric"] == "lm_eval acc"
    assert res["results"]["arc_easy"]["acc_norm,none"] is None  # NaN: JSON-safe
    with pytest.raises(UsageError, match="reports no 'f1'.*acc, acc_norm"):
        harness_tasks(model, tok, ["hellaswag"], metric="f1")


def test_the_cli_runs_harness_tasks_and_json_is_written(lm_folder, monkeypatch, tmp_path):
    fake = FakeHarness(monkeypatch, RESULTS)
    res = runner.invoke(app, ["eval", str(lm_folder), "--tasks", "hellaswag", "--metric", "acc_norm",
                              "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "r.json").read_text())["value"] == 0.5
    assert fake.calls["simple_evaluate"]["tasks"] == ["hellaswag"]


def test_without_lm_eval_tasks_are_one_error_line_naming_the_extra(lm_folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    with pytest.raises(MissingExtraError, match=r'clmerge\[lm-eval\]'):
        EvalSpec(tasks=("hellaswag",)).check()
    res = runner.invoke(app, ["eval", str(lm_folder), "--tasks", "hellaswag"])
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 3 and len(lines) == 1 and lines[0].startswith("error: ") and "clmerge[lm-eval]" in lines[0]


def test_the_cli_scores_a_multiple_choice_file(lm_folder, tmp_path):
    path = _write(tmp_path / "mc.jsonl", [{"question": "w1 w2", "choices": ["w3", "w4"], "answer": 0},
                                          {"context": "w5 w6", "choices": ["w7", "w8", "w9"], "answer": 2}])
    res = runner.invoke(app, ["eval", str(lm_folder), "--data", str(path), "--no-progress"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output[res.output.index("{"):])  # after transformers' loading bar (stderr)
    assert out["kind"] == "multiple_choice" and out["metric"] == "acc" and out["examples"] == 2
    assert set(out) >= {"acc", "acc_norm", "value", "model", "data"}


@pytest.mark.parametrize("args, words", [
    ([], ["--data", "--tasks"]),
    (["--tasks", "hellaswag", "--data", "x.txt"], ["give one"]),
    (["--data", "TEXTS", "--metric", "acc"], ["perplexity"]),
    (["--data", "MC", "--metric", "f1"], ["acc or acc_norm"]),
    (["--data", "MC", "--num-fewshot", "2"], ["--num-fewshot"]),
])
def test_bad_combinations_are_one_usage_line(lm_folder, tmp_path, args, words):
    (tmp_path / "t.txt").write_text("w1 w2 w3\n")
    _write(tmp_path / "mc.jsonl", [{"question": "w1", "choices": ["w2", "w3"], "answer": 0}])
    args = [{"TEXTS": str(tmp_path / "t.txt"), "MC": str(tmp_path / "mc.jsonl")}.get(a, a) for a in args]
    res = runner.invoke(app, ["eval", str(lm_folder), *args])
    assert res.exit_code == 2, res.output
    assert res.output.startswith("error: ") and all(w in res.output for w in words)
