"""Property-based tests (Hypothesis) of config parsing: ``--set`` overrides, YAML files and ``validate_strict``
with random dotted keys, values and nesting. Whatever the input, the result is a config or a ConfigError /
UsageError whose message names the offending key — never another exception."""

from __future__ import annotations

import math
import os

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from clmerge.config import ConfigError, ExperimentConfig, OptimConfig, load_config, validate_strict
from clmerge.errors import UsageError

CLEAN = (ConfigError, UsageError)
EXAMPLES = int(os.environ.get("CLMERGE_FUZZ_EXAMPLES", "80"))  # e.g. 5000 for a long hunt
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _leaves(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for key, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _leaves(ann, f"{prefix}{key}.")
        else:
            out.append(prefix + key)
    return out


VALID_KEYS = _leaves(ExperimentConfig) + ["method.rank", "method.targets", "method.lora_alpha", "method.fold"]
SECTIONS = sorted({k.split(".")[0] for k in VALID_KEYS})
segment = st.one_of(st.sampled_from(SECTIONS + [k.split(".")[-1] for k in VALID_KEYS]),
                    st.text(alphabet="abcdefghijklmnopqrstuvwxyz_-0123456789 ", max_size=8))
dotted_key = st.one_of(st.sampled_from(VALID_KEYS),
                       st.lists(segment, min_size=1, max_size=4).map(".".join))
scalar = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
value = st.recursive(scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                     max_leaves=6)
value_text = st.one_of(value.map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...")
                                 .strip()),
                       st.sampled_from(["nan", "inf", "-inf", ".nan", "1e-3", "[1, 2", "{a: 1", "'x", "null", ""]),
                       st.text(max_size=10))


def _names_a_prefix(message: str, key: str) -> bool:
    """The message names the key: the whole dotted key or one of its leading parts (a bad section)."""
    parts = key.strip().split(".")
    return any(".".join(parts[:i]) in message for i in range(1, len(parts) + 1))


@FUZZ
@given(key=dotted_key, text=value_text)
def test_a_set_override_is_a_config_or_a_clean_error_naming_its_key(key: str, text: str) -> None:
    try:
        cfg = load_config(None, [f"{key}={text}"])
    except CLEAN as exc:
        msg = str(exc)
        assert msg and _names_a_prefix(msg, key), (key, text, msg)
        if key in VALID_KEYS:  # a known key with a bad value: the message names the whole dotted key
            assert key in msg, (key, text, msg)
        assert "Traceback" not in msg
    else:
        assert isinstance(cfg, ExperimentConfig)


@FUZZ
@given(items=st.lists(st.tuples(dotted_key, value_text), min_size=1, max_size=4))
def test_many_overrides_never_crash(items: list[tuple[str, str]]) -> None:
    try:
        load_config(None, [f"{k}={v}" for k, v in items])
    except CLEAN as exc:
        assert str(exc)


@FUZZ
@given(item=st.text(max_size=20).filter(lambda s: "=" not in s))
def test_an_override_without_equals_is_named(item: str) -> None:
    with pytest.raises(CLEAN, match="--set"):
        load_config(None, [item])


mapping_key = st.one_of(st.sampled_from(SECTIONS), segment, st.integers(-3, 3), st.booleans(), st.none())
nested = st.recursive(
    st.dictionaries(mapping_key, value, max_size=4),
    lambda inner: st.dictionaries(mapping_key, st.one_of(value, inner), max_size=4),
    max_leaves=10)


@FUZZ
@given(data=nested)
def test_validate_strict_on_random_nesting_is_clean(data: dict) -> None:
    try:
        validate_strict(ExperimentConfig, data)
    except CLEAN as exc:
        assert str(exc)


@FUZZ
@given(section=st.sampled_from(SECTIONS), data=st.dictionaries(mapping_key, value, max_size=4))
def test_a_random_section_names_its_section(section: str, data: dict) -> None:
    try:
        validate_strict(ExperimentConfig, {section: data})
    except CLEAN as exc:
        assert section in str(exc), (section, data, str(exc))


@FUZZ
@given(lr=st.floats(allow_nan=True, allow_infinity=True))
def test_every_float_learning_rate_is_accepted_or_named(lr: float) -> None:
    try:
        cfg = validate_strict(OptimConfig, {"lr": lr})
    except CLEAN as exc:
        assert "lr" in str(exc)
    else:
        assert math.isfinite(cfg.lr) and cfg.lr > 0


@settings(max_examples=EXAMPLES // 2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.one_of(st.text(max_size=60), nested.map(lambda d: yaml.safe_dump(d, allow_unicode=True))))
def test_a_random_yaml_file_is_a_config_or_a_clean_error(text: str, tmp_path_factory) -> None:
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        load_config(path)
    except CLEAN as exc:
        assert str(exc)
