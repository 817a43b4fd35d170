"""Perplexity of a causal LM (``clmerge.merging.lm_eval``) against the NLL computed by hand with the model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from clmerge.errors import InputError, UsageError
from clmerge.merging.lm_eval import EvalOptions, load_causal_lm, perplexity, read_texts, windows
from vocab_helpers import tiny_lm

DOCS = ["w1 w2 w3 w4 w5 w6 w7 w8 w9", "w3 w3 w0 w12 w19", "w5 w6"]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    folder = tiny_lm(tmp_path_factory.mktemp("lm") / "m", seed=3)
    return load_causal_lm(folder)


def _hand_nll(model, tok, text):
    """Summed NLL of tokens 1..n-1 of ``text`` given all the tokens before, one full forward pass."""
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
    return -float(logp.gather(1, ids[0, 1:, None]).sum()), ids.shape[1] - 1


def test_perplexity_is_exp_of_the_token_weighted_mean_nll(lm):
    model, tok = lm
    sums = [_hand_nll(model, tok, d) for d in DOCS]
    expected = math.exp(sum(s for s, _ in sums) / sum(n for _, n in sums))
    res = perplexity(model, tok, DOCS, EvalOptions("x", max_length=64, batch_size=2), progress=False)
    assert res["tokens"] == sum(n for _, n in sums)
    assert res["value"] == pytest.approx(expected, rel=1e-5)


def test_a_stride_shorter_than_the_window_scores_each_token_once(lm):
    model, tok = lm
    full = perplexity(model, tok, DOCS[:1], EvalOptions("x", max_length=64), progress=False)
    slid = perplexity(model, tok, DOCS[:1], EvalOptions("x", max_length=6, stride=3, batch_size=3), progress=False)
    assert slid["tokens"] == full["tokens"] and slid["windows"] > 1
    assert slid["value"] != pytest.approx(full["value"], rel=1e-9)  # less context for the later tokens


def test_windows_follow_the_hf_guide():
    # begin every stride; each window scores only the tokens the previous one did not reach
    assert windows(10, 4, 2) == [(0, 4, 4), (2, 6, 2), (4, 8, 2), (6, 10, 2)]
    assert windows(9, 4, 4) == [(0, 4, 4), (4, 8, 4), (8, 9, 1)]


def test_jsonl_and_text_give_the_same_number(lm, tmp_path):
    model, tok = lm
    (tmp_path / "t.txt").write_text("\n\n".join(DOCS) + "\n")
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    opts = EvalOptions("x", max_length=8, stride=4)
    a = perplexity(model, tok, read_texts(tmp_path / "t.txt"), opts, progress=False)
    b = perplexity(model, tok, read_texts(tmp_path / "t.jsonl"), opts, progress=False)
    assert read_texts(tmp_path / "t.txt") == DOCS
    assert a["value"] == b["value"] and a["tokens"] == b["tokens"]


def test_max_samples_keeps_the_first_documents(tmp_path):
    (tmp_path / "t.txt").write_text("\n\n \n".join(DOCS))
    assert read_texts(tmp_path / "t.txt", max_samples=2) == DOCS[:2]


@pytest.mark.parametrize("content, words", [('{"txt": "a"}\n', ["line 1", '"text"']), ("{oops\n", ["line 1", "JSON"]),
                                            ("\n\n", ["no text"])])
def test_a_bad_jsonl_names_the_file_and_line(tmp_path, content, words):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(InputError) as err:
        read_texts(tmp_path / "d.jsonl")
    assert all(w in str(err.value) for w in ["d.jsonl", *words])


def test_bad_options_name_the_flag():
    with pytest.raises(UsageError, match="--stride"):
        EvalOptions("x", max_length=4, stride=8).check()
    with pytest.raises(UsageError, match="--batch-size"):
        EvalOptions("x", batch_size=0).check()
