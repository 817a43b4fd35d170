"""The input boundary and the output guard for the commands that read folders of runs: ``report``,
``results`` and ``sweep``.

Each case builds tiny fake run directories (config.yaml, metrics.json, events.jsonl, manifest.json) or a sweep
folder by hand, runs the CLI in process, and checks the exit code (docs/cli_errors.md: 2 usage, 3 input,
5 output), the words of the message and that nothing was written where it must not be. A symlinked run
directory inside a folder of runs is skipped with a warning naming it, as git treats a symlink to a folder
(it records the link, never descends into it); a file read from a run directory must resolve inside it.
Sweeps run with ``--dry-run`` where they can; a case that needs cells run replaces the training of a cell with
a stub that writes a ``metrics.json`` where it was told to.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import yaml
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.sweep.grid import spec_from_dict
from clmerge.utils.outpaths import MAX_NAME

from conftest import tiny_config
from report_helpers import write_matrix_run, write_run, write_seed_run

OK, USAGE, INPUT, OUTPUT = 0, 2, 3, 5
R2 = [[90.0, None], [80.0, 85.0]]


@pytest.fixture()
def ws(tmp_path, monkeypatch):
    """An empty workspace (the cwd) with a folder ``elsewhere`` that no command was handed."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_config()))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _stub_cells(monkeypatch) -> None:
    """A cell's run: its folder and a metrics.json in it (no training)."""
    def run_cell(data: dict, out: str, resume: bool) -> dict:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "metrics.json").write_text(json.dumps({"acc": 50.0}))
        return {"acc": 50.0}

    monkeypatch.setattr("clmerge.sweep.runner.run_cell", run_cell)


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): (p.stat().st_size if p.is_file() else -1) for p in root.rglob("*")}


# -- report -------------------------------------------------------------------------------------------------

def _report_symlinked_run(ws: Path) -> None:
    write_matrix_run(ws / "runs" / "a", "pm", 0, R2)
    write_matrix_run(ws / "elsewhere" / "run", "pm", 1, R2)
    (ws / "runs" / "b").symlink_to(ws / "elsewhere" / "run", target_is_directory=True)


def _report_page_not_in_link_target(ws: Path) -> None:
    assert not (ws / "elsewhere" / "run" / "report.html").exists()
    assert (ws / "runs" / "report.html").is_file() and (ws / "runs" / "a" / "report.html").is_file()


def _run_with_link(name: str, target_text: str) -> Callable[[Path], None]:
    def setup(ws: Path) -> None:
        write_run(ws / "run", {"accuracy_matrix": R2, "method": "pm"})
        (ws / "elsewhere" / "secret").write_text(target_text)
        (ws / "run" / name).unlink(missing_ok=True)
        (ws / "run" / name).symlink_to(ws / "elsewhere" / "secret")
    return setup


def _no_page(ws: Path) -> None:
    assert not (ws / "run" / "report.html").exists()


def _report_cases():
    events = json.dumps({"event": "epoch", "task": 0, "epoch": 0, "loss": 0.5}) + "\n"
    metrics = json.dumps({"accuracy_matrix": R2, "method": "pm"})
    return [
        ("report-symlinked-run-dir-skipped", _report_symlinked_run, ["report", "runs"], OK,
         ["warning", "runs/b", "symlink"], _report_page_not_in_link_target),
        ("report-events-symlink-out", _run_with_link("events.jsonl", events), ["report", "run"], INPUT,
         ["events.jsonl", "outside"], _no_page),
        ("report-metrics-symlink-out", _run_with_link("metrics.json", metrics), ["report", "run"], INPUT,
         ["metrics.json", "outside"], _no_page),
        ("report-config-symlink-out", _run_with_link("config.yaml", "password: hunter2\n"), ["report", "run"],
         INPUT, ["config.yaml", "outside"], _no_page),
    ]


# -- results ------------------------------------------------------------------------------------------------

def _two_runs(ws: Path) -> None:
    write_seed_run(ws / "runs" / "s0", "pm", 0, 80.0, til_acc=90.0)
    write_seed_run(ws / "runs" / "s1", "pm", 1, 82.0, til_acc=91.0)


def _results_metrics_symlink(ws: Path) -> None:
    _two_runs(ws)
    (ws / "elsewhere" / "metrics.json").write_text(json.dumps({"acc": 99.0}))
    (ws / "runs" / "s1" / "metrics.json").unlink()
    (ws / "runs" / "s1" / "metrics.json").symlink_to(ws / "elsewhere" / "metrics.json")


def _results_config_symlink(ws: Path) -> None:
    _two_runs(ws)
    (ws / "elsewhere" / "c.yaml").write_text((ws / "runs" / "s1" / "config.yaml").read_text())
    (ws / "runs" / "s1" / "config.yaml").unlink()
    (ws / "runs" / "s1" / "config.yaml").symlink_to(ws / "elsewhere" / "c.yaml")


def _results_metrics_symlink_inside(ws: Path) -> None:
    _two_runs(ws)
    (ws / "runs" / "s1" / "metrics.json").rename(ws / "runs" / "s1" / "metrics.v1.json")
    (ws / "runs" / "s1" / "metrics.json").symlink_to("metrics.v1.json")


def _results_symlinked_run(ws: Path) -> None:
    _two_runs(ws)
    write_seed_run(ws / "elsewhere" / "run", "pm", 7, 10.0, til_acc=10.0)
    (ws / "runs" / "s7").symlink_to(ws / "elsewhere" / "run", target_is_directory=True)


def _results_self_link(ws: Path) -> None:
    _two_runs(ws)
    (ws / "runs" / "loop").symlink_to(".", target_is_directory=True)


def _results_link_cycle(ws: Path) -> None:
    _two_runs(ws)
    (ws / "runs" / "la").symlink_to("lb")
    (ws / "runs" / "lb").symlink_to("la")


def _metrics_text(text: str) -> Callable[[Path], None]:
    def setup(ws: Path) -> None:
        _two_runs(ws)
        (ws / "runs" / "s1" / "metrics.json").write_text(text)
    return setup


def _huge(ws: Path) -> None:
    write_seed_run(ws / "runs" / "s0", "pm", 0, 1e308)
    write_seed_run(ws / "runs" / "s1", "pm", 1, 1.5e308)


def _results_cases():
    return [
        ("results-metrics-symlink-out", _results_metrics_symlink, ["results", "runs"], INPUT,
         ["metrics.json", "outside"], None),
        ("results-config-symlink-out", _results_config_symlink, ["results", "runs"], INPUT,
         ["config.yaml", "outside"], None),
        ("results-metrics-symlink-inside-is-read", _results_metrics_symlink_inside,
         ["results", "runs", "--metrics", "acc"], OK, [], "81.00 ± 1.00"),
        ("results-symlinked-run-dir-skipped", _results_symlinked_run, ["results", "runs", "--metrics", "acc"], OK,
         ["warning", "runs/s7", "symlink"], "81.00 ± 1.00"),
        ("results-self-link-loop-skipped", _results_self_link, ["results", "runs", "--metrics", "acc"], OK,
         ["warning", "runs/loop"], "81.00 ± 1.00"),
        ("results-link-cycle-skipped", _results_link_cycle, ["results", "runs", "--metrics", "acc"], OK,
         ["warning", "runs/la", "runs/lb"], "81.00 ± 1.00"),
        ("results-infinity", _metrics_text('{"acc": Infinity, "til": {"acc": 91.0}}'), ["results", "runs"], INPUT,
         ["runs/s1/metrics.json", "acc", "Infinity"], None),
        ("results-nan-in-til", _metrics_text('{"acc": 82.0, "til": {"acc": NaN}}'), ["results", "runs"], INPUT,
         ["runs/s1/metrics.json", "til.acc", "NaN"], None),
        ("results-minus-infinity-unused-key", _metrics_text('{"acc": 82.0, "bwt": -Infinity}'),
         ["results", "runs", "--metrics", "acc"], INPUT, ["runs/s1/metrics.json", "bwt", "-Infinity"], None),
        ("results-1e308-mean-overflows", _huge, ["results", "runs", "--metrics", "acc"], INPUT,
         ["acc", "not finite", "pm"], None),
    ]


# -- sweep --------------------------------------------------------------------------------------------------

def _spec(ws: Path, data: dict, name: str = "spec.yaml") -> None:
    (ws / name).write_text(yaml.safe_dump({"base": "tiny.yaml", **data}))


def _resume_symlinked_cell(ws: Path) -> None:
    data = {"base": "tiny.yaml", "grid": {"seed": [0, 1]}}
    _spec(ws, data)
    (ws / "out").mkdir()
    (ws / "out" / "sweep.yaml").write_text(yaml.safe_dump(spec_from_dict(data).as_dict(), sort_keys=False))
    (ws / "out" / "cells.json").write_text("{}")
    (ws / "out" / "seed0").symlink_to(ws / "elsewhere", target_is_directory=True)


def _elsewhere_untouched(ws: Path) -> None:
    assert list((ws / "elsewhere").iterdir()) == []


def _grid(**keys: list) -> Callable[[Path], None]:
    return lambda ws: _spec(ws, {"grid": keys})


def _million(ws: Path) -> None:
    _spec(ws, {"grid": {"seed": list(range(10)), "scenario.seed": list(range(10)),
                        "scenario.data_root": [f"d{i}" for i in range(10)], "model.name": [f"m{i}" for i in range(10)],
                        "optim.lr": [0.001 * (i + 1) for i in range(10)], "train.epochs": list(range(1, 11))}})


def _over_cap(ws: Path) -> None:
    _spec(ws, {"grid": {"seed": list(range(101)), "scenario.data_root": [f"d{i}" for i in range(100)]}})


def _nothing_written(ws: Path) -> None:
    assert not (ws / "out").exists()


def _cells_inside_out(ws: Path) -> None:
    """Every cell's run is a direct, real sub-folder of --out with a short name; none in --out or above."""
    cells = json.loads((ws / "out" / "cells.json").read_text())
    assert cells and not (ws / "metrics.json").exists() and not (ws / "out" / "metrics.json").exists()
    for name in cells:
        assert name not in (".", "..") and "/" not in name and len(name) <= MAX_NAME, name
        assert (ws / "out" / name).is_dir() and not (ws / "out" / name).is_symlink()
        assert (ws / "out" / name / "metrics.json").is_file()


def _sweep_cases():
    return [
        ("sweep-resume-symlinked-cell", _resume_symlinked_cell, ["sweep", "spec.yaml", "--out", "out", "--resume"],
         OUTPUT, ["seed0", "symlink"], _elsewhere_untouched),
        ("sweep-cell-dotdot-and-dot", _grid(**{"model.name": ["..", ".", "vit-tiny-fmnist"]}),
         ["sweep", "spec.yaml", "--out", "out"], OK, [], _cells_inside_out),
        ("sweep-cell-value-too-long", _grid(**{"scenario.data_root": ["x" * 300, "y" * 300]}),
         ["sweep", "spec.yaml", "--out", "out"], OK, [], _cells_inside_out),
        ("sweep-grid-over-cap-dry-run", _over_cap, ["sweep", "spec.yaml", "--dry-run"], USAGE,
         ["10,100 cells", "10,000", "seed (101)", "scenario.data_root (100)", "--max-cells"], None),
        ("sweep-grid-over-cap-run", _over_cap, ["sweep", "spec.yaml", "--out", "out"], USAGE,
         ["10,100 cells", "--max-cells"], _nothing_written),
        ("sweep-grid-million", _million, ["sweep", "spec.yaml", "--out", "out"], USAGE,
         ["1,000,000 cells", "10,000", "train.epochs (10)"], _nothing_written),
        ("sweep-grid-over-raised-cap", _over_cap, ["sweep", "spec.yaml", "--dry-run", "--max-cells", "10000"],
         USAGE, ["10,100 cells", "10,000"], None),
        ("sweep-empty-file", lambda ws: (ws / "spec.yaml").write_text(""), ["sweep", "spec.yaml", "--out", "out"],
         USAGE, ["spec.yaml", "grid"], _nothing_written),
        ("sweep-no-grid", lambda ws: _spec(ws, {"set": {"seed": 3}}), ["sweep", "spec.yaml", "--dry-run"],
         USAGE, ["spec.yaml", "grid"], None),
        ("sweep-empty-grid", lambda ws: _spec(ws, {"grid": {}}), ["sweep", "spec.yaml", "--out", "out"],
         USAGE, ["spec.yaml", "grid"], _nothing_written),
    ]


CASES = _report_cases() + _results_cases() + _sweep_cases()


@pytest.mark.parametrize("setup, argv, code, words, check", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_runs_folders_stay_inside_their_boundary(ws, monkeypatch, setup, argv, code, words, check):
    setup(ws)
    _stub_cells(monkeypatch)
    elsewhere = _tree(ws / "elsewhere")
    result = CliRunner().invoke(app, argv)
    stderr = result.stderr
    assert result.exit_code == code, (result.exit_code, result.stdout[-2000:], stderr)
    assert "Traceback" not in stderr, stderr
    for w in words:
        assert w in stderr, (w, stderr)
    if code != OK:
        lines = [ln for ln in stderr.splitlines() if ln.strip()]
        assert 1 <= len(lines) <= 3 and any(ln.startswith("error: ") for ln in lines), stderr
    assert _tree(ws / "elsewhere") == elsewhere  # nothing written into (or through a link to) another place
    if isinstance(check, str):
        assert check in result.stdout, result.stdout
    elif check is not None:
        check(ws)


def test_a_raised_cell_limit_lets_a_big_grid_through(ws):
    _over_cap(ws)
    result = CliRunner().invoke(app, ["sweep", "spec.yaml", "--dry-run", "--max-cells", "20000"])
    assert result.exit_code == 0, result.stderr
    assert "10100 cells; every config is valid" in result.stdout


def test_safe_cell_names_are_unchanged_and_unsafe_ones_distinct(ws):
    """Committed run folders are named by today's rule; values that were not safe get a hashed name, and two
    values that once shared a folder name no longer collide."""
    from clmerge.sweep.grid import cell_name

    assert cell_name({"method.name": "pm", "seed": 1}) == "pm-seed1"
    assert cell_name({"optim.lr": 0.001}) == "lr0.001"
    a, b = cell_name({"scenario.data_root": "a/b"}), cell_name({"scenario.data_root": "a b"})
    assert a != b and a.startswith("data_roota_b-h") and b.startswith("data_roota_b-h")
    assert cell_name({"model.name": ".."}) not in ("..", ".") and len(cell_name({"model.name": "z" * 999})) <= MAX_NAME
