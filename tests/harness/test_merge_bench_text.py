"""Merging on the text backbone: the text suites of merge-bench, integer buffers under every merge
method, `clmerge study` on text and `clmerge export` of a text run; a 2-layer random BERT, a generated tokenizer
and WordNet-format files (text_helpers), never the real model or data."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.data import build_dataset
from clmerge.data.text_wordnet import DEFAULT_CLASSES
from clmerge.harness.merge_bench import DEFAULT_GRIDS, SUITES, BenchConfig, load_task, parse_task
from clmerge.harness.merge_bench_run import run_merge_bench
from clmerge.harness.merge_bench_experts import expert_path, init_expert, loss_and_accuracy, load_cached_expert
from clmerge.merging import merge
from clmerge.models import build_backbone
from text_helpers import CLASSES, TINY_BERT, text_config, text_env  # noqa: F401  (text_env: a fixture)

runner = CliRunner()


def _options(env) -> dict:
    tok_dir, wn_dir, cache = env
    return {"data_root": str(wn_dir), "tokenizer": str(tok_dir), "max_length": 16, "classes": list(CLASSES),
            "cache_dir": str(cache)}


def _cfg(env, **kw) -> BenchConfig:
    return BenchConfig(suite="text-tiny", backbone="hf-text", pretrained=False, arch=dict(TINY_BERT),
                       data_options=_options(env), **kw)


def test_text6_covers_the_40_supersenses_once_without_mixing_nouns_and_verbs():
    tasks = SUITES["text6"]
    assert len(tasks) == 6 and all(t.dataset == "wordnet_supersense" and t.transform == "identity" for t in tasks)
    ids = [c for t in tasks for c in t.class_list()]
    assert sorted(ids) == list(range(40))
    for t in tasks:
        assert len({DEFAULT_CLASSES[c].split(".")[0] for c in t.class_list()}) == 1


def test_load_task_keeps_token_ids_and_renumbers_classes(text_env):
    cfg = _cfg(text_env, max_eval=5)
    data = load_task(parse_task("wordnet_supersense:identity:1,3"), cfg)
    src = build_dataset("wordnet_supersense", **_options(text_env))
    x, y = data["train"]
    assert x.dtype == torch.int64 and x.shape[1:] == (2, 16)
    assert set(y.tolist()) == {0, 1} and len(data["test"][1]) == 5
    # each row is one of the source's rows of class 1 (label 0) or 3 (label 1), unchanged
    rows = {tuple(r.flatten().tolist()): int(c) for r, c in zip(src.train.tokens, src.train.targets)}
    assert all(rows[tuple(r.flatten().tolist())] == [1, 3][int(c)] for r, c in zip(x, y))


def test_a_text_task_refuses_a_non_identity_transform(text_env):
    with pytest.raises(ValueError, match=r"task 'wordnet_supersense:rot90:0-1'.*only the 'identity'"):
        load_task(parse_task("wordnet_supersense:rot90:0-1"), _cfg(text_env))


def _bert_state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    sd = dict(build_backbone("hf-text", pretrained=False, config=dict(TINY_BERT)).state_dict())
    # integer buffers as older transformers keep them in BERT's state dict (position ids, token type ids)
    sd["inner.embeddings.position_ids"] = torch.arange(32).unsqueeze(0) + seed
    sd["inner.embeddings.token_type_ids"] = torch.full((1, 32), seed, dtype=torch.int64)
    return sd


@pytest.mark.parametrize("method", list(DEFAULT_GRIDS))
def test_every_bench_method_merges_bert_and_keeps_integer_buffers(method):
    base = _bert_state(0)
    experts = [{k: v + 0.01 * (i + 1) * torch.randn_like(v) if v.is_floating_point() else v
                for k, v in _bert_state(i + 1).items()} for i in range(3)]
    hp = {k: v[0] for k, v in DEFAULT_GRIDS[method].items()}
    merged = merge(method, base=base, experts=experts, **hp)
    assert merged.keys() == base.keys()
    for k, v in merged.items():
        assert v.dtype == base[k].dtype and v.shape == base[k].shape, k
        if not v.is_floating_point():  # never averaged or scaled: the base's own
            assert torch.equal(v, base[k]), k
        else:
            assert torch.isfinite(v).all(), k
    if method == "task_arithmetic":  # Eq. theta = theta_0 + lambda * sum_t (theta_t - theta_0)
        k = "inner.embeddings.word_embeddings.weight"
        want = base[k] + hp["scaling"] * sum(e[k] - base[k] for e in experts)
        torch.testing.assert_close(merged[k], want, rtol=1e-5, atol=1e-6)


def test_merge_bench_text_tiny_end_to_end_with_frozen_heads(text_env, tmp_path):
    out = tmp_path / "bench"
    res = run_merge_bench(out, suite="text-tiny", epochs=2, lr=1e-3, random_init=True, backbone="hf-text",
                          arch=TINY_BERT, data_options=_options(text_env), methods=list(DEFAULT_GRIDS),
                          log=lambda *_: None)
    assert res["config"]["backbone"] == "hf-text" and res["config"]["heads"] == "frozen"
    assert res["config"]["max_train"] == 64  # the suite's cap
    assert set(DEFAULT_GRIDS) <= set(res["rows"]) and len(res["tasks"]) == 3
    # the individual row is each cached expert with its frozen head on its task's test split, recomputed here
    cfg = BenchConfig(**res["config"])
    for task, acc in zip(SUITES["text-tiny"], res["rows"]["individual"]["test"]):
        data = load_task(task, cfg)
        sd = load_cached_expert(expert_path(out / "experts", task, cfg))
        backbone, head = init_expert(cfg, 2, data)
        assert torch.equal(sd["head.weight"], head.weight)  # the head stayed the fitted probe
        backbone.load_state_dict({k[9:]: v for k, v in sd.items() if k.startswith("backbone.")})
        head.load_state_dict({k[5:]: v for k, v in sd.items() if k.startswith("head.")})
        correct = loss_and_accuracy(backbone, head, *data["test"])[1]
        assert acc == pytest.approx(100.0 * correct / len(data["test"][1]))
    assert (out / "results.md").is_file()


def test_merge_bench_cli_names_a_bad_backbone():
    r = runner.invoke(app, ["merge-bench", "--suite", "text-tiny", "--backbone", "bert-nope", "--out", "unused"])
    assert r.exit_code == 2 and "--backbone 'bert-nope': unknown" in r.output
    assert "Traceback" not in r.output


def test_study_runs_on_the_text_backbone(text_env, tmp_path):
    from clmerge.sweep import finish_study
    from clmerge.sweep import run_study
    from clmerge.theory.spec import parse_study

    spec = parse_study({
        "name": "text-tiny", "base": {"backbone": "hf-text", "pretrained": False, "arch": dict(TINY_BERT)},
        "suite": "text-tiny", "data": {"max_train": 24, "max_eval": 12, "options": _options(text_env)},
        "defaults": {"steps": 2, "lr": 0.05, "batch_size": 8, "n_experts": 2},
        "grid": {"lr": [0.01, 0.05]}, "seeds": [0], "groups": 1,
        "methods": [{"name": "averaging"}, {"name": "task_arithmetic", "scaling": 0.5}],
        "measure": {"noise_samples": 4, "stability": False}, "threads": 1})
    rows = run_study(spec, tmp_path / "study", log=lambda *_: None)
    assert len(rows) == 4
    for r in rows:
        assert 0.0 <= r["merged_acc"] <= 100.0 and len(r["per_task_acc"]) == 2 and r["sigma2"][0] > 0
    finish_study(tmp_path / "study", n_boot=5)
    assert (tmp_path / "study" / "fits.json").is_file()


def test_export_of_a_text_run_records_tokenizer_max_length_and_pooling(text_env, tmp_path):
    from transformers import AutoModel, AutoTokenizer

    from clmerge.engine.export import export_run, load_run_model
    from clmerge.config import parse_config
    from clmerge.engine.run import run_experiment
    from clmerge.models.text import pool_hidden_states

    run_dir = tmp_path / "run"
    run_experiment(parse_config(text_config(text_env, {"name": "seq_lora", "rank": 2})), run_dir)
    out = tmp_path / "export"
    export_run(run_dir, format="hf", out=out)
    classes = json.loads((out / "classes.json").read_text())
    pre = classes["preprocess"]
    assert pre["kind"] == "text" and pre["tokenizer"] == str(text_env[0]) and pre["max_length"] == 16
    assert pre["pooling"] == "mean" and len(pre["tokenizer_sha256"]) == 64 and "mean" in classes["features"]
    assert "image_size" not in pre
    # the folder alone reproduces the run's features: its tokenizer, its encoder, mean pooling
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    enc = tok(["the dog of a cat", "rain"], padding="max_length", truncation=True, max_length=16,
              return_tensors="pt")
    inner = AutoModel.from_pretrained(out, local_files_only=True).eval()
    with torch.no_grad():
        got = pool_hidden_states(inner(**enc).last_hidden_state, enc["attention_mask"], "mean")
        folded = load_run_model(run_dir)[0].backbone.eval()
        want = folded(torch.stack([enc["input_ids"], enc["attention_mask"]], dim=1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_looped_per_sample_gradients_equal_the_vectorised_ones():
    """The per-sample loop the study uses for token inputs gives per_sample_grads' gradients (float inputs)."""
    from torch import nn

    from clmerge.params.fisher import per_sample_grads
    from clmerge.params.fisher import _looped_per_sample_grads

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    x, y = torch.randn(6, 5), torch.tensor([0, 1, 2, 0, 1, 2])
    names = [n for n, _ in model.named_parameters()]
    want, got = per_sample_grads(model, names, x, y), _looped_per_sample_grads(model, names, x, y)
    for n in names:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6)


def test_study_text_yaml_has_the_size_its_header_states():
    from pathlib import Path

    from clmerge.harness.merge_bench_experts import expert_digest
    from clmerge.theory.spec import expand_points, load_study

    spec = load_study(Path(__file__).parents[2] / "benchmarks" / "study_text.yaml")
    assert spec.base.backbone == "minilm-l6" and spec.suite == "text6"
    points = expand_points(spec)
    experts = {(t.spec, expert_digest(t, c)): c.steps for p in points for t, c in p.expert_configs(spec)}
    assert (len(points), len(experts), sum(experts.values())) == (99, 72, 1116)


def test_per_sample_gradients_on_the_text_backbone_sum_to_the_batch_gradient():
    """Fisher merging and the study take per-sample gradients; vmap cannot trace the text forward (padding cut,
    transformers' mask checks), so token inputs loop. The per-sample gradients (each text alone, trimmed to its
    own length) must sum to the gradient of the summed loss over the padded batch."""
    import torch.nn.functional as F
    from torch import nn

    from clmerge.params.fisher import per_sample_grads

    torch.manual_seed(0)
    backbone = build_backbone("hf-text", pretrained=False, config=dict(TINY_BERT))
    model = nn.Sequential(backbone, nn.Linear(backbone.feature_dim, 3))
    ids = torch.randint(4, TINY_BERT["vocab_size"], (4, 8))
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3, [1] * 3 + [0] * 5, [1] * 6 + [0] * 2])
    x, y = torch.stack([ids * mask, mask], dim=1), torch.tensor([0, 1, 2, 1])
    names = [n for n, _ in model.named_parameters()]
    got = per_sample_grads(model, names, x, y)
    params = dict(model.named_parameters())
    batch = torch.autograd.grad(F.cross_entropy(model(x), y, reduction="sum"), [params[n] for n in names])
    assert got[names[0]].shape[0] == 4
    for n, g in zip(names, batch):
        torch.testing.assert_close(got[n].sum(0), g, rtol=1e-4, atol=1e-5)
