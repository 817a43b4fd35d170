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


# --- the config does not import the methods: they hand it their registry -----------------------------------
def test_method_section_is_checked_against_the_installed_registry():
    """The config reads method classes through the registry ``clmerge.methods`` installs, whatever it holds."""
    from pydantic import BaseModel

    from clmerge import config
    from clmerge.methods import METHODS
    from clmerge.registry import Registry

    class Stub:
        class Options(BaseModel):
            width: int = 3

        head_defaults, trains_linear_head = {"classifier": "ncm"}, False

    stub = Registry("method", key="method.name")
    stub.register("stub", Stub, description="a stand-in")
    config.set_method_registry(stub)
    try:
        cfg = parse_config({"method": {"name": "stub", "width": 5}})
        assert cfg.method_options().width == 5 and cfg.head.classifier == "ncm"
        with pytest.raises(ConfigError, match="'method.depth' for method 'stub'"):
            parse_config({"method": {"name": "stub", "depth": 1}})
        with pytest.raises(ConfigError, match="unknown method 'seq_lora'"):
            parse_config({"method": {"name": "seq_lora"}})
    finally:
        config.set_method_registry(METHODS)


def test_config_alone_imports_the_methods_only_when_it_checks_a_method():
    """Importing the config imports no method; the first check of a ``method:`` section finds them through the
    provider the package's face names (clmerge.registry), so no import has to come first."""
    import subprocess
    import sys

    code = ("import sys\nfrom clmerge.config import parse_config\n"
            "print('clmerge.methods' in sys.modules)\n"
            "print(parse_config({'method': {'name': 'seq_lora'}}).method.name)\n"
            "print('clmerge.methods' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "seq_lora", "True"]


def test_without_a_provider_the_config_says_what_is_missing(monkeypatch):
    from clmerge import config, registry

    monkeypatch.setattr(config, "_method_registry", [])
    monkeypatch.setattr(registry, "_PROVIDERS", {})
    with pytest.raises(RuntimeError, match="import clmerge.methods"):
        parse_config({})


def test_a_shipped_config_is_found_by_name_by_the_config_layer_alone():
    """``load_config(NAME)`` resolves the shipped config without importing the higher ``paper_configs``."""
    import subprocess
    import sys

    code = ("import sys\nimport clmerge.methods\nfrom clmerge.config import load_config\n"
            "cfg = load_config('halrp_cifar100_split_lenet')\n"
            "print(cfg.method.name, 'clmerge.paper_configs' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["halrp", "False"]
