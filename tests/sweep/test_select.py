"""A sweep's ``select:`` block (clmerge.sweep.select): a key chosen on validation before the grid's cells run.

The selection logic runs on a fake cell runner that writes planted scores (validation and test disagree, so a
choice that read test metrics would differ); one small real sweep on digits checks the whole path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.config import ConfigError
from clmerge.errors import RunStateError
from clmerge.sweep import runner
from clmerge.sweep.grid import expand_cells, spec_from_dict
from clmerge.sweep.select import next_value, pick_best, val_score
from clmerge.sweep.select_spec import SelectSpec

from conftest import tiny_config

LRS = [1e-3, 3e-3, 1e-2]


class FakeCells:
    """Stands in for ``runner.run_cell``: writes metrics.json with a planted validation score (``val``) and a
    test accuracy that ranks the values the other way round; records every cell it ran."""

    def __init__(self, val):
        self.val, self.ran = val, []

    def __call__(self, data: dict, out: str, resume: bool) -> dict:
        lr, method, seed = data["optim"]["lr"], data["method"]["name"], data["seed"]
        v = self.val(lr, method, seed)
        metrics = {"acc": 100.0 - v, "head": {"val_acc": v}, "lr": lr, "seed": seed,
                   "scenario_seed": data["scenario"]["seed"]}
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "metrics.json").write_text(json.dumps(metrics))
        inside = Path(out).parents[1] if Path(out).parent.name == "select" else Path(out).parent
        self.ran.append(Path(out).relative_to(inside).as_posix())
        return metrics


def _spec(tmp_path: Path, **select) -> dict:
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_config(**{"scenario.val_fraction": 0.2})))
    return {"base": str(tmp_path / "tiny.yaml"), "grid": {"method.name": ["seq_lora", "pm"], "seed": [0, 1]},
            "select": {"key": "optim.lr", "values": list(LRS), **select}}


def _run(tmp_path, monkeypatch, val, resume=False, **select):
    fake = FakeCells(val)
    monkeypatch.setattr(runner, "run_cell", fake)
    spec = spec_from_dict(_spec(tmp_path, **select))
    status = runner.run_sweep(spec, tmp_path / "sw", resume=resume, log=lambda _: None)
    return fake, status, json.loads((tmp_path / "sw" / "selected.json").read_text())


def _cell_lrs(tmp_path) -> dict:
    cells = json.loads((tmp_path / "sw" / "cells.json").read_text())
    return {name: c["overrides"]["optim.lr"] for name, c in cells.items()}


def test_the_value_with_the_best_validation_score_is_chosen_never_the_best_test_score(tmp_path, monkeypatch):
    fake, status, sel = _run(tmp_path, monkeypatch, lambda lr, m, s: {1e-3: 50, 3e-3: 70, 1e-2: 60}[lr])
    assert sel["groups"]["all"]["value"] == 3e-3  # the test accuracy (100 - val) would pick 1e-3
    assert [r["val_acc"] for r in sel["groups"]["all"]["scores"]] == [50, 70, 60]
    assert sel["split"] == "val" and sel["seeds"] == [0]  # default: the grid's first seed
    assert _cell_lrs(tmp_path) == {c: 3e-3 for c in ["seq_lora-seed0", "seq_lora-seed1", "pm-seed0", "pm-seed1"]}
    assert set(status.values()) == {"done"}
    # selection: every method at every rate, seed 0 only (no per: both methods score each rate together)
    assert sorted(r for r in fake.ran if r.startswith("select/")) == sorted(
        f"select/{m}-seed0-lr{lr:g}" for m in ["seq_lora", "pm"] for lr in LRS)


def test_the_score_is_the_mean_over_the_cells_of_a_group_and_groups_choose_apart(tmp_path, monkeypatch):
    def val(lr, method, seed):  # seq_lora: 3e-3 best on average over seeds 0 and 1 (seed 0 alone: 1e-2); pm: 1e-2
        if method == "pm":
            return {1e-3: 10, 3e-3: 20, 1e-2: 30}[lr]
        return {(1e-3, 0): 30, (1e-3, 1): 30, (3e-3, 0): 60, (3e-3, 1): 40, (1e-2, 0): 80, (1e-2, 1): 0}[lr, seed]

    _, _, sel = _run(tmp_path, monkeypatch, val, per=["method.name"], seeds=[0, 1])
    assert {g: r["value"] for g, r in sel["groups"].items()} == {"seq_lora": 3e-3, "pm": 1e-2}
    assert sel["groups"]["seq_lora"]["scores"][1]["val_acc"] == 50
    assert sel["groups"]["pm"]["at_edge"] and not sel["groups"]["seq_lora"]["at_edge"]  # extend 0: no step
    assert _cell_lrs(tmp_path) == {"seq_lora-seed0": 3e-3, "seq_lora-seed1": 3e-3, "pm-seed0": 1e-2,
                                   "pm-seed1": 1e-2}


def test_a_choice_at_the_top_edge_extends_by_the_grid_step_and_stops_after_extend(tmp_path, monkeypatch):
    fake, _, sel = _run(tmp_path, monkeypatch, lambda lr, m, s: lr * 1000, extend=2)  # larger is always better
    rec = sel["groups"]["all"]
    assert rec["extended"] == [3e-2, 1e-1] and rec["value"] == 1e-1 and rec["at_edge"]
    assert [r["value"] for r in rec["scores"]] == [1e-3, 3e-3, 1e-2, 3e-2, 1e-1]
    assert not any("lr0.3" in r for r in fake.ran)  # a third step is not taken


def test_a_choice_at_the_bottom_edge_extends_down_and_an_interior_one_stops(tmp_path, monkeypatch):
    val = lambda lr, m, s: {1e-3: 50, 3e-3: 40, 1e-2: 30, 3e-4: 60, 1e-4: 55}[lr]  # noqa: E731
    _, _, sel = _run(tmp_path, monkeypatch, val, extend=3)
    rec = sel["groups"]["all"]
    assert rec["extended"] == [3e-4, 1e-4] and rec["value"] == 3e-4 and not rec["at_edge"]


def test_a_resumed_sweep_skips_finished_selection_cells_and_keeps_its_choice(tmp_path, monkeypatch):
    val = lambda lr, m, s: {1e-3: 50, 3e-3: 70, 1e-2: 60}[lr]  # noqa: E731
    _run(tmp_path, monkeypatch, val)
    (tmp_path / "sw" / "pm-seed1" / "metrics.json").unlink()  # one grid cell left to run
    fake, status, sel = _run(tmp_path, monkeypatch, val, resume=True)
    assert fake.ran == ["pm-seed1"] and sel["groups"]["all"]["value"] == 3e-3
    assert set(status.values()) == {"done"}


def test_a_resume_whose_selection_disagrees_with_selected_json_is_refused(tmp_path, monkeypatch):
    val = lambda lr, m, s: {1e-3: 50, 3e-3: 70, 1e-2: 60}[lr]  # noqa: E731
    _run(tmp_path, monkeypatch, val)
    sel_file = tmp_path / "sw" / "selected.json"
    doc = json.loads(sel_file.read_text())
    doc["groups"]["all"]["value"] = 1e-2
    sel_file.write_text(json.dumps(doc))
    with pytest.raises(RunStateError, match="selected.json: all chose 0.01"):
        _run(tmp_path, monkeypatch, val, resume=True)


def test_a_resume_with_another_select_block_is_refused(tmp_path, monkeypatch):
    val = lambda lr, m, s: 1.0  # noqa: E731
    _run(tmp_path, monkeypatch, val)
    with pytest.raises(RunStateError, match="select differs"):
        _run(tmp_path, monkeypatch, val, resume=True, extend=1)


def test_the_grid_cell_at_the_chosen_value_and_selection_seed_is_a_copy_of_the_selection_run(tmp_path, monkeypatch):
    fake, _, _ = _run(tmp_path, monkeypatch, lambda lr, m, s: {1e-3: 50, 3e-3: 70, 1e-2: 60}[lr])
    assert "seq_lora-seed0" not in fake.ran and "seq_lora-seed1" in fake.ran
    copied = json.loads((tmp_path / "sw" / "seq_lora-seed0" / "metrics.json").read_text())
    assert copied == json.loads((tmp_path / "sw" / "select" / "seq_lora-seed0-lr0.003" / "metrics.json").read_text())


def test_a_selection_without_a_validation_split_is_refused_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "run_cell", FakeCells(lambda *a: 1.0))
    data = _spec(tmp_path)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_config()))  # val_fraction 0
    with pytest.raises(ConfigError, match="scenario.val_fraction"):
        runner.run_sweep(spec_from_dict(data), tmp_path / "sw", log=lambda _: None)
    assert not (tmp_path / "sw").exists()


def test_the_score_reads_the_validation_accuracy_only():
    assert val_score({"acc": 90.0, "head": {"val_acc": 12.5}}) == 12.5
    assert val_score({"acc": 90.0, "til": {"acc": 99.0}}) is None


@pytest.mark.parametrize("values, tried, best, nxt", [
    (LRS, LRS, 1e-2, 3e-2), (LRS, LRS + [3e-2], 3e-2, 1e-1),  # sqrt(10) per step, one significant digit
    (LRS, LRS, 1e-3, 3e-4), (LRS, LRS + [3e-4], 3e-4, 1e-4),
    (LRS, LRS, 3e-3, None),  # interior: no step
    ([1e-4, 3e-4, 1e-3], [1e-4, 3e-4, 1e-3, 3e-5], 3e-5, 1e-5),  # MagMax's 3e-5 then 1e-5 in the evidence grid
    ([4, 8, 16], [4, 8, 16], 16, 32),  # integers stay integers
])
def test_next_value_steps_past_an_edge_by_the_grids_geometric_step(values, tried, best, nxt):
    assert next_value(SelectSpec("optim.lr", values, extend=2), tried, best) == nxt


def test_a_tie_goes_to_the_smaller_number_or_the_value_listed_first():
    assert pick_best({1e-3: 5.0, 1e-2: 5.0}, [1e-2, 1e-3]) == 1e-3
    assert pick_best({"b": 5.0, "a": 5.0}, ["b", "a"]) == "b"


def test_yaml_numbers_without_a_dot_are_numbers_and_seeds_default_to_the_grids_first():
    spec = spec_from_dict(yaml.safe_load("grid: {seed: [3, 4]}\nselect: {key: optim.lr, values: [1e-4, 3e-4]}"))
    assert spec.select.values == [1e-4, 3e-4] and spec.select.seeds == [3]


def test_link_makes_a_key_follow_a_grid_key_in_every_cell():
    spec = spec_from_dict({"grid": {"seed": [0, 1]}, "link": {"scenario.seed": "seed"}})
    assert [(c.name, c.overrides) for c in expand_cells(spec)] == [
        ("seed0", {"seed": 0, "scenario.seed": 0}), ("seed1", {"seed": 1, "scenario.seed": 1})]


def test_dry_run_lists_the_selection_cells_then_the_grid_with_the_key_chosen_on_validation(tmp_path, monkeypatch):
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(_spec(tmp_path, per=["method.name"])))
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["sweep", "spec.yaml", "--dry-run"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0].startswith("phase 1, selection of optim.lr on validation")
    assert "select/seq_lora-seed0-lr0.001" in lines[1] and "optim.lr=0.001" in lines[1]
    phase2 = lines.index("phase 2, the grid with the optim.lr chosen on validation:")
    assert phase2 == 7 and "optim.lr=(chosen on validation)" in lines[8]
    assert lines[-1] == "6 selection cells + 4 cells; every config is valid"
    assert not (tmp_path / "sw").exists()


def test_a_real_selection_sweep_on_digits_and_its_results_column(tmp_path, monkeypatch):
    """Two rates on tiny digits runs: the choice is the better validation score of the two selection runs,
    the grid's seed-0 cell is that run, seed 1 runs at it, and ``clmerge results`` shows the chosen rate."""
    cfg = tiny_config(**{"scenario.val_fraction": 0.25, "train.epochs": 1})
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({
        "base": "tiny.yaml", "grid": {"seed": [0, 1]}, "link": {"scenario.seed": "seed"},
        "select": {"key": "optim.lr", "values": [1e-3, 3e-2]}}))
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["sweep", "spec.yaml", "--out", "sw"])
    assert res.exit_code == 0, res.output
    sel = json.loads((tmp_path / "sw/selected.json").read_text())["groups"]["all"]
    val = {lr: json.loads((tmp_path / f"sw/select/seed0-lr{lr:g}/metrics.json").read_text())["head"]["val_acc"]
           for lr in (1e-3, 3e-2)}
    assert [r["val_acc"] for r in sel["scores"]] == [val[1e-3], val[3e-2]]
    assert sel["value"] == pick_best(val, [1e-3, 3e-2])
    runs = {s: yaml.safe_load((tmp_path / f"sw/seed{s}/config.yaml").read_text()) for s in (0, 1)}
    assert [runs[s]["optim"]["lr"] for s in (0, 1)] == [sel["value"]] * 2
    assert [runs[s]["scenario"]["seed"] for s in (0, 1)] == [0, 1]
    chosen = tmp_path / f"sw/select/seed0-lr{sel['value']:g}/metrics.json"
    assert json.loads((tmp_path / "sw/seed0/metrics.json").read_text()) == json.loads(chosen.read_text())
    table = CliRunner().invoke(app, ["results", "sw", "--by", "method.name", "--format", "csv"])
    assert table.exit_code == 0, table.output
    head, row = table.stdout.splitlines()[:2]
    assert head.split(",")[:3] == ["method.name", "runs", "optim.lr (val-selected)"]
    assert row.split(",")[:3] == ["seq_lora", "2", f"{sel['value']:g}"]
