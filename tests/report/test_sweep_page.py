"""The sweep page (clmerge.report.sweep_page): table values, the old/new split and the seed bands by hand,
link targets, generated cell pages, the 0-100 accuracy axes (read from the figure objects), and the page
without matplotlib."""

from __future__ import annotations

import json
import re
import sys
from html import unescape
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.report import plots, sweep_page, tables
from clmerge.report.sweep_data import cil_curve, old_new_split, seed_band

from report_helpers import write_matrix_run

# method -> seed -> CIL accuracy matrix (2 tasks); acc = mean of the last row
MATRICES = {
    "seq_lora": {0: [[90.0, None], [40.0, 80.0]], 1: [[94.0, None], [50.0, 84.0]]},  # acc 60, 67
    "pm": {0: [[88.0, None], [70.0, 78.0]], 1: [[92.0, None], [76.0, 80.0]]},  # acc 74, 78
}
@pytest.fixture()
def sweep(tmp_path):
    """A sweep directory as ``clmerge sweep`` writes it: sweep.yaml, cells.json, one run per cell."""
    root = tmp_path / "sw"
    for method, by_seed in MATRICES.items():
        for seed, R in by_seed.items():
            write_matrix_run(root / f"{method}-seed{seed}", method, seed, R)
    (root / "sweep.yaml").write_text(yaml.safe_dump({"grid": {"method.name": list(MATRICES), "seed": [0, 1]}}))
    (root / "cells.json").write_text("{}")
    return root


def _table(root: Path, **kw) -> tables.ResultsTable:
    done, unfinished = tables.find_runs([root])
    return tables.build_table(tables.load_runs(done), by=["method.name"], metrics=["acc", "til_acc"],
                              skipped=unfinished, **kw)


def test_old_new_split_of_a_hand_made_matrix():
    R = [[90.0, None, None], [60.0, 80.0, None], [30.0, 50.0, 70.0]]
    new, old = old_new_split(R)
    assert new == [90.0, 80.0, 70.0]  # R[t][t]
    assert old == [None, 60.0, 40.0]  # mean of R[t][j], j < t: (30 + 50) / 2
    assert old_new_split([[90.0, None], [None, 80.0]])[1] == [None, None]  # a missing entry: no mean


def test_seed_band_is_mean_and_standard_error_per_task():
    band = seed_band([[90.0, 60.0], [94.0, 67.0], [92.0]])
    assert band.mean == pytest.approx([92.0, 63.5])
    assert band.se == pytest.approx([2.0 / 3 ** 0.5, 3.5])  # s = 2 over 3 runs; |67 - 60| / 2 over 2
    assert band.n == [3, 2]
    assert seed_band([[50.0]]).se == [None]  # one run: no band


def test_page_table_values_links_and_generated_cell_pages(sweep):
    kept = sweep / "pm-seed0" / "report.html"
    kept.write_text("<p>the run's own page, kept</p>")
    out = sweep_page.build_sweep_page(sweep, vs="seq_lora")
    html = out.read_text()
    assert out == sweep / "report.html"
    assert "63.50 ± 3.50" in html and "76.00 ± 2.00" in html  # acc (60, 67) and (74, 78)
    assert "+12.50 ± 1.50 (2)" in html  # paired: 74 - 60, 78 - 67
    assert "<h3>Paired differences to seq_lora</h3>" in html
    assert "<th>method.name</th><th>runs</th>" in html
    hrefs = re.findall(r'<a href="([^"]+)"', html)
    assert sorted(hrefs) == sorted(f"{m}-seed{s}/report.html" for m in MATRICES for s in (0, 1))
    assert all((sweep / h).is_file() for h in hrefs)
    assert kept.read_text() == "<p>the run's own page, kept</p>"  # only missing pages are written
    assert "clmerge report" in (sweep / "seq_lora-seed0" / "report.html").read_text()
    for title in ("Accuracy over tasks", "Forgetting per task", "Old vs new classes"):
        assert f"<h2>{title}</h2>\n<img" in html
    assert "± 1 standard error" in html and "R[t][t]" in html


def test_grouping_defaults_to_the_grid_keys_but_the_seeds(sweep):
    assert sweep_page.default_by(sweep) == ["method.name"]
    (sweep / "sweep.yaml").write_text(yaml.safe_dump({"grid": {"seed": [0, 1], "optim.lr": [0.1]}}))
    assert sweep_page.default_by(sweep) == ["optim.lr"]
    (sweep / "sweep.yaml").unlink()
    assert sweep_page.default_by(sweep) == ["method.name"]  # a plain folder of run directories


def test_unfinished_runs_are_listed_not_linked(sweep):
    (sweep / "pm-seed2").mkdir()
    (sweep / "pm-seed2" / "config.yaml").write_text(yaml.safe_dump({"seed": 2, "method": {"name": "pm"}}))
    html = sweep_page.build_sweep_page(sweep).read_text()
    assert "pm-seed2" in html and "unfinished (no metrics.json)" in html
    assert "pm-seed2/report.html" not in html and not (sweep / "pm-seed2" / "report.html").exists()


def test_every_accuracy_axis_of_the_sweep_figures_spans_0_to_100(sweep):
    figs = sweep_page.sweep_figures(_table(sweep))
    for title in ("Accuracy over tasks", "Old vs new classes"):
        axes = figs[title].axes
        assert len(axes) == 2
        assert all(ax.get_ylim() == (0.0, 100.0) for ax in axes), title
    assert figs["Forgetting per task"].axes[0].get_ylim()[1] < 100.0  # points, not accuracy: not pinned


def test_every_accuracy_axis_of_the_run_plots_spans_0_to_100():
    R = [[40.0, None], [30.0, 35.0]]  # values far from both ends: autoscaling would not give 0-100
    assert plots.accuracy_curves_figure(R).axes[0].get_ylim() == (0.0, 100.0)
    assert plots.multi_order_curves_figure({"a": [40.0, 35.0]}).axes[0].get_ylim() == (0.0, 100.0)
    assert plots.metric_bars_figure({"r": {"acc": 40.0, "aaa": 35.0}}, ["acc", "aaa"]).axes[0].get_ylim() == \
        (0.0, 100.0)
    image = plots.accuracy_heatmap_figure(R).axes[0].images[0]
    assert image.get_clim() == (0.0, 100.0)


def test_without_matplotlib_the_page_keeps_its_tables_and_names_the_extra(sweep, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    html = unescape(sweep_page.build_sweep_page(sweep).read_text())
    assert "63.50 ± 3.50" in html and 'pip install "clmerge[plots]"' in html and "<img" not in html


def test_cil_curve_is_derived_from_the_matrix_when_metrics_json_has_none():
    assert cil_curve({"accuracy_matrix": MATRICES["seq_lora"][0]}) == pytest.approx([90.0, 60.0])


def test_cli_report_on_a_sweep_directory_writes_one_page(sweep):
    result = CliRunner().invoke(app, ["report", str(sweep), "--vs", "seq_lora", "--metrics", "acc"])
    assert result.exit_code == 0, result.output
    html = (sweep / "report.html").read_text()
    assert "Δacc" in html and "til_acc" not in html.split("<h2>Accuracy over tasks")[0].split("</table>")[0]


CHROMIUM = Path("/usr/bin/chromium")


def screenshot(page: Path, png: Path, profile: Path, height: int = 2400) -> None:
    """Render ``page`` with headless Chromium into ``png`` (1280 px wide), offline and without a profile."""
    import subprocess

    argv = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", f"--screenshot={png}", f"--window-size=1280,{height}",
            page.resolve().as_uri()]
    subprocess.run(argv, check=True, capture_output=True, timeout=60)


@pytest.mark.slow
@pytest.mark.skipif(not CHROMIUM.is_file(), reason="no /usr/bin/chromium (apt-get install chromium) to render "
                    "the page in a real browser")
def test_the_page_of_a_real_tiny_sweep_renders_in_chromium(tmp_path, monkeypatch):
    from matplotlib.image import imread
    import numpy as np

    from conftest import tiny_config

    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_config(**{"train.epochs": 1})))
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({"base": "tiny.yaml", "grid": {
        "method.name": ["seq_lora", "pm"], "seed": [0, 1]}}))
    monkeypatch.chdir(tmp_path)
    assert CliRunner().invoke(app, ["sweep", "spec.yaml", "--out", "sw"]).exit_code == 0
    result = CliRunner().invoke(app, ["report", "sw", "--vs", "seq_lora"])
    assert result.exit_code == 0, result.output
    screenshot(tmp_path / "sw" / "report.html", tmp_path / "shot.png", tmp_path / "profile")
    pixels = imread(tmp_path / "shot.png")[..., :3]
    assert pixels.shape[:2] == (2400, 1280)
    colours = np.unique((pixels.reshape(-1, 3) * 255).round().astype(np.uint8), axis=0)
    assert len(colours) > 500, "the screenshot is (nearly) one colour: the page did not render"
    plots_band = pixels[600:1600]  # the first plots sit below the table: blue, orange lines and bands
    assert (np.abs(plots_band[..., 2] - plots_band[..., 0]) > 0.3).any(), "no coloured plot on the page"


# -- a sweep with a `select:` block: its selection runs (DIR/select/) are not results; its choice is shown
SELECTED = {"key": "optim.lr", "metric": "acc", "split": "val", "seeds": [0], "groups": {
    "method.name=seq_lora": {"per": {"method.name": "seq_lora"}, "value": 0.01, "extended": [0.1],
                             "at_edge": True, "scores": [{"value": 0.001, "val_acc": 41.5, "cells": []},
                                                         {"value": 0.01, "val_acc": 63.25, "cells": []}]},
    "method.name=pm": {"per": {"method.name": "pm"}, "value": 0.003, "extended": [], "at_edge": False,
                       "scores": [{"value": 0.001, "val_acc": 70.0, "cells": []},
                                  {"value": 0.003, "val_acc": 77.5, "cells": []}]}}}


def _with_selection_runs(root: Path) -> None:
    """Selection runs under DIR/select/ (a method of its own, so the page would show a third group)."""
    write_matrix_run(root / "select" / "sd_lora-lr0.1-seed0", "sd_lora", 0, [[10.0, None], [5.0, 7.0]])
    (root / "select" / "cells.json").write_text("{}")


@pytest.mark.parametrize("chosen", [True, False], ids=["selected", "stopped-in-selection"])
def test_the_page_skips_the_selection_runs(sweep, chosen):
    _with_selection_runs(sweep)
    if chosen:
        (sweep / "selected.json").write_text(json.dumps(SELECTED))
    text = unescape(sweep_page.build_sweep_page(sweep).read_text())
    assert "sd_lora" not in text and "select/sd_lora" not in text
    assert "4 finished" in text
    assert not (sweep / "select" / "sd_lora-lr0.1-seed0" / "report.html").exists()  # no page for it either


def test_the_page_shows_the_choice_on_validation_per_group(sweep):
    (sweep / "selected.json").write_text(json.dumps(SELECTED))
    text = sweep_page.build_sweep_page(sweep).read_text()
    section = unescape(text.split("Selection on validation", 1)[1].split("</section>", 1)[0])
    rows = [re.sub(r"<[^>]+>", "|", r) for r in section.split("</table>")[0].split("<tr>")[2:]]
    cells = [[c for c in r.split("|") if c.strip()] for r in rows]
    assert cells[0] == ["method.name=seq_lora", "0.01", "0.001: 41.5; 0.01: 63.25", "yes"]
    assert cells[1] == ["method.name=pm", "0.003", "0.001: 70; 0.003: 77.5", "no"]
    assert "chosen optim.lr" in section and "mean validation acc" in section


def test_no_selection_section_without_selected_json(sweep):
    assert "Selection on validation" not in sweep_page.build_sweep_page(sweep).read_text()


def test_a_selected_json_of_another_shape_is_one_input_error_and_writes_nothing(sweep):
    (sweep / "selected.json").write_text(json.dumps({**SELECTED, "groups": {"g": {"value": 1, "scores": 3}}}))
    res = CliRunner().invoke(app, ["report", str(sweep)])
    assert res.exit_code == 3 and "selected.json: groups.g.scores" in res.output
    assert not (sweep / "report.html").exists()
    assert not any(sweep.glob("*/report.html"))
