"""One vocabulary on the command line (docs/cli.md): ``-h`` is ``--help`` everywhere, ``--version``, flags
shown as flags, the parallelism options' names with their old spellings as hidden deprecated aliases, merge
methods named as in the registry everywhere (``weight_average``; the study's old ``averaging`` still read),
and where ``clmerge run`` puts a run without ``--out``."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

import clmerge
from clmerge.cli import app

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()
WIDE = {"COLUMNS": "200"}


def _commands() -> list[str]:
    return sorted(typer.main.get_command(app).commands)


def test_every_command_is_listed():
    assert {"run", "merge", "merges", "merge-bench", "study", "predict", "advise", "export", "extract-lora",
            "pretrain", "report", "results", "methods", "datasets", "models", "configs"} <= set(_commands())


@pytest.mark.parametrize("argv", [[]] + [[c] for c in _commands()])
def test_dash_h_is_help(argv):
    long = runner.invoke(app, [*argv, "--help"], env=WIDE)
    short = runner.invoke(app, [*argv, "-h"], env=WIDE)
    assert long.exit_code == 0 and "Usage:" in long.output
    assert short.exit_code == 0 and short.output == long.output


@pytest.mark.parametrize("argv", [[]] + [[c] for c in _commands()])
def test_flags_are_shown_as_flags(argv):
    res = runner.invoke(app, [*argv, "--help"], env=WIDE)
    assert res.exit_code == 0 and "<bool>" not in res.output


def test_version():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output == f"clmerge {clmerge.__version__}\n"


def _fake_study(monkeypatch) -> list[dict]:
    """``clmerge study`` with the jobs and the fits replaced: records what run_study was given."""
    import clmerge.sweep as sweep

    calls: list[dict] = []
    monkeypatch.setattr(sweep, "run_study", lambda *a, **kw: calls.append(kw))
    monkeypatch.setattr(sweep, "finish_study", lambda out: {"laws": {}})
    return calls


SMOKE = str(REPO / "benchmarks" / "study_smoke.yaml")


def test_study_jobs_and_its_old_spelling_workers(tmp_path, monkeypatch):
    calls = _fake_study(monkeypatch)
    new = runner.invoke(app, ["study", SMOKE, "--out", str(tmp_path / "a"), "--jobs", "2"])
    assert new.exit_code == 0, new.output
    assert "warning" not in new.output and calls[-1]["workers"] == 2
    old = runner.invoke(app, ["study", SMOKE, "--out", str(tmp_path / "b"), "--workers", "2"])
    assert old.exit_code == 0, old.output
    assert calls[-1]["workers"] == 2  # the same behaviour
    lines = [ln for ln in old.output.splitlines() if "warning" in ln]
    assert len(lines) == 1 and "--workers" in lines[0] and "--jobs" in lines[0] and "deprecated" in lines[0]
    both = runner.invoke(app, ["study", SMOKE, "--out", str(tmp_path / "c"), "--workers", "2", "--jobs", "3"])
    assert both.exit_code == 2 and "--jobs" in both.output and len(calls) == 2


def test_workers_is_hidden_from_the_help():
    res = runner.invoke(app, ["study", "--help"], env=WIDE)
    assert "--jobs" in res.output and "--workers" not in res.output


def test_study_spec_names_methods_as_the_registry(caplog):
    from clmerge.merging import available
    from clmerge.theory.spec import expand_points, parse_study

    spec = yaml.safe_load(Path(SMOKE).read_text())
    names = {m["name"] for m in spec["methods"]}  # the shipped specs use the registry's names (AdaMerging needs
    assert "weight_average" in names and names - {"adamerging"} <= set(available())  # data: not a CLI merge)
    with caplog.at_level(logging.WARNING):
        new = parse_study(spec | {"methods": [{"name": "weight_average"}]})
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        old = parse_study(spec | {"methods": [{"name": "averaging"}]})
    assert len(caplog.records) == 1 and "'averaging'" in caplog.text and "'weight_average'" in caplog.text
    assert new.methods == old.methods == [{"name": "weight_average"}]
    # the point ids are those of studies written under the old name (--resume finds their results)
    assert [p.id for p in expand_points(new)] == [p.id for p in expand_points(old)]


def test_committed_study_results_keep_their_ids_and_method():
    from clmerge.sweep import read_results
    from clmerge.theory.spec import expand_points, load_study

    d = REPO / "benchmarks" / "theory" / "interaction"
    rows = read_results(d)
    ids = {p.id for p in expand_points(load_study(d / "study.yaml"))}
    assert rows and all(r["point_id"] in ids for r in rows)
    assert {r["method"] for r in rows} == {"weight_average"}


def _numbers(text: str) -> str:
    return text.split(":", 1)[1]


def test_predict_takes_the_registry_name_on_an_old_study(tmp_path):
    study = tmp_path / "study"
    study.mkdir()
    shutil.copy(REPO / "benchmarks" / "theory" / "interaction" / "fits.json", study / "fits.json")
    assert "averaging" in json.loads((study / "fits.json").read_text())["laws"]["lr"]  # written under the old name
    new = runner.invoke(app, ["predict", str(study), "lr=0.03"])  # the default: weight_average
    assert new.exit_code == 0, new.output
    assert new.output.startswith("weight_average at lr=0.03: merged loss") and "warning" not in new.output
    old = runner.invoke(app, ["predict", str(study), "lr=0.03", "--method", "averaging"])
    assert old.exit_code == 0, old.output
    warn = [ln for ln in old.output.splitlines() if ln.startswith("warning")]
    assert len(warn) == 1 and "weight_average" in warn[0]
    assert _numbers(old.output.splitlines()[-1]) == _numbers(new.output.splitlines()[-1])


def test_run_without_out_goes_to_clmerge_runs_dir(tmp_path, monkeypatch, tiny_cfg):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_cfg(**{"train.epochs": 1})))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("CLMERGE_RUNS_DIR", str(tmp_path / "store"))
    res = runner.invoke(app, ["run", str(cfg)], env=WIDE)
    assert res.exit_code == 0, res.output
    runs = list((tmp_path / "store").iterdir())
    assert len(runs) == 1 and (runs[0] / "metrics.json").exists() and not list(work.iterdir())
    assert f"writing the run to {runs[0]}\n" in res.output  # absolute, at the start
    assert f"run directory: {runs[0]} " in res.output  # and at the end


def test_run_dir_default_is_runs_under_cwd(monkeypatch):
    from clmerge.cli.run import default_run_dir

    monkeypatch.delenv("CLMERGE_RUNS_DIR", raising=False)
    d = default_run_dir("ewc", "digits")
    assert d.parent == Path("runs") and d.name.startswith("ewc-digits-")


@pytest.mark.parametrize("argv, folder", [
    (["merge-bench", "--suite", "nosuch"], "merge-bench-runs/suitenosuch"),
    (["pretrain", "--epochs", "1", "--data-root", "nowhere"], "pretrained/vit_tiny_fmnist"),
])
def test_a_default_output_folder_is_printed_as_an_absolute_path(tmp_path, monkeypatch, argv, folder):
    import clmerge.data.idx as idx

    monkeypatch.chdir(tmp_path)
    # the pretrain case must fail on missing data after printing its folder, also where Fashion-MNIST is installed
    monkeypatch.setattr(idx, "DEBIAN_DATASET_DIR", tmp_path / "no-datasets")
    monkeypatch.delenv(idx.IDX_ENV_VAR, raising=False)
    res = runner.invoke(app, argv, env=WIDE)
    assert f"writing to {tmp_path / folder} " in res.output, res.output


def test_a_study_written_under_the_old_name_resumes_with_the_new_one(tmp_path):
    from clmerge.sweep.study import _prepare
    from clmerge.theory.spec import parse_study

    spec = yaml.safe_load(Path(SMOKE).read_text())
    new = parse_study(spec | {"methods": [{"name": "weight_average"}, {"name": "ties"}]})
    saved = new.model_dump()  # what the study directory holds, written before the rename
    saved["methods"][0]["name"] = "averaging"
    out = tmp_path / "study"
    out.mkdir()
    (out / "study.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    (out / "results.jsonl").write_text(json.dumps({"point_id": "abc", "method": "averaging"}) + "\n")
    assert _prepare(out, new, resume=True) == {"abc"}  # not refused as a different study
