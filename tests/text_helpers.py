"""Shared text fixtures: a tokenizer, a 2-layer random BERT config and WordNet-format files written in tmp_path
(used by test_text_backbone.py and test_merge_bench_text.py)."""

from __future__ import annotations

import numpy as np
import pytest

from clmerge.data import text_wordnet as wn

CLASSES = {"noun.animal": 5, "noun.food": 13, "verb.motion": 38, "verb.weather": 43}
WORDS = {  # content words per class; each synset's gloss draws from its class's words
    "noun.animal": ["dog", "cat", "bird", "fur", "tail", "wing", "beast", "pet"],
    "noun.food": ["bread", "soup", "meal", "eat", "sweet", "salt", "cake", "dish"],
    "verb.motion": ["run", "walk", "move", "fast", "go", "jump", "travel", "step"],
    "verb.weather": ["rain", "snow", "wind", "cold", "storm", "fall", "sky", "wet"],
}
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "the", "of", "to", ":", ";", '"', "x"]
VOCAB += sorted({w for ws in WORDS.values() for w in ws})
LICENCE_LINE = "  1 This software and database is being provided to you, the LICENSEE, by  "
TINY_BERT = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
             "vocab_size": len(VOCAB), "max_position_embeddings": 32, "hidden_dropout_prob": 0.0,
             "attention_probs_dropout_prob": 0.0}


def _data_line(offset: int, lexfile: int, pos: str, lemma: str, gloss: str) -> str:
    return f"{offset:08d} {lexfile:02d} {pos} 01 {lemma} 0 000 | {gloss}  "


def write_wordnet(folder, per_class: int = 12) -> None:
    """data.noun / data.verb with a licence header and ``per_class`` synsets per class of CLASSES."""
    rng = np.random.default_rng(0)
    lines = {"n": [LICENCE_LINE], "v": [LICENCE_LINE]}
    for name, lexfile in CLASSES.items():
        pos = name[0]
        for i in range(per_class):
            words = list(rng.choice(WORDS[name], size=4))
            gloss = f"the {words[0]} of a {words[1]} {words[2]}; \"{words[3]} x\""
            lines[pos].append(_data_line(1000 + 100 * lexfile + i, lexfile, pos, f"{words[3]}_{words[0]}", gloss))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "data.noun").write_text("\n".join(lines["n"]) + "\n")
    (folder / "data.verb").write_text("\n".join(lines["v"]) + "\n")


@pytest.fixture
def text_env(tmp_path, monkeypatch):
    """(tokenizer folder, wordnet folder, cache folder); the Debian and NLTK folders are hidden."""
    from transformers import BertTokenizer  # transformers 5: the fast (Rust) tokenizer, built from a vocabulary

    tok_dir = tmp_path / "tok"
    BertTokenizer(vocab={w: i for i, w in enumerate(VOCAB)}).save_pretrained(tok_dir)
    wn_dir = tmp_path / "wn"
    write_wordnet(wn_dir)
    monkeypatch.setattr(wn, "DEBIAN_DIR", tmp_path / "no-debian")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("NLTK_DATA", raising=False)
    monkeypatch.delenv("CLMERGE_DATA", raising=False)
    return tok_dir, wn_dir, tmp_path / "cache"


def text_config(env, method: dict, **extra) -> dict:
    tok_dir, wn_dir, cache = env
    cfg = {
        "seed": 0,
        "scenario": {"dataset": "wordnet_supersense", "n_tasks": 2, "seed": 0, "data_root": str(wn_dir),
                     "options": {"tokenizer": str(tok_dir), "max_length": 16, "classes": list(CLASSES),
                                 "cache_dir": str(cache)}},
        "model": {"name": "hf-text", "pretrained": False, "config": dict(TINY_BERT)},
        "method": method,
        "optim": {"lr": 1e-2},
        "train": {"epochs": 1, "batch_size": 8, "max_steps_per_epoch": 2},
        "run": {"progress": False, "report": False},
    }
    cfg.update(extra)
    return cfg
