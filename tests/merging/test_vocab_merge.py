"""Merging tiny Llama models whose vocabularies differ (recipe keys ``embeddings``, ``fill``,
``chat_template_from``): rows matched by token string, the output tokenizer, tied embeddings, the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from checkpoint_helpers import folder_state, invoke
from vocab_helpers import CORE, head_row, tiny_lm, token_row, vocab_of

EMB, HEAD = "model.embed_tokens.weight", "lm_head.weight"
REORDERED = CORE[:3] + CORE[3:][::-1]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    """base (the core vocabulary); a: + <tool>, zz; b: + <img>; b_perm: b with its vocabulary reordered;
    c: the core without w19; tied variants; equal_head: untied config, lm_head saved equal to the embeddings."""
    d = tmp_path_factory.mktemp("vocab_zoo")
    tiny_lm(d / "base", seed=0)
    tiny_lm(d / "a", seed=1, added=["<tool>", "zz"], chat_template="A: {{ messages }}")
    tiny_lm(d / "b", seed=2, added=["<img>"])
    tiny_lm(d / "b_perm", seed=2, core=REORDERED, added=["<img>"])
    tiny_lm(d / "c", seed=3, core=CORE[:-1])
    tiny_lm(d / "z", seed=4, added=["zz"])
    tiny_lm(d / "tbase", seed=0, tie=True)
    tiny_lm(d / "ta", seed=1, tie=True, added=["<tool>"])
    for name, seed, added in (("ebase", 0, []), ("ea", 1, ["<tool>"]), ("eb", 2, [])):
        tiny_lm(d / name, seed=seed, equal_head=True, added=added)
    (d / "a_weights.safetensors").write_bytes((d / "a" / "model.safetensors").read_bytes())
    return d


def merge(zoo: Path, out: str, method: str, models: list[str], base: str | None = None, **keys):
    recipe = {"method": method, "models": [str(zoo / m) for m in models], **keys}
    if base is not None:
        recipe["base"] = str(zoo / base)
    for k in ("chat_template_from", "tokenizer_from"):
        if k in keys:
            recipe[k] = str(zoo / keys[k])
    path = zoo / f"{out}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    target = zoo / "out" / out
    result = invoke(path, "--out", target, "--no-hash-inputs")
    return result, target


def rows(folder: Path, key: str = EMB) -> dict[str, torch.Tensor]:
    """``{token: row}`` of a merged model's matrix ``key``."""
    state, vocab = folder_state(folder), vocab_of(folder)
    return {t: state[key][i] for t, i in vocab.items()}


def test_union_adds_the_other_tokens_in_input_order_and_keeps_the_base_ids(zoo):
    res, out = merge(zoo, "union_ta", "task_arithmetic", ["a", "b"], base="base", embeddings="union",
                     parameters={"scaling": 1.0})
    assert res.exit_code == 0, res.output
    vocab = vocab_of(out)
    assert [t for t in sorted(vocab, key=vocab.get)] == CORE + ["<tool>", "zz", "<img>"]
    state = folder_state(out)
    assert state[EMB].shape == state[HEAD].shape == (len(CORE) + 3, 16)
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == len(CORE) + 3 and config["eos_token_id"] == vocab["</s>"]
    got = rows(out)
    # a token only one model has keeps that model's row; a shared one is base + the sum of task vectors
    assert torch.allclose(got["zz"], token_row("zz", 1)) and torch.allclose(got["<img>"], token_row("<img>", 2))
    w5 = token_row("w5", 1) + token_row("w5", 2) - token_row("w5", 0)
    assert torch.allclose(got["w5"], w5, atol=1e-6)
    assert torch.allclose(rows(out, HEAD)["zz"], head_row("zz", 1))


def test_union_output_loads_and_encodes_the_added_tokens(zoo):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    res, out = merge(zoo, "union_load", "weight_average", ["a", "b"], embeddings="union")
    assert res.exit_code == 0, res.output
    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out))
    ids = tok("w1 <tool> zz <img>").input_ids
    assert ids == [tok.get_vocab()[t] for t in ("w1", "<tool>", "zz", "<img>")]
    assert model(torch.tensor([ids])).logits.shape == (1, 4, len(CORE) + 3)
    special = {t.content: t.special for t in tok.added_tokens_decoder.values()}
    assert special["<tool>"] and not special["zz"]  # an added token keeps its settings


def test_a_reordered_vocabulary_merges_like_the_unreordered_one(zoo):
    r1, plain = merge(zoo, "plain", "ties", ["a", "b"], base="base", embeddings="union",
                      parameters={"density": 0.5})
    r2, perm = merge(zoo, "perm", "ties", ["a", "b_perm"], base="base", embeddings="union",
                     parameters={"density": 0.5})
    assert r1.exit_code == r2.exit_code == 0, r1.output + r2.output
    assert vocab_of(plain) == vocab_of(perm)
    s1, s2 = folder_state(plain), folder_state(perm)
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)


def test_without_embeddings_a_reordered_vocabulary_is_merged_by_row_index(zoo):
    # the old behaviour stays for recipes that do not set the key: rows are paired by index
    _, plain = merge(zoo, "idx_plain", "weight_average", ["b"], base=None)
    res, perm = merge(zoo, "idx_mixed", "weight_average", ["b", "b_perm"])
    assert res.exit_code == 0
    assert not torch.allclose(folder_state(perm)[EMB], folder_state(plain)[EMB])


def test_a_row_count_mismatch_without_embeddings_stays_an_error_that_names_the_key(zoo):
    res, out = merge(zoo, "mismatch", "task_arithmetic", ["a"], base="base")
    assert res.exit_code == 3 and "shape mismatch" in res.output and "[25, 16]" in res.output
    assert "set embeddings: union, base or intersection" in res.output
    assert not out.exists()


@pytest.mark.parametrize("fill, expected", [
    ("present", lambda: token_row("zz", 1)),
    ("zero", lambda: token_row("zz", 1) / 2),
    ("mean", lambda: (token_row("zz", 1) + torch.stack([token_row(t, 2) for t in CORE + ["<img>"]]).mean(0)) / 2),
])
def test_fill_rules_for_a_token_one_model_lacks(zoo, fill, expected):
    res, out = merge(zoo, f"fill_{fill}", "weight_average", ["a", "b"], embeddings="union", fill=fill)
    assert res.exit_code == 0, res.output
    assert torch.allclose(rows(out)["zz"], expected(), atol=1e-6)
    assert torch.allclose(rows(out)["w3"], (token_row("w3", 1) + token_row("w3", 2)) / 2, atol=1e-6)


def test_base_keeps_the_base_rows_and_reports_what_was_dropped(zoo):
    res, out = merge(zoo, "base_mode", "task_arithmetic", ["a", "b"], base="base", embeddings="base")
    assert res.exit_code == 0, res.output
    assert vocab_of(out) == vocab_of(zoo / "base")
    report = json.loads((out / "merge_report.json").read_text())["vocabulary"]
    assert report["rows"] == len(CORE) and report["added"]["count"] == 0
    assert report["dropped"] == {"count": 3, "first": ["<tool>", "zz", "<img>"]}
    assert [i["filled"]["count"] for i in report["inputs"]] == [0, 0, 0]


def test_intersection_drops_the_added_tokens_some_model_lacks(zoo):
    res, out = merge(zoo, "inter", "weight_average", ["a", "b"], embeddings="intersection")
    assert res.exit_code == 0, res.output
    assert sorted(vocab_of(out), key=vocab_of(out).get) == CORE
    assert torch.allclose(rows(out)["w7"], (token_row("w7", 1) + token_row("w7", 2)) / 2, atol=1e-6)
    report = json.loads((out / "merge_report.json").read_text())["vocabulary"]
    assert report["dropped"]["count"] == 3 and report["filled_rows"] == 0


def test_intersection_moves_the_added_tokens_after_a_dropped_one_down(zoo):
    from transformers import AutoTokenizer

    res, out = merge(zoo, "inter_renumber", "weight_average", ["a", "z"], embeddings="intersection")
    assert res.exit_code == 0, res.output
    vocab = vocab_of(out)
    assert sorted(vocab, key=vocab.get) == CORE + ["zz"]  # <tool> (23) dropped: zz moves from 24 to 23
    assert torch.allclose(rows(out)["zz"], (token_row("zz", 1) + token_row("zz", 4)) / 2, atol=1e-6)
    assert AutoTokenizer.from_pretrained(str(out))("w2 zz").input_ids == [vocab["w2"], vocab["zz"]]


def test_intersection_that_would_cut_the_tokenizer_model_is_refused(zoo):
    res, out = merge(zoo, "inter_core", "weight_average", ["a", "c"], embeddings="intersection")
    assert res.exit_code == 3 and "'w19'" in res.output and "union" in res.output
    assert not out.exists()


def test_union_report_lists_added_and_filled_rows(zoo):
    res, out = merge(zoo, "report", "task_arithmetic", ["a", "b"], base="base", embeddings="union")
    assert res.exit_code == 0
    rep = json.loads((out / "merge_report.json").read_text())["vocabulary"]
    assert rep["added"] == {"count": 3, "first": ["<tool>", "zz", "<img>"]}
    assert [i["filled"] for i in rep["inputs"]] == [{"count": 3, "first": ["<tool>", "zz", "<img>"]},
                                                     {"count": 1, "first": ["<img>"]},
                                                     {"count": 2, "first": ["<tool>", "zz"]}]
    assert rep["keys"] == [HEAD, EMB] and "3 added" in res.output


def test_tied_embeddings_stay_tied(zoo):
    res, out = merge(zoo, "tied", "dare", ["ta"], base="tbase", embeddings="union")
    assert res.exit_code == 0, res.output
    assert HEAD not in folder_state(out)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_equal_input_and_output_embeddings_are_detected_and_stay_equal(zoo):
    # dare draws a different mask per key: without the tie, lm_head and embed_tokens would differ
    res, out = merge(zoo, "equal", "dare", ["ea", "eb"], base="ebase", embeddings="union")
    assert res.exit_code == 0, res.output
    state = folder_state(out)
    assert torch.equal(state[EMB], state[HEAD])
    assert json.loads((out / "merge_report.json").read_text())["vocabulary"]["tied"] is True


def test_chat_template_from_picks_the_named_models_template(zoo):
    from transformers import AutoTokenizer

    res, out = merge(zoo, "chat", "weight_average", ["b", "a"], embeddings="union", chat_template_from="a")
    assert res.exit_code == 0, res.output
    assert AutoTokenizer.from_pretrained(str(out)).chat_template == "A: {{ messages }}"


def test_tokenizer_from_picks_the_reference_vocabulary(zoo):
    res, out = merge(zoo, "ref_b", "weight_average", ["a", "b"], embeddings="base", tokenizer_from="b")
    assert res.exit_code == 0, res.output
    assert vocab_of(out) == vocab_of(zoo / "b")


class _Counting:
    """A dict source that counts the reads of each key."""

    def __init__(self, tensors: dict, name: str) -> None:
        from clmerge.merging.io import ParamSource

        self.src, self.name, self.reads = ParamSource(tensors, name), name, {}

    def keys(self):
        return self.src.keys()

    def meta(self, key):
        return self.src.meta(key)

    def get(self, key):
        self.reads[key] = self.reads.get(key, 0) + 1
        return self.src.get(key)


def test_present_fill_uses_the_base_row_for_a_model_and_the_models_mean_for_the_base():
    from clmerge.merging.vocab import ReindexedSource, plan_vocab

    vocabs = {"base": {"a": 0, "b": 1}, "m1": {"b": 0, "a": 1, "x": 2}, "m2": {"a": 0, "x": 1, "y": 2}}
    mats = {n: torch.arange(len(v) * 2, dtype=torch.float32).reshape(-1, 2) + 10 * i
            for i, (n, v) in enumerate(vocabs.items())}
    sources = [_Counting({"emb.weight": mats[n]}, n) for n in vocabs]
    out = {"a": 0, "b": 1, "x": 2, "y": 3}
    plan = plan_vocab(mode="union", fill="present", out_vocab=out, added=["x", "y"],
                      inputs=[(n, v, len(v)) for n, v in vocabs.items()], keys={"emb.weight": "input"},
                      has_base=True, tied=False)
    got = [ReindexedSource(s, plan, i, sources).get("emb.weight") for i, s in enumerate(sources)]
    m1, m2, base = mats["m1"], mats["m2"], mats["base"]
    assert torch.equal(got[0], torch.stack([base[0], base[1], (m1[2] + m2[1]) / 2, m2[2]]))  # base: models' mean
    assert torch.equal(got[1], torch.stack([m1[1], m1[0], m1[2], m2[2]]))  # lacks y: only m2 has it
    assert torch.equal(got[2], torch.stack([m2[0], base[1], m2[1], m2[2]]))  # lacks b: the base's row
    # the stand-ins are gathered once (one more read per input), and hold only the missing rows
    assert [s.reads["emb.weight"] for s in sources] == [2, 2, 2]
    assert [None if t is None else tuple(t.shape) for t in plan.standins("emb.weight", sources)] == \
        [(2, 2), (1, 2), (1, 2)]


def test_dry_run_shows_the_vocabulary_and_writes_nothing(zoo):
    recipe = zoo / "dry.yaml"
    recipe.write_text(yaml.safe_dump({"method": "weight_average", "models": [str(zoo / "a"), str(zoo / "b")],
                                      "embeddings": "union"}))
    res = invoke(recipe, "--dry-run")
    assert res.exit_code == 0, res.output
    assert "vocabulary (union, fill present): 26 rows; 1 added, 0 dropped, 3 filled" in res.output  # a is the reference


def test_a_single_safetensors_output_is_refused_when_the_tokenizer_changes(zoo):
    recipe = zoo / "to_file.yaml"
    recipe.write_text(yaml.safe_dump({"method": "weight_average", "models": [str(zoo / "a"), str(zoo / "b")],
                                      "embeddings": "union"}))
    res = invoke(recipe, "--out", zoo / "merged.safetensors")
    assert res.exit_code == 2 and "give --out a folder" in res.output
    assert not (zoo / "merged.safetensors").exists()


def test_chat_template_from_without_embeddings_keeps_a_tokenizer_from_outside_the_inputs(zoo):
    from transformers import AutoTokenizer

    res, out = merge(zoo, "chat_only", "weight_average", ["a"], tokenizer_from="base", chat_template_from="a")
    assert res.exit_code == 0, res.output
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.get_vocab() == vocab_of(zoo / "base") and tok.chat_template == "A: {{ messages }}"
    assert not (out / "merge_report.json").exists()


def test_embedding_keys_are_found_by_name_outside_the_numbered_layers():
    from clmerge.merging.vocab import embedding_keys

    shapes = {"model.embed_tokens.weight": (8, 4), "lm_head.weight": (8, 4), "transformer.wte.weight": (8, 4),
              "model.layers.0.attention.output.weight": (4, 4), "output.weight": (8, 4), "model.norm.weight": (4,),
              "model.embed_tokens.bias": (8,)}
    assert embedding_keys(list(shapes), shapes.get) == {
        "model.embed_tokens.weight": "input", "lm_head.weight": "output", "transformer.wte.weight": "input",
        "output.weight": "output"}
