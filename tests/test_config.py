import pytest

from clmerge.config import ConfigError, apply_overrides, dump_config, load_config, parse_config


def test_default_config_is_the_documented_default():
    cfg = parse_config({})
    assert (cfg.scenario.dataset, cfg.scenario.n_tasks, cfg.scenario.kind) == ("mnist5k", 5, "class_incremental")
    assert cfg.model.name == "vit-tiny-fmnist"


def test_unknown_key_names_nearest():
    with pytest.raises(ConfigError, match=r"'scenario.n_task'.*did you mean 'n_tasks'"):
        parse_config({"scenario": {"n_task": 3}})
    with pytest.raises(ConfigError, match=r"unknown config key 'sceanrio'.*'scenario'"):
        parse_config({"sceanrio": {}})


def test_method_options_checked_against_the_method():
    with pytest.raises(ConfigError, match=r"method.rnak.*did you mean 'rank'"):
        parse_config({"method": {"name": "seq_lora", "rnak": 4}})
    with pytest.raises(ConfigError, match="unknown method 'seq_lroa'.*seq_lora"):
        parse_config({"method": {"name": "seq_lroa"}})
    with pytest.raises(ConfigError, match="method.rank"):
        parse_config({"method": {"name": "seq_lora", "rank": 0}})


def test_types_and_ranges():
    with pytest.raises(ConfigError, match="scenario.n_tasks"):
        parse_config({"scenario": {"n_tasks": 0}})
    with pytest.raises(ConfigError, match="optim.lr"):
        parse_config({"optim": {"lr": -1}})
    with pytest.raises(ConfigError, match="scenario.kind"):
        parse_config({"scenario": {"kind": "class-incremental"}})
    with pytest.raises(ConfigError, match="classes_per_task has 2 entries"):
        parse_config({"scenario": {"n_tasks": 3, "classes_per_task": [2, 2]}})
    with pytest.raises(ConfigError, match="domain_incremental needs scenario.transform"):
        parse_config({"scenario": {"kind": "domain_incremental"}})


def test_overrides_and_yaml(tmp_path):
    d = apply_overrides({}, ["optim.lr=1e-3", "scenario.class_order=[1,0]", "method.name=ewc", "run.threads=null"])
    assert d == {"optim": {"lr": 1e-3}, "scenario": {"class_order": [1, 0]}, "method": {"name": "ewc"},
                 "run": {"threads": None}}
    p = tmp_path / "c.yaml"
    p.write_text("scenario:\n  dataset: digits\nmethod:\n  name: seq_lora\n  rank: 4\n")
    cfg = load_config(p, ["seed=3"])
    assert cfg.seed == 3 and cfg.method_options().rank == 4
    text = dump_config(cfg)
    p2 = tmp_path / "resolved.yaml"
    p2.write_text(text)
    assert dump_config(load_config(p2)) == text  # the resolved config is a fixed point
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        apply_overrides({}, ["optim.lr"])
