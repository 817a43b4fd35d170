"""extract-lora (full fine-tune -> PEFT adapter) and export of continual runs (hf folder / PEFT adapter)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from clmerge.engine.export import load_run_model  # noqa: E402
from clmerge.cli import app  # noqa: E402
from clmerge.config import parse_config  # noqa: E402
from clmerge.engine.run import run_experiment  # noqa: E402
from conftest import tiny_config  # noqa: E402

BERT = dict(vocab_size=50, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=16, type_vocab_size=1)


def _bert(seed: int = 0):
    torch.manual_seed(seed)
    return transformers.BertModel(transformers.BertConfig(**BERT), add_pooling_layer=False).eval()


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def fine_tune(tmp_path_factory):
    """Base BERT and a 'fine-tune': rank-3 updates on every attention query/value and intermediate Linear,
    plus changed word embeddings and a LayerNorm (which extract-lora skips)."""
    d = tmp_path_factory.mktemp("ft")
    base = _bert()
    base.save_pretrained(d / "base")
    g = torch.Generator().manual_seed(1)
    deltas = {}
    with torch.no_grad():
        for name, p in base.named_parameters():
            if name.endswith(("query.weight", "value.weight", "intermediate.dense.weight")):
                out_f, in_f = p.shape
                deltas[name] = torch.randn(out_f, 3, generator=g) @ torch.randn(3, in_f, generator=g) * 0.1
                p += deltas[name]
        base.embeddings.word_embeddings.weight.add_(0.5)
        base.encoder.layer[0].output.LayerNorm.weight.add_(0.5)
    base.save_pretrained(d / "tuned")
    return d, deltas


def test_extract_lora_recovers_low_rank_update(tmp_path, fine_tune):
    d, deltas = fine_tune
    res = _cli("extract-lora", "--base", d / "base", "--tuned", d / "tuned", "--rank", 3, "--out", tmp_path / "x")
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "x" / "extract_report.json").read_text())
    assert sorted(m + ".weight" for m in report["modules"]) == sorted(deltas)  # embeddings, LayerNorm skipped
    assert report["max_rel_error"] < 1e-6
    loaded = peft.PeftModel.from_pretrained(_bert(), tmp_path / "x").merge_and_unload()
    tuned = transformers.BertModel.from_pretrained(d / "tuned", add_pooling_layer=False)
    sd, want = loaded.state_dict(), tuned.state_dict()
    for k in deltas:
        torch.testing.assert_close(sd[k], want[k], rtol=0, atol=1e-6)
    # rank 2 < 3: the error is the tail singular value's share
    res2 = _cli("extract-lora", "--base", d / "base", "--tuned", d / "tuned", "--rank", 2, "--out", tmp_path / "y")
    assert res2.exit_code == 0, res2.output
    r2 = json.loads((tmp_path / "y" / "extract_report.json").read_text())
    k0 = sorted(deltas)[0]
    s = torch.linalg.svdvals(deltas[k0].double())
    assert r2["per_module_rel_error"][k0[: -len(".weight")]] == pytest.approx(
        float(s[2:].norm() / s.norm()), rel=1e-4)


def test_extract_lora_embeddings_when_asked(tmp_path, fine_tune):
    d, deltas = fine_tune
    res = _cli("extract-lora", "--base", d / "base", "--tuned", d / "tuned", "--rank", 3, "--out", tmp_path / "x",
               "--include-embeddings", "--include", "word_embeddings|layer.0.attention")
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "x" / "extract_report.json").read_text())
    assert report["embeddings"] == ["embeddings.word_embeddings"] and report["max_rel_error"] < 1e-6
    assert report["modules"] == ["embeddings.word_embeddings", "encoder.layer.0.attention.self.query",
                                 "encoder.layer.0.attention.self.value"]
    loaded = peft.PeftModel.from_pretrained(_bert(), tmp_path / "x").merge_and_unload().state_dict()
    tuned = transformers.BertModel.from_pretrained(d / "tuned", add_pooling_layer=False).state_dict()
    key = "embeddings.word_embeddings.weight"
    torch.testing.assert_close(loaded[key], tuned[key], rtol=0, atol=1e-6)


def test_extract_lora_bad_input_is_one_line_exit_2(tmp_path, fine_tune):
    d, _ = fine_tune
    res = _cli("extract-lora", "--base", d / "base", "--tuned", d / "base", "--rank", 2, "--out", tmp_path / "z")
    assert res.exit_code == 3 and "nothing to extract" in res.output and not (tmp_path / "z").exists()
    res = _cli("extract-lora", "--base", d / "base", "--tuned", d / "tuned", "--rank", 2, "--out", d / "base")
    assert res.exit_code == 5 and "contains or lies inside the input" in res.output  # OutputError


def _run(tmp_path_factory, method: str):
    run = tmp_path_factory.mktemp("runs") / method
    cfg = tiny_config(**{"method": {"name": method, "rank": 2}, "train.epochs": 1})
    run_experiment(parse_config(cfg), run)
    return run


@pytest.fixture(scope="module")
def sd_lora_run(tmp_path_factory):
    """A 2-task SD-LoRA run on a 1-layer random-init ViT (unfolded components, shared magnitudes)."""
    return _run(tmp_path_factory, "sd_lora")


def _pixels(folded):
    torch.manual_seed(3)
    return folded.backbone.preprocess(torch.rand(3, 1, 28, 28))


def test_export_hf_and_peft_reproduce_the_folded_backbone(tmp_path, sd_lora_run):
    folded, pretrained, _, _ = load_run_model(sd_lora_run)
    x = _pixels(folded)
    with torch.no_grad():
        want = folded.backbone.inner(pixel_values=x).last_hidden_state
        assert (want - pretrained.inner(pixel_values=x).last_hidden_state).abs().max() > 1e-3  # LoRA mattered
    res = _cli("export", sd_lora_run, "--format", "hf", "--out", tmp_path / "hf")
    assert res.exit_code == 0, res.output
    hf = transformers.ViTModel.from_pretrained(tmp_path / "hf", add_pooling_layer=False).eval()
    head = __import__("safetensors.torch").torch.load_file(str(tmp_path / "hf" / "head.safetensors"))
    classes = json.loads((tmp_path / "hf" / "classes.json").read_text())
    assert head["weight"].shape == (4, 32) and classes["head_blocks"] == [2, 2]
    res = _cli("export", sd_lora_run, "--format", "peft", "--out", tmp_path / "pa", "--base-out", tmp_path / "b")
    assert res.exit_code == 0, res.output
    base = transformers.ViTModel.from_pretrained(tmp_path / "b", add_pooling_layer=False)
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "pa").eval()
    with torch.no_grad():
        feats = hf(pixel_values=x).last_hidden_state
        torch.testing.assert_close(feats, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(feats[:, 0] @ head["weight"].T + head["bias"], folded.head(want[:, 0]))
        torch.testing.assert_close(with_adapter(pixel_values=x).last_hidden_state, want, rtol=0, atol=1e-5)
    report = json.loads((tmp_path / "pa" / "export_report.json").read_text())
    assert report["max_rel_error"] < 1e-6 and report["method"] == "sd_lora"


def test_export_refusals(tmp_path, sd_lora_run):
    res = _cli("export", sd_lora_run, "--format", "onnx", "--out", tmp_path / "o")
    assert res.exit_code == 2 and "--format" in res.output
    res = _cli("export", tmp_path, "--format", "hf", "--out", tmp_path / "o")
    assert res.exit_code == 3 and "not a run directory" in res.output  # InputError
    run = tmp_path / "ft"
    run_experiment(parse_config(tiny_config(**{"method": {"name": "finetune"}, "train.epochs": 1,
                                               "scenario.n_tasks": 2})), run)
    res = _cli("export", run, "--format", "peft", "--out", tmp_path / "p")
    assert res.exit_code == 3 and "no LoRA layers" in res.output and not (tmp_path / "p").exists()


@pytest.mark.parametrize("method", ["seq_lora", "pm", "inflora"])
def test_export_peft_of_folding_methods(tmp_path, tmp_path_factory, method):
    """Methods that fold each task's LoRA into the weights: the adapter is the folded change, rank 2 x 2 tasks."""
    run = _run(tmp_path_factory, method)
    folded, pretrained, _, _ = load_run_model(run)
    res = _cli("export", run, "--format", "peft", "--out", tmp_path / "pa")
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "pa" / "export_report.json").read_text())
    assert report["rank"] == 4 and report["max_rel_error"] < 1e-5
    x = _pixels(folded)
    with_adapter = peft.PeftModel.from_pretrained(copy.deepcopy(pretrained.inner), tmp_path / "pa").eval()
    with torch.no_grad():
        want = folded.backbone.inner(pixel_values=x).last_hidden_state
        torch.testing.assert_close(with_adapter(pixel_values=x).last_hidden_state, want, rtol=0, atol=1e-5)


def test_export_refuses_task_routed_methods(tmp_path):
    cfg = tiny_config(**{"method": {"name": "halrp"}, "train.epochs": 1})
    cfg["model"] = {"name": "lenet", "pretrained": False}
    run_experiment(parse_config(cfg), tmp_path / "h")
    res = _cli("export", tmp_path / "h", "--format", "hf", "--out", tmp_path / "o")
    assert res.exit_code == 3 and "keeps per-task modules" in res.output and not (tmp_path / "o").exists()
