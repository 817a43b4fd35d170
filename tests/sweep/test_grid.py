"""Sweep specs: parsing, cell expansion and names, each cell's config (clmerge.sweep.grid)."""

from __future__ import annotations

import pytest
import yaml

from clmerge.config import ConfigError, ConfigFileError
from clmerge.sweep.grid import (Cell, SweepSpec, base_data, cell_config, cell_name, dotted_items, expand_cells,
                                load_spec, spec_from_dict)

from conftest import tiny_config


def test_cells_cross_the_grid_first_key_slowest_with_readable_unique_names():
    spec = spec_from_dict({"grid": {"method.name": ["seq_lora", "pm", "sd_lora"], "seed": [0, 1]}})
    cells = expand_cells(spec)
    assert [c.name for c in cells] == ["seq_lora-seed0", "seq_lora-seed1", "pm-seed0", "pm-seed1",
                                       "sd_lora-seed0", "sd_lora-seed1"]
    assert cells[3].overrides == {"method.name": "pm", "seed": 1}


@pytest.mark.parametrize("overrides, name", [
    ({"optim.lr": 0.001}, "lr0.001"),
    ({"seed": 0, "scenario.seed": 2}, "seed0-scenario.seed2"),  # two keys ending in "seed": the whole key
    ({"head.compare": True}, "comparetrue"),
    ({"scenario.classes_per_task": [2, 3]}, "classes_per_task2_3"),
    # not a safe folder name: its safe characters and a hash of the whole name (outpaths.slug)
    ({"scenario.data_root": "../x y"}, "data_root.._x_y-h62923e728b80"),
    ({}, "base"),
])
def test_cell_names(overrides, name):
    assert cell_name(overrides) == name


def test_cells_that_would_share_a_folder_are_refused():
    with pytest.raises(ConfigError, match="share the folder"):
        expand_cells(spec_from_dict({"grid": {"head.compare": [True, "true"]}}))
    # values that differ only in unsafe characters get distinct hashed names
    names = [c.name for c in expand_cells(spec_from_dict({"grid": {"scenario.data_root": ["a/b", "a b"]}}))]
    assert len(set(names)) == 2 and all(n.startswith("data_roota_b-h") for n in names)


@pytest.mark.parametrize("data, words", [
    ({"grids": {"seed": [0]}}, ["grids", "base, set, grid"]),
    ({"grid": {"seed": 0}}, ["grid.seed", "list"]),
    ({"grid": {"seed": []}}, ["grid.seed", "non-empty"]),
    ({"grid": {"seed": [0, 0]}}, ["grid.seed", "twice"]),
    ({"grid": ["seed"]}, ["grid", "mapping"]),
    ({"set": {"seed": 1}, "grid": {"seed": [0, 1]}}, ["seed", "both"]),
    ({"set": {"optim..lr": 1}}, ["optim..lr", "dotted"]),
    ({"base": 3}, ["base"]),
])
def test_spec_errors_name_the_key(data, words):
    with pytest.raises(ConfigError) as info:
        spec_from_dict(data)
    for w in words:
        assert w in str(info.value)


def test_load_spec_reads_yaml_and_a_missing_file_is_an_input_error(tmp_path):
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({"set": {"train.epochs": 1}, "grid": {"seed": [0, 1]}}))
    spec = load_spec(tmp_path / "s.yaml")
    assert spec == SweepSpec(base=None, set={"train.epochs": 1}, grid={"seed": [0, 1]})
    with pytest.raises(ConfigFileError, match="nope.yaml"):
        load_spec(tmp_path / "nope.yaml")


def test_a_cells_config_is_base_then_set_then_its_grid_values(tmp_path):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(tiny_config()))
    spec = spec_from_dict({"base": str(tmp_path / "base.yaml"), "set": {"optim.lr": 0.5, "train.epochs": 1},
                           "grid": {"seed": [3]}})
    data, cfg = cell_config(base_data(spec), expand_cells(spec)[0])
    assert (cfg.seed, cfg.optim.lr, cfg.train.epochs, cfg.method.name) == (3, 0.5, 1, "seq_lora")
    assert data["optim"]["lr"] == 0.5 and data["scenario"]["dataset"] == "digits"


def test_no_base_is_the_embedded_default_and_a_bad_cell_is_named():
    spec = spec_from_dict({"grid": {"optim.lr": [0.1, "abc"]}})
    base = base_data(spec)
    assert cell_config(base, expand_cells(spec)[0])[1].method.name == "ranpac_rp"
    with pytest.raises(ConfigError, match="cell lrabc: .*optim.lr"):
        cell_config(base, Cell("lrabc", {"optim.lr": "abc"}))


def test_dotted_items_flattens_nested_overrides():
    assert dotted_items({"optim": {"lr": 0.1}, "seed": 2, "x": {}}) == {"optim.lr": 0.1, "seed": 2, "x": {}}
