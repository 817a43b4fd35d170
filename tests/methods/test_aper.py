"""``aper``: first-session adaptation, then cosine prototypes of [pretrained; adapted] features."""

from __future__ import annotations

import shutil

import pytest
import torch

from clmerge.config import load_config, parse_config
from clmerge.engine import run as run_mod
from clmerge.engine.checkpoint import load_checkpoint, load_head_tensors
from clmerge.engine.run import run_experiment
from clmerge.engine.setup import prepare
from _lora_cl_helpers import uncommit_checkpoint
from conftest import tiny_config

APER = {"name": "aper", "bottleneck": 4}


def _cfg(method: dict, n_tasks: int = 2):
    return parse_config(tiny_config(**{"method": method, "scenario.n_tasks": n_tasks,
                                       "scenario.classes_per_task": [2] * n_tasks}))


def _class_means(model, task) -> dict[int, torch.Tensor]:
    model.eval()
    with torch.no_grad():
        xs, ys = zip(*task.train.batches(50))
        f, y = model.forward_features(torch.cat(xs)).double(), torch.cat(ys)
    return {int(c): f[y == c].mean(0) for c in y.unique()}


def test_prototypes_are_means_of_pretrained_and_adapted_features(tmp_path):
    cfg = _cfg(APER)
    run_experiment(cfg, tmp_path / "aper")
    run_experiment(_cfg({"name": "simplecil"}), tmp_path / "simplecil")
    ckpt = "checkpoints/task_001.safetensors"
    aper, simple = load_head_tensors(tmp_path / "aper" / ckpt), load_head_tensors(tmp_path / "simplecil" / ckpt)
    scenario, model, method, _ = prepare(cfg)
    state = load_checkpoint(tmp_path / "aper" / ckpt)[0]
    model.load_state_dict({k: v for k, v in state.items() if not k.startswith("head.")}, strict=False)
    d = model.backbone.feature_dim
    for task in scenario.tasks:
        means = _class_means(method.inference_model(), task)
        for c, mean in means.items():
            proto = aper[f"stats.mean.{c}"]
            assert proto.shape == (2 * d,)
            torch.testing.assert_close(proto, mean, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(proto[:d], simple[f"stats.mean.{c}"], atol=1e-6, rtol=1e-6)
            assert not torch.allclose(proto[:d], proto[d:])  # the adapted half is another feature


def test_only_the_first_task_trains_adapter_and_head(tmp_path, monkeypatch):
    changes, real = [], run_mod.fit

    def fit(model, data, *, groups, **kw):
        changes.append({g["name"]: [n for n, p in model.named_parameters()
                                    if any(p is q for q in g["params"])] for g in groups})
        return real(model, data, groups=groups, **kw)

    monkeypatch.setattr(run_mod, "fit", fit)
    run_experiment(_cfg(APER, 3), tmp_path / "run")
    assert len(changes) == 1  # tasks 2 and 3 train nothing
    body = changes[0]["body"]
    assert body and all(".bottleneck_adapters.sets.aper." in n for n in body)
    assert changes[0]["head"] == []  # the first-session cosine head is the method's, not the model's head
    changes.clear()
    run_experiment(_cfg({**APER, "adapt_head": "linear"}, 3), tmp_path / "linear")
    assert len(changes) == 1 and changes[0]["head"]  # adapt_head=linear trains the model's linear head


@pytest.mark.parametrize("variant", ["ssf", "vpt_deep", "vpt_shallow"])
def test_every_variant_adapts_its_own_module(tmp_path, variant):
    run_experiment(_cfg({"name": "aper", "variant": variant}, 1), tmp_path / "run")
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "task_000.safetensors")[0]
    key = "backbone.ssf." if variant == "ssf" else "backbone.vpt.prompts"
    assert any(k.startswith(key) for k in state)
    assert not any("bottleneck_adapters.sets" in k for k in state)


def test_aper_defaults_and_options():
    cfg = load_config(None, ["method.name=aper"])
    assert (cfg.head.classifier, cfg.head.ncm_metric) == ("ncm", "cosine")
    o = cfg.method_options()
    assert (o.variant, o.bottleneck, o.adapter_scale, o.adapter_dropout, o.prompt_tokens) == ("adapter", 64, 0.1, 0.1, 5)
    with pytest.raises(Exception, match="variant"):
        load_config(None, ["method.name=aper", "method.variant=lora"])


def test_a_resumed_aper_run_gives_the_same_numbers(tmp_path):
    cfg = tiny_config(**{"method": APER, "scenario.n_tasks": 2, "scenario.classes_per_task": [2, 2],
                         "run.keep_checkpoints": 2})
    full = run_experiment(parse_config(cfg), tmp_path / "full")
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    (tmp_path / "resumed" / "metrics.json").unlink()
    uncommit_checkpoint(tmp_path / "resumed", "task_001.safetensors")  # killed after the first task
    resumed = run_experiment(parse_config(cfg), tmp_path / "resumed", resume=True)
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]


def test_feature_heads_read_the_inference_models_width(tmp_path):
    """RanPAC's projection on APER's 2d-wide features (the head suite sized by the inference model)."""
    cfg = parse_config(tiny_config(**{"method": APER, "head.classifier": "ranpac", "head.ranpac_dim": 64}))
    result = run_experiment(cfg, tmp_path / "run")
    assert result["accuracy_matrix"][1][1] is not None
    assert load_head_tensors(tmp_path / "run" / "checkpoints" / "task_001.safetensors")["ranpac.G"].shape == (64, 64)
