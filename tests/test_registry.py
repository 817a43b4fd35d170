"""The generic name registry behind merges, methods, datasets, backbones and pretrain presets."""

from __future__ import annotations

import pytest

from clmerge.errors import UsageError
from clmerge.registry import Registry, UnknownNameError


def _reg() -> Registry:
    reg = Registry("widget", key="model.widget")
    reg.register("alpha", lambda: 1, description="the first widget")

    @reg.register("beta")
    def beta():
        """The second widget.

        More text that is not part of the one-line description."""

    return reg


def test_register_get_and_protocol():
    reg = _reg()
    assert reg.get("alpha")() == 1 and reg["alpha"]() == 1
    assert "beta" in reg and "gamma" not in reg
    assert len(reg) == 2 and list(reg) == ["alpha", "beta"]
    assert reg.get("gamma", None) is None  # dict-style default
    assert reg.entry("beta").module == __name__


def test_available_sorted_with_one_line_descriptions():
    reg = Registry("widget")
    reg.register("zeta", object(), description="last")
    reg.register("alpha", object(), description="first\nsecond line")
    assert reg.available() == {"alpha": "first", "zeta": "last"}
    assert list(reg.available()) == ["alpha", "zeta"]


def test_unknown_name_is_usage_error_with_did_you_mean():
    reg = _reg()
    with pytest.raises(UsageError, match=r"^model.widget: unknown widget 'alpah' \(did you mean 'alpha'\?\); "
                                         r"known: alpha, beta$") as info:
        reg.get("alpah")
    assert info.value.exit_code == 2
    assert isinstance(info.value, KeyError)  # older `except KeyError` callers keep working
    with pytest.raises(UnknownNameError, match=r"unknown widget 'zzz'; known: alpha, beta$"):
        reg["zzz"]


def test_duplicate_name_names_the_first_module():
    reg = _reg()
    with pytest.raises(ValueError, match=rf"widget 'alpha' is already registered \(by {__name__}\)"):
        reg.register("alpha", object(), module="somewhere.else")
    assert reg.entry("alpha").description == "the first widget"  # the first registration is kept


@pytest.mark.parametrize("module, name, attr", [
    ("clmerge.merging.methods.registry", "MERGES", "ties"),
    ("clmerge.methods", "METHODS", "seq_lora"),
    ("clmerge.data.base", "DATASETS", "mnist5k"),
    ("clmerge.models.backbones", "BACKBONES", "vit-tiny-fmnist"),
    ("clmerge.pretrain", "PRESETS", "vit-tiny-fmnist"),
])
def test_project_registries_are_registries(module, name, attr):
    import importlib

    import clmerge.data  # noqa: F401  (registers the datasets)
    import clmerge.models  # noqa: F401  (registers the backbones)

    reg = getattr(importlib.import_module(module), name)
    assert isinstance(reg, Registry) and attr in reg and reg.available()[attr]
    with pytest.raises(UsageError, match="did you mean"):
        reg.get(attr + "x")
