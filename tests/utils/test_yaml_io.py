"""The one YAML reader (clmerge.utils.yaml_io): alias bombs, deep nesting, recursive aliases and oversized
files are refused at once with one line; every other document loads exactly as PyYAML's safe loader reads it.
Also: messages that echo a huge value are clipped."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from clmerge.config import ConfigError, ConfigFileError, load_config, parse_config
from clmerge.utils.yaml_io import (MAX_YAML_NODES, YamlError, YamlLimitError, load_yaml, read_yaml)

REPO = Path(__file__).resolve().parents[2]


def bomb(levels: int = 9, width: int = 9) -> str:
    lines = ["a0: &a0 [" + ", ".join(["x"] * width) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_at_once():
    t0 = time.perf_counter()
    with pytest.raises(YamlLimitError, match="more than 100,000 YAML nodes once aliases are expanded"):
        load_yaml(bomb(), source="b.yaml")
    assert time.perf_counter() - t0 < 2.0


def test_the_node_count_includes_aliases_and_merge_keys():
    text = "base: &b {x: 1, y: 2}\nuse: {<<: *b, z: 3}\n"
    assert load_yaml(text) == yaml.safe_load(text)
    wide = "a: &a [" + ", ".join(["1"] * 99) + "]\nb: [" + ", ".join(["*a"] * 99) + "]\n"  # 10,000 expanded
    assert load_yaml(wide, max_nodes=20_000) == yaml.safe_load(wide)
    with pytest.raises(YamlLimitError):
        load_yaml(wide, max_nodes=9_000)


def test_deep_nesting_and_recursive_aliases_are_refused():
    with pytest.raises(YamlLimitError, match="deeper than 64"):
        load_yaml("[" * 50_000 + "]" * 50_000)
    with pytest.raises(YamlLimitError, match="deeper than 64"):
        load_yaml("a:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 80)) + "  " * 80 + "v: 1\n")
    with pytest.raises(YamlLimitError, match="recursive"):
        load_yaml("a: &a [1, *a]\n")
    assert load_yaml("- " * 60 + "x") == yaml.safe_load("- " * 60 + "x")


@pytest.mark.parametrize("text, words", [("a: [1, 2", "line 1"), ("a: *nope", "undefined alias"),
                                         ("a: 1\n---\nb: 2", "another document"),
                                         ("!!python/object:os.system {}", "constructor")])
def test_invalid_yaml_is_one_line_naming_the_source(text, words):
    with pytest.raises(YamlError) as info:
        load_yaml(text, source="f.yaml")
    msg = str(info.value)
    assert msg.startswith("f.yaml: not valid YAML") and words in msg and "\n" not in msg


def test_files_too_large_or_not_utf8_are_refused_without_reading_them_whole(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (2 << 20))
    with pytest.raises(YamlLimitError, match="larger than 1,048,576 bytes"):
        read_yaml(big)
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"a: \xff\xfe\n")
    with pytest.raises(YamlError, match="not UTF-8"):
        read_yaml(bad)


def test_every_shipped_yaml_loads_as_the_safe_loader_reads_it():
    files = sorted((REPO / "configs").rglob("*.yaml")) + sorted((REPO / "benchmarks").rglob("*.yaml"))
    assert files
    for f in files:
        assert load_yaml(f.read_text(), source=str(f)) == yaml.safe_load(f.read_text()), f


def test_config_recipe_and_set_bombs_are_clean_config_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("seed: 0\n" + bomb())
    with pytest.raises(ConfigFileError, match="c.yaml: more than"):
        load_config(path)
    value = "[&a [1,1,1,1,1,1,1,1,1,1], " + ", ".join(
        f"&a{i} [{', '.join(['*a' if i == 0 else f'*a{i - 1}'] * 10)}]" for i in range(6)) + "]"
    with pytest.raises(ConfigError, match="--set scenario.options: more than"):
        load_config(None, [f"scenario.options={value}"])
    with pytest.raises(ConfigError, match=r"optim.lr.*got '\[1, 2'"):  # not YAML: a string, a bad value
        load_config(None, ["optim.lr=[1, 2"])


def test_messages_that_echo_a_huge_value_are_clipped():
    huge = list(range(MAX_YAML_NODES - 10))
    with pytest.raises(ConfigError) as info:
        parse_config({"scenario": {"n_tasks": huge, "seed": huge, "kind": huge, "dataset": huge}})
    msg = str(info.value)
    assert len(msg) < 600 and "and 1 more" in msg and "scenario.n_tasks" in msg
    with pytest.raises(ConfigError) as info:
        parse_config({"x" * 100_000: 1})
    assert len(str(info.value)) < 2000


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="[]{}&*ab:,- \n'\"!#|>?<1.", max_size=80))
def test_any_text_loads_as_the_safe_loader_reads_it_or_is_a_clean_error(text):
    try:
        expected = yaml.safe_load(text)
    except yaml.YAMLError:
        with pytest.raises(YamlError):
            load_yaml(text)
        return
    try:
        got = load_yaml(text)
    except YamlLimitError:  # a recursive alias: refused here, a self-containing object there
        return
    assert got == expected
