"""``slca``: a slow backbone (``backbone_lr_scale`` times the head's lr) and classifier alignment on by default."""

from __future__ import annotations

import json

import pytest
import torch

from clmerge.config import load_config, parse_config
from clmerge.engine import run as run_mod
from clmerge.engine import training
from clmerge.engine.run import run_experiment
from conftest import tiny_config


def _record_optimizers(monkeypatch) -> list[dict]:
    """Wrap ``build_optimizer``: per optimizer, the lr of each named parameter group."""
    seen, real = [], training.build_optimizer

    def build(groups, cfg, **kw):
        opt = real(groups, cfg, **kw)
        seen.append({g.get("name"): g["lr"] for g in opt.param_groups})
        return opt

    monkeypatch.setattr(training, "build_optimizer", build)
    return seen


def _slca(tmp_path, **kw):
    cfg = parse_config(tiny_config(**{"method": {"name": "slca"}, **kw}))
    return cfg, run_experiment(cfg, tmp_path / "run")


@pytest.mark.parametrize(("head_lr", "scale"), [(None, 0.01), (0.05, 0.1)])
def test_the_backbone_trains_at_the_scale_times_the_heads_lr(tmp_path, monkeypatch, head_lr, scale):
    seen = _record_optimizers(monkeypatch)
    _slca(tmp_path, **{"method": {"name": "slca", "backbone_lr_scale": scale}, "scenario.n_tasks": 1,
                       "scenario.classes_per_task": [2], "optim.head_lr": head_lr})
    head = head_lr if head_lr is not None else 1e-2
    assert seen == [{"body": pytest.approx(head * scale), "head": pytest.approx(head)}]


def test_other_methods_keep_the_runs_lr_on_the_backbone(tmp_path, monkeypatch):
    seen = _record_optimizers(monkeypatch)
    run_experiment(parse_config(tiny_config(**{"method": {"name": "finetune"}, "scenario.n_tasks": 1,
                                               "scenario.classes_per_task": [2]})), tmp_path / "run")
    assert seen == [{"body": 1e-2, "head": 1e-2}]


def test_alignment_is_on_for_slca_only_and_the_user_can_switch_it_off():
    assert load_config(None, ["method.name=slca"]).head.align is True
    assert load_config(None, ["method.name=slca", "head.align=false"]).head.align is False
    assert load_config(None, ["method.name=finetune"]).head.align is False


def test_backbone_lr_scale_must_be_a_fraction():
    with pytest.raises(Exception, match="backbone_lr_scale"):
        load_config(None, ["method.name=slca", "method.backbone_lr_scale=0"])


def test_a_two_task_run_trains_backbone_and_head_and_predicts_with_the_aligned_head(tmp_path, monkeypatch):
    changes, real = [], run_mod.fit

    def fit(model, data, *, groups, **kw):
        before = [[p.detach().clone() for p in g["params"]] for g in groups]
        out = real(model, data, groups=groups, **kw)
        changes.append({g["name"]: any(not torch.equal(b, p) for b, p in zip(bs, g["params"]))
                        for g, bs in zip(groups, before)})
        return out

    monkeypatch.setattr(run_mod, "fit", fit)
    cfg, _ = _slca(tmp_path)
    assert changes == [{"body": True, "head": True}] * 2
    heads = json.loads((tmp_path / "run" / "metrics.json").read_text())["head"]
    assert heads["variant"] == "linear+align"
    assert heads["align_losses"][0] == [] and len(heads["align_losses"][1]) == cfg.head.align_epochs
