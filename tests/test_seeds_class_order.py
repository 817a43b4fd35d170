"""Seeds as papers use them: ``clmerge run --seeds`` varies the class order with the training seed by default
(``--fixed-class-order`` keeps the old behaviour), and the table across runs says what varied and flags a zero
standard error as "nothing varied".

The default follows LAMDA-PILOT, where one seed drives both: trainer.py lines 48-55 call
``_set_random(args["seed"])`` and then ``DataManager(args["dataset"], args["shuffle"], args["seed"], ...)``,
whose ``_setup_data`` (utils/data_manager.py) runs ``np.random.seed(seed)`` and permutes the class order.
"""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.report import tables

from conftest import tiny_config
from report_helpers import write_seed_run


@pytest.fixture()
def ws(tmp_path, monkeypatch):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_config(**{"train.epochs": 1})))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _invoke(*args):
    return CliRunner().invoke(app, list(args))


def _cells(output: str) -> dict[str, str]:
    return {ln.split()[0]: " ".join(ln.split()[1:]) for ln in output.splitlines() if ln.startswith("seed")}


def test_seeds_set_the_class_order_too_by_default(ws):
    res = _invoke("run", "tiny.yaml", "--seeds", "0,3", "--dry-run")
    assert res.exit_code == 0, res.output
    assert _cells(res.output) == {"seed0": "seed=0 scenario.seed=0", "seed3": "seed=3 scenario.seed=3"}


def test_fixed_class_order_keeps_scenario_seed(ws):
    res = _invoke("run", "tiny.yaml", "--seeds", "0,3", "--fixed-class-order", "--dry-run")
    assert res.exit_code == 0, res.output
    assert _cells(res.output) == {"seed0": "seed=0", "seed3": "seed=3"}
    res = _invoke("run", "tiny.yaml", "--seeds", "0,3", "--set", "scenario.seed=5", "--fixed-class-order",
                  "--dry-run")
    assert res.exit_code == 0, res.output


def test_a_set_class_order_with_seeds_asks_for_the_named_option(ws):
    res = _invoke("run", "tiny.yaml", "--seeds", "0,1", "--set", "scenario.seed=5", "--dry-run")
    assert res.exit_code == 2 and "--fixed-class-order" in res.output and "scenario.seed=5" in res.output
    res = _invoke("run", "tiny.yaml", "--fixed-class-order", "--dry-run")
    assert res.exit_code == 2 and "--seeds" in res.output


def test_the_seeds_sweep_records_the_link_and_resumes_with_the_same_option(ws, monkeypatch):
    from clmerge.cli import sweep as cli_sweep

    seen = []
    monkeypatch.setattr(cli_sweep, "run_spec", lambda spec, out, **kw: seen.append((spec, kw["resume_command"])))
    assert _invoke("run", "tiny.yaml", "--seeds", "0,1", "--out", "r").exit_code == 0
    assert _invoke("run", "tiny.yaml", "--seeds", "0,1", "--fixed-class-order", "--out", "r").exit_code == 0
    (linked, cmd), (fixed, cmd_fixed) = seen
    assert linked.link == {"scenario.seed": "seed"} and "--fixed-class-order" not in cmd
    assert linked.as_dict()["link"] == {"scenario.seed": "seed"}  # sweep.yaml: a resume must agree
    assert fixed.link == {} and "--fixed-class-order" in cmd_fixed


def test_the_table_says_what_varied_and_flags_a_zero_standard_error(tmp_path):
    for s in (0, 1, 2):  # seq_lora: deterministic under the training seed; pm: the class order varies too
        write_seed_run(tmp_path / f"seq{s}", "seq_lora", s, 80.0, til_acc=90.0 + s)
        write_seed_run(tmp_path / f"pm{s}", "pm", s, 84.0 + s, til_acc=95.0, scenario_seed=s)
    done, _ = tables.find_runs([tmp_path])
    t = tables.build_table(tables.load_runs(done), by=["method.name"], metrics=["acc", "til_acc"])
    head, rows = tables.table_rows(t)
    row = {r[0]: dict(zip(head, r)) for r in rows}
    assert row["seq_lora"]["acc"] == "80.00 ± 0.00 (nothing varied)"
    assert row["pm"]["til_acc"] == "95.00 ± 0.00 (nothing varied)"
    assert row["pm"]["acc"] == "85.00 ± 0.58" and row["seq_lora"]["til_acc"] == "91.00 ± 0.58"
    notes = t.notes()
    assert notes[0].startswith("runs: the runs averaged; what varied: the training seed (seed) and the class "
                               "order (scenario.seed)")
    flag = next(n for n in notes if n.startswith("nothing varied:"))
    assert "acc of seq_lora" in flag and "til_acc of pm" in flag and "--fixed-class-order" not in flag


def test_the_flag_hints_at_the_class_order_when_only_the_training_seed_varied(tmp_path):
    for s in (0, 1):
        write_seed_run(tmp_path / f"seq{s}", "seq_lora", s, 80.0)
    done, _ = tables.find_runs([tmp_path])
    t = tables.build_table(tables.load_runs(done), by=["method.name"], metrics=["acc"])
    assert t.notes()[0].startswith("runs: the runs averaged; what varied: the training seed (seed) (seed keys")
    flag = next(n for n in t.notes() if n.startswith("nothing varied:"))
    assert "class order (scenario.seed) stayed fixed" in flag and "--fixed-class-order" in flag
    one = tables.build_table(tables.load_runs(done[:1]), by=["method.name"], metrics=["acc"])
    assert tables.table_rows(one)[1][0][2] == "80.00"  # one run: no error bar, no flag
    assert not any(n.startswith("nothing varied") for n in one.notes())
