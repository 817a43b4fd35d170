"""Studies that say when they are incomplete: "not enough levels", laws not fitted with a reason, partial
studies labelled with their missing points counted, merged losses near chance, the report's title, and the
`--resume` line of an interrupted `clmerge study`. Synthetic results: no model is trained."""

from __future__ import annotations

import math

import numpy as np
import pytest
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.sweep import finish_study
from clmerge.theory.advise import advise
from clmerge.theory.analysis import fit_study
from clmerge.theory.laws import FORMS, NOT_ENOUGH_LEVELS, fit_form
from clmerge.theory.spec import HYPERPARAMETERS, expand_points, parse_study
from clmerge.utils.io import read_json

pytest.importorskip("scipy")


def _spec(grid: dict, name: str = "levels-check", seeds=(0,)):
    return parse_study({
        "name": name, "suite": "tiny", "seeds": list(seeds),
        "defaults": {"steps": 4, "n_experts": 2, "batch_size": 8, "lr": 0.02, "data_ratio": 1.0},
        "grid": grid, "methods": [{"name": "weight_average"}],
        "measure": {"noise_samples": 4, "stability": False, "weighting_steps": []}})


def _rows(spec, loss=lambda p: 0.5 + 10 * p.lr ** 2 + 1.0 / p.steps, n_classes=10):
    """One result per point of ``spec``, with a merged loss given by ``loss(point)``."""
    return [{"point_id": p.id, "kind": p.kind, "varied": p.varied, "method": p.method["name"], "seed": p.seed,
             "group": p.group, **{h: getattr(p, h) for h in HYPERPARAMETERS}, "merged_loss": loss(p),
             "merged_acc": 50.0, "sigma2": [0.1], "zeta2": [0.01], "experts": [{"test_loss": 0.4}],
             "n_classes": [n_classes] * p.n_experts} for p in expand_points(spec)]


def test_two_levels_give_not_enough_levels_not_agrees():
    lr = FORMS["lr"]
    x, y = np.array([0.01, 0.01, 0.04, 0.04]), np.array([1.0, 1.01, 1.3, 1.31])  # increasing: the paper's trend
    two = fit_form(lr, x, y, n_boot=10)
    assert two["verdict"] == NOT_ENOUGH_LEVELS and two["agrees"] is None and two["levels"] == 2
    three = fit_form(lr, np.array([0.01, 0.02, 0.04]), np.array([1.0, 1.05, 1.3]), n_boot=10)
    assert three["verdict"] == "agrees" and three["agrees"] is True


def test_as_many_points_as_coefficients_is_not_enough():
    steps = FORMS["steps"]  # three coefficients: three points fit them exactly and judge nothing
    fit = fit_form(steps, np.array([4.0, 16.0, 64.0]), np.array([1.2, 1.0, 1.4]), n_boot=10)
    assert fit["verdict"] == NOT_ENOUGH_LEVELS


def test_a_law_left_unfitted_is_named_with_its_reason():
    spec = _spec({"lr": [0.01, 0.02, 0.04], "steps": [4, 8]})  # steps: 2 levels, 3 coefficients
    rows = _rows(spec)
    fits = fit_study(rows, spec, n_boot=10)
    assert "steps" not in fits["laws"] and "2 distinct value(s) of steps" in fits["not_fitted"]["steps"]["weight_average"]
    for law in ("batch_size", "data_ratio", "n_experts"):  # not varied at all: said too
        assert "1 distinct value(s)" in fits["not_fitted"][law]["weight_average"]
    text = advise(rows, fits)
    assert "- steps: not fitted: 2 distinct value(s) of steps" in text
    assert "(agrees, 3 levels)" in text  # the lr law


def test_a_partial_study_is_labelled_in_fits_advice_and_report(tmp_path):
    spec = _spec({"lr": [0.01, 0.02, 0.04]})
    rows = _rows(spec)
    fits = fit_study(rows[:-1], spec, n_boot=10)
    assert fits["partial"] is True and fits["points_missing"] == 1 and fits["points_expected"] == len(rows)
    assert advise(rows[:-1], fits).startswith(f"PARTIAL STUDY: {len(rows) - 1} of {len(rows)} points finished, 1 missing")
    assert fit_study(rows, spec, n_boot=10)["partial"] is False
    _write_study(tmp_path, spec, rows[:-1])
    finish_study(tmp_path, n_boot=10)
    assert read_json(tmp_path / "fits.json")["points_missing"] == 1
    html = (tmp_path / "report.html").read_text()
    assert f"<strong>partial</strong>: {len(rows) - 1} of {len(rows)} points, 1 missing" in html
    assert "PARTIAL STUDY" in (tmp_path / "advice.txt").read_text()


def test_the_report_title_is_the_specs_name(tmp_path):
    spec = _spec({"lr": [0.01, 0.02, 0.04]}, name="my-lr-study")
    _write_study(tmp_path / "dir-name", spec, _rows(spec))
    finish_study(tmp_path / "dir-name", n_boot=10)
    html = (tmp_path / "dir-name" / "report.html").read_text()
    assert "<h1>Study: my-lr-study</h1>" in html and "<title>clmerge study my-lr-study" in html


def test_merged_losses_near_chance_are_never_called_best():
    spec = _spec({"lr": [0.01, 0.02, 0.04]})
    chance = math.log(10)
    rows = _rows(spec, loss=lambda p: chance + p.lr)  # every merged model at (or past) chance
    text = advise(rows, fit_study(rows, spec, n_boot=10))
    assert "Best merged model" not in text
    assert text.startswith("No merged model is called best: every merged loss is near chance") and "ln C = 2.3026" in text
    mixed = _rows(spec, loss=lambda p: 0.3 if p.lr == 0.02 else chance)
    text = advise(mixed, fit_study(mixed, spec, n_boot=10))
    assert text.startswith("Best merged model") and "2 of 3 merged settings have losses near chance" in text


def _write_study(out, spec, rows):
    import json

    import yaml

    out.mkdir(parents=True, exist_ok=True)
    (out / "study.yaml").write_text(yaml.safe_dump(spec.model_dump(), sort_keys=False))
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_an_interrupted_study_prints_a_working_resume_line(tmp_path, monkeypatch):
    from clmerge import sweep

    spec = _spec({"lr": [0.01, 0.02, 0.04]})
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text("name: x\n")
    out = tmp_path / "run dir"

    def interrupted(study, out, **_):
        _write_study(out, study, _rows(study)[:1])
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep, "run_study", interrupted)
    monkeypatch.setattr("clmerge.theory.spec.load_study", lambda *_: spec)
    res = CliRunner().invoke(app, ["study", str(spec_file), "--out", str(out), "--jobs", "2", "--set", "seeds=[0]"])
    assert res.exit_code == 130, res.output
    line = next(ln for ln in res.output.splitlines() if ln.startswith("interrupted:"))
    assert line.endswith(f"continue with: clmerge study '{out}/study.yaml' --out '{out}' --resume --jobs 2")
    # the line works as printed: the spec it names is the study's own
    monkeypatch.undo()
    from clmerge.theory.spec import load_study

    assert load_study(out / "study.yaml", []) == spec


def test_results_without_class_counts_say_chance_was_not_checked():
    spec = _spec({"lr": [0.01, 0.02, 0.04]})
    rows = [{k: v for k, v in r.items() if k != "n_classes"} for r in _rows(spec, loss=lambda p: 2.2 + p.lr)]
    text = advise(rows, fit_study(rows, spec, n_boot=10))
    assert text.splitlines()[1].startswith("Not checked against chance: these results do not record the class counts")
