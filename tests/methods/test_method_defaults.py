"""A method owns its defaults (options, head, frozen backbone); the embedded default names what it runs.

Every registered method is covered (parametrised over the registry, so a new method is checked as it
lands): switching ``method.name`` on the embedded default gives that method's own defaults and a passing
dry run, and a 2-task run on digits changes what the method trains (simplecil / ranpac: nothing, backbone
unchanged, head statistics kept).
"""

from __future__ import annotations

import logging

import pytest
import torch
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.config import (EMBEDDED_DEFAULT, ConfigError, HeadConfig, OptimConfig, default_config, dump_config,
                            load_config, parse_config)
from clmerge.engine import run as run_mod
from clmerge.engine.checkpoint import load_checkpoint, load_head_tensors
from clmerge.engine.run import build_classifier, fresh_objects, run_experiment
from clmerge.methods import METHODS
from conftest import tiny_config

NAMES = sorted(METHODS)
STATISTICS = [n for n in NAMES if not METHODS[n].trains_linear_head]
FIRST_SESSION = {"aper", "aper_finetune", "ranpac"}  # adapt in the first task only, then train nothing
# (tests/methods/test_aper.py, test_aper_official.py, test_ranpac_official.py)
VIT3 = {"num_hidden_layers": 3, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}
# what a method needs to fit on the 1-layer tiny ViT of the 2-task runs (its defaults size the paper's ViT-B)
TINY = {
    "coda_prompt": {"method": {"name": "coda_prompt", "pool_size": 6, "length": 2, "layers": [0, 1]},
                    "model.config": VIT3},
    "dualprompt": {"method": {"name": "dualprompt", "g_layers": [0], "e_layers": [1, 2], "e_pool_size": 3,
                              "g_length": 2, "e_length": 2}, "model.config": VIT3},
    "hide_prompt": {"method": {"name": "hide_prompt", "layers": [0, 1], "length": 2, "tii_epochs": 1,
                               "tii_align_epochs": 1}, "model.config": VIT3},
    "lae": {"method": {"name": "lae", "adapt_blocks": [0]}},  # its default PET blocks 0-4 need 5 blocks
    # a replay buffer larger than the 160 training examples of the tiny scenario is refused
    **{name: {"method": {"name": name, "buffer_size": 100}} for name in ("er", "der", "derpp", "er_ace", "xder",
                                                                             "icarl")},
}


def test_the_embedded_default_is_random_projection_only_ranpac_with_its_own_head():
    cfg = default_config()
    assert EMBEDDED_DEFAULT == {"method": {"name": "ranpac_rp"}, "head": {"ranpac_dim": 2000}}
    assert (cfg.method.name, cfg.head.classifier, cfg.train.adapt_tasks) == ("ranpac_rp", "ranpac", None)
    assert cfg.head.ranpac_dim == 2000  # the width the head grid selected the pair at; the method's own is 10000
    assert load_config(None, ["method.name=ranpac_rp"]).head.ranpac_dim == 10000
    assert load_config(None, ["method.name=ranpac"]).method_options().first_session_adapt is True


@pytest.mark.parametrize("name", NAMES)
def test_switching_the_method_takes_only_that_methods_defaults(name):
    cfg = load_config(None, [f"method.name={name}"])
    cls = METHODS[name]
    assert cfg.method_options() == cls.Options()  # no option carried over from the default's method
    assert cfg.head == HeadConfig(**cls.head_defaults)  # the method's head, not the default's
    assert cfg.train.adapt_tasks is None  # no frozen backbone the method did not ask for
    assert cfg.optim == OptimConfig(**cls.optim_defaults)  # the method's own rate, the rest the section's


# methods that train nothing unless an option asks (no rate of their own: the optim section's defaults apply)
UNTRAINED = {"simplecil", "ranpac_rp"}


@pytest.mark.parametrize("name", NAMES)
def test_every_method_that_trains_owns_a_learning_rate_and_says_where_it_comes_from(name):
    cls = METHODS[name]
    if name in UNTRAINED:
        assert cls.optim_defaults == {} and cls.optim_source == ""
        return
    assert set(cls.optim_defaults) == {"lr"} and cls.optim_defaults["lr"] > 0
    assert cls.optim_source.startswith(("paper", "official code", "validation grid")), cls.optim_source


def test_the_embedded_default_keeps_the_optim_section_defaults():
    assert default_config().optim == OptimConfig()  # ranpac_rp trains nothing: its run does not change


def test_an_optim_key_the_user_sets_overrides_the_methods_rate(tmp_path):
    rate = METHODS["finetune"].optim_defaults["lr"]
    assert load_config(None, ["method.name=finetune"]).optim.lr == rate
    assert load_config(None, ["method.name=finetune", "optim.lr=0.005"]).optim.lr == 0.005
    # a config file is explicit too; one that sets other optim keys still gets the method's rate
    assert parse_config({"method": {"name": "finetune"}, "optim": {"lr": 1e-2}}).optim.lr == 1e-2
    other = parse_config({"method": {"name": "finetune"}, "optim": {"name": "sgd", "momentum": 0.5}}).optim
    assert (other.name, other.momentum, other.lr) == ("sgd", 0.5, rate)
    f = tmp_path / "c.yaml"
    f.write_text("method: {name: ewc}\noptim: {lr: 0.002}\n")
    assert load_config(f).optim.lr == 0.002
    assert load_config(f, ["method.name=magmax"]).optim.lr == 0.002
    f.write_text("method: {name: ewc}\n")
    assert load_config(f).optim.lr == METHODS["ewc"].optim_defaults["lr"]


def test_a_resolved_config_keeps_the_methods_rate_when_read_back(tmp_path):
    cfg = load_config(None, ["method.name=magmax"])
    f = tmp_path / "config.yaml"
    f.write_text(dump_config(cfg))
    assert load_config(f).optim == cfg.optim  # a resumed run trains at the rate it started with


def test_methods_verbose_shows_each_methods_rate_and_its_source():
    out = CliRunner().invoke(app, ["methods", "-v"]).output
    blocks, name = {}, None
    for line in out.splitlines():
        if line and not line.startswith(" "):
            name = line.split()[0]
        elif name is not None:
            blocks.setdefault(name, []).append(line.strip())
    for name in NAMES:
        optim = [line for line in blocks[name] if line.startswith("optim: ")]
        assert len(optim) == 1, (name, blocks[name])
        cls = METHODS[name]
        if cls.optim_defaults:
            assert optim[0] == f"optim: lr={cls.optim_defaults['lr']:g}; source: {cls.optim_source}"
        else:
            assert optim[0] == "optim: the optim section's defaults (no rate of its own)"


def test_a_head_key_the_user_sets_overrides_the_methods_head():
    assert load_config(None, ["method.name=simplecil"]).head.classifier == "ncm"
    assert load_config(None, ["method.name=simplecil", "head.classifier=ranpac"]).head.classifier == "ranpac"
    ncm = load_config(None, ["head.classifier=ncm", "head.ncm_metric=euclidean"]).head
    assert (ncm.classifier, ncm.ncm_metric) == ("ncm", "euclidean")
    head = parse_config({"method": {"name": "ranpac"}, "head": {"ranpac_dim": 64}}).head
    assert (head.classifier, head.ranpac_dim) == ("ranpac", 64)
    assert parse_config({"method": {"name": "inflora"}}).head.classifier == "linear"


@pytest.mark.parametrize("name", STATISTICS)
@pytest.mark.parametrize("key", ["head.classifier=linear", "head.compare=true"])
def test_a_statistics_method_refuses_the_linear_head_it_never_trains(name, key):
    with pytest.raises(ConfigError, match=rf"{key}: method '{name}' trains no linear head"):
        load_config(None, [f"method.name={name}", key])


def test_methods_lists_the_statistics_methods_and_seq_lora_targets_from_its_options():
    out = CliRunner().invoke(app, ["methods"]).output
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert {"simplecil", "ranpac", "ranpac_rp", "aper", "aper_finetune"} <= set(lines)
    targets = "/".join(load_config(None, ["method.name=seq_lora"]).method_options().targets)
    assert f"LoRA on {targets} " in lines["seq_lora"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_dry_run_of_every_method_on_the_embedded_default(name):
    r = CliRunner().invoke(app, ["run", "--set", f"method.name={name}", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert f"dry run ok: {name} on mnist5k" in r.output


def _fit_recorder(monkeypatch) -> list[dict]:
    """Wrap the engine's ``fit``: per call, whether each parameter group changed during it."""
    calls, real = [], run_mod.fit

    def fit(model, data, *, groups, **kw):
        before = [[p.detach().clone() for p in g["params"]] for g in groups]
        out = real(model, data, groups=groups, **kw)
        calls.append({g.get("name", "body"): any(not torch.equal(b, p) for b, p in zip(bs, g["params"]))
                      for g, bs in zip(groups, before)})
        return out

    monkeypatch.setattr(run_mod, "fit", fit)
    return calls


def _tiny(name: str, **kw):
    base = {"head.ranpac_dim": 64, "method": {"name": name}, "run.keep_checkpoints": 2}
    return parse_config(tiny_config(**{**base, **TINY.get(name, {}), **kw}))


# a statistics method whose own head predicts (evaluated as head.classifier=linear): it trains nothing after an
# optional first session (tests/methods/test_fecam.py checks that, and its kept statistics)
OWN_STATISTICS_HEAD = {"fecam"}


@pytest.mark.parametrize("name", [n for n in NAMES if n not in STATISTICS and n not in OWN_STATISTICS_HEAD])
def test_a_two_task_run_changes_what_the_method_trains(name, tmp_path, monkeypatch):
    calls = _fit_recorder(monkeypatch)
    run_experiment(_tiny(name), tmp_path / "run")
    assert len(calls) >= 2, calls  # one fit per task at least (inner fits of a method come on top)
    assert all(all(changed.values()) for changed in calls), calls
    assert any(set(c) - {"head"} for c in calls), f"{name} never trained a parameter outside the head"


@pytest.mark.parametrize("name", [n for n in STATISTICS if n not in FIRST_SESSION])
def test_a_statistics_method_trains_nothing_and_keeps_head_statistics(name, tmp_path, monkeypatch):
    calls = _fit_recorder(monkeypatch)
    cfg = _tiny(name)
    run_experiment(cfg, tmp_path / "run")
    assert calls == []
    ck = tmp_path / "run" / "checkpoints" / "task_001.safetensors"
    state, initial = load_checkpoint(ck)[0], build_classifier(cfg).state_dict()
    body = [k for k in initial if k.startswith("backbone.")]
    assert body and all(torch.equal(state[k], initial[k]) for k in body)
    heads = load_head_tensors(ck)
    assert sorted(k for k in heads if k.startswith("stats.mean.")) == [f"stats.mean.{c}" for c in range(4)]
    assert any(k.startswith("ranpac.") for k in heads) == (cfg.head.classifier == "ranpac")


def test_ranpac_first_session_adapt_trains_the_first_task_only(tmp_path, monkeypatch):
    calls = _fit_recorder(monkeypatch)
    cfg = _tiny("ranpac", method={"name": "ranpac", "variant": "lora", "rank": 2})
    run_experiment(cfg, tmp_path / "run")
    assert calls == [{"body": True, "head": True}]  # the first task only (head: the first-session cosine head)
    ck = tmp_path / "run" / "checkpoints"
    s0, s1 = (load_checkpoint(ck / f"task_00{t}.safetensors")[0] for t in (0, 1))
    initial = fresh_objects(cfg)[0].state_dict()  # after the method's setup: the LoRA-wrapped layers' names
    body = [k for k in initial if k.startswith("backbone.")]
    assert any(not torch.equal(s0[k], initial[k]) for k in body)  # the first task's LoRA is folded in
    assert all(torch.equal(s0[k], s1[k]) for k in s0 if k.startswith("backbone."))  # frozen afterwards


def _adapt_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "adapt_tasks" in r.getMessage()]


def test_a_method_that_trains_none_of_its_parameters_says_so_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="clmerge.engine"):
        run_experiment(_tiny("seq_lora", **{"train.adapt_tasks": 0}), tmp_path / "run")
    lines = _adapt_warnings(caplog)
    assert len(lines) == 1
    assert lines[0].startswith("warning: train.adapt_tasks=0: method 'seq_lora' trains none of its")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="clmerge.engine"):
        run_experiment(_tiny("seq_lora", **{"train.adapt_tasks": 1}), tmp_path / "fsa")
    assert _adapt_warnings(caplog) == []


def test_switching_away_from_the_embedded_default_drops_its_head_width_for_run_and_sweep():
    """The default job runs RanPAC's head at the grid's width 2000; naming a method (run --set, or a sweep's
    set/grid) gives that method its own defaults: the RanPAC methods at the official 10000."""
    from clmerge.sweep.grid import SweepSpec, base_data

    assert load_config(None, ["seed=3"]).head.ranpac_dim == 2000
    assert load_config(None, ["method.name=ranpac"]).head.ranpac_dim == 10000
    assert load_config(None, ["method.name=ranpac", "head.ranpac_dim=500"]).head.ranpac_dim == 500
    assert "head" not in base_data(SweepSpec(grid={"method.name": ["ranpac", "er"]}))
    assert base_data(SweepSpec(grid={"seed": [0, 1]}))["head"] == {"ranpac_dim": 2000}
