"""Tables across runs (clmerge.report.tables): numbers checked by hand on hand-written run directories."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest

from report_helpers import write_seed_run

from clmerge.errors import InputError, UsageError
from clmerge.report import tables

SEQ = {0: 80.0, 1: 82.0, 2: 87.0}  # mean 83, s^2 = (9 + 1 + 16) / 2 = 13, SE = sqrt(13 / 3)
PM = {0: 84.0, 1: 85.0, 2: 92.0, 3: 91.0}  # mean 88, s^2 = 50 / 3, SE = sqrt(50 / 12); seed 3 has no partner
SEQ_TIL = {0: 90.0, 1: 91.0, 2: 92.0}  # mean 91, SE = 1 / sqrt(3)


@pytest.fixture()
def sweep(tmp_path):
    """A sweep folder as ``clmerge sweep`` lays it out: one run directory per cell, named by its overrides."""
    for s, acc in SEQ.items():
        write_seed_run(tmp_path / f"method.name=seq_lora,seed={s}", "seq_lora", s, acc, til_acc=SEQ_TIL[s])
    for s, acc in PM.items():
        write_seed_run(tmp_path / f"method.name=pm,seed={s}", "pm", s, acc, til_acc=95.0)
    write_seed_run(tmp_path / "method.name=pm,seed=9", "pm", 9, None, finished=False)
    return tmp_path


def _table(dirs, **kw):
    done, unfinished = tables.find_runs(dirs)
    kw = {"by": ["method.name"], "metrics": ["acc", "til_acc", "fwt"], **kw}
    return tables.build_table(tables.load_runs(done), skipped=unfinished, **kw)


def _group(t, label):
    return next(g for g in t.groups if g.label == label)


def test_mean_and_standard_error_per_group_by_hand(sweep):
    t = _table([sweep])
    seq, pm = _group(t, "seq_lora"), _group(t, "pm")
    assert seq.stats["acc"] == pytest.approx({"mean": 83.0, "se": math.sqrt(13 / 3), "n": 3})
    assert pm.stats["acc"] == pytest.approx({"mean": 88.0, "se": math.sqrt(50 / 12), "n": 4})
    assert seq.stats["til_acc"] == pytest.approx({"mean": 91.0, "se": 1 / math.sqrt(3), "n": 3})
    assert pm.stats["til_acc"] == pytest.approx({"mean": 95.0, "se": 0.0, "n": 4})
    assert seq.stats["fwt"] == {"mean": None, "se": None, "n": 0}  # null in every run: no number
    assert t.skipped == [sweep / "method.name=pm,seed=9"]
    assert t.seeds_varied == ["seed"]


def test_paired_differences_by_seed_and_unpaired_runs_are_listed(sweep):
    t = _table([sweep], vs="seq_lora")
    pm = _group(t, "pm")
    # seeds 0, 1, 2: 84 - 80, 85 - 82, 92 - 87 = 4, 3, 5 -> mean 4, s = 1, SE = 1 / sqrt(3)
    assert pm.diffs["acc"] == pytest.approx({"mean": 4.0, "se": 1 / math.sqrt(3), "n": 3})
    assert pm.diffs["til_acc"] == pytest.approx({"mean": 4.0, "se": 1 / math.sqrt(3), "n": 3})
    assert pm.unpaired == [sweep / "method.name=pm,seed=3"]
    assert any("unpaired" in n and "seed=3" in n for n in t.notes())
    assert _group(t, "seq_lora").diffs == {}


def test_pairs_need_both_seed_keys(tmp_path):
    write_seed_run(tmp_path / "a0", "seq_lora", 0, 80.0)
    write_seed_run(tmp_path / "a1", "seq_lora", 0, 90.0, scenario_seed=1)
    write_seed_run(tmp_path / "b0", "pm", 0, 81.0, scenario_seed=1)
    t = _table([tmp_path], vs="seq_lora", metrics=["acc"])
    assert _group(t, "pm").diffs["acc"] == {"mean": -9.0, "se": None, "n": 1}  # 81 - 90: scenario.seed 1 only
    assert t.seeds_varied == ["scenario.seed"]


def test_groups_by_several_dotted_keys(tmp_path):
    for lr, accs in ((0.01, (70.0, 74.0)), (0.001, (80.0, 81.0))):
        for s, acc in enumerate(accs):
            write_seed_run(tmp_path / f"lr{lr}-s{s}", "seq_lora", s, acc, optim={"lr": lr})
    t = _table([tmp_path], by=["method.name", "optim.lr"], metrics=["acc"], vs="seq_lora,0.01")
    assert _group(t, "seq_lora,0.001").stats["acc"] == pytest.approx({"mean": 80.5, "se": 0.5, "n": 2})
    assert _group(t, "seq_lora,0.001").diffs["acc"] == pytest.approx({"mean": 8.5, "se": 1.5, "n": 2})


def test_refuses_to_average_runs_whose_configs_differ_and_names_the_keys(tmp_path):
    write_seed_run(tmp_path / "a", "seq_lora", 0, 80.0)
    write_seed_run(tmp_path / "b", "seq_lora", 1, 82.0, run={"threads": 2}, optim={"lr": 0.1})
    with pytest.raises(InputError, match=r"differ in config keys run.threads, optim.lr .*--ignore") as exc:
        _table([tmp_path])
    assert str(tmp_path / "a") in str(exc.value) and str(tmp_path / "b") in str(exc.value)
    with pytest.raises(InputError, match=r"differ in config keys optim.lr \("):
        _table([tmp_path], ignore=["run.threads"])
    t = _table([tmp_path], ignore=["run.threads", "optim.lr"], metrics=["acc"])
    assert t.groups[0].stats["acc"] == pytest.approx({"mean": 81.0, "se": 1.0, "n": 2})


def test_groups_may_differ_from_each_other(sweep):
    """pm and seq_lora differ in method.rank (a method's own option): that is what groups are for."""
    assert {g.label for g in _table([sweep]).groups} == {"seq_lora", "pm"}


def test_two_runs_with_the_same_config_and_seeds_are_refused(tmp_path):
    write_seed_run(tmp_path / "a", "seq_lora", 0, 80.0)
    write_seed_run(tmp_path / "copy", "seq_lora", 0, 80.0)
    with pytest.raises(InputError, match="seed=0, scenario.seed=0.*twice"):
        _table([tmp_path])


def test_run_directories_are_found_one_or_two_levels_down(tmp_path):
    write_seed_run(tmp_path / "sweep" / "cell", "seq_lora", 0, 80.0)
    write_seed_run(tmp_path / "study" / "sweep" / "cell", "seq_lora", 1, 82.0)
    write_seed_run(tmp_path / "deep" / "a" / "b" / "cell", "seq_lora", 2, 84.0)
    write_seed_run(tmp_path / "sweep" / ".cell.123.tmp", "seq_lora", 3, 0.0)  # hidden: a folder being written
    done, unfinished = tables.find_runs([tmp_path / "sweep", tmp_path / "study", tmp_path / "sweep" / "cell"])
    assert done == [tmp_path / "sweep" / "cell", tmp_path / "study" / "sweep" / "cell"] and unfinished == []
    with pytest.raises(InputError, match="no run directory"):
        tables.find_runs([tmp_path / "deep"])
    with pytest.raises(InputError, match="no such folder"):
        tables.find_runs([tmp_path / "nope"])


def test_unknown_metric_is_a_usage_error_listing_the_known_ones():
    assert tables.parse_metrics("acc, til_acc") == ["acc", "til_acc"]
    known = "known: acc, aaa, forgetting, bwt, fwt, plasticity, til_acc"
    with pytest.raises(UsageError, match=f"'acc_til'.*{known}"):
        tables.parse_metrics("acc,acc_til")


def test_unknown_group_key_and_reference(sweep):
    with pytest.raises(UsageError, match="--by: 'optim.lrr' is in no run"):
        _table([sweep], by=["optim.lrr"])
    with pytest.raises(UsageError, match="--vs sd_lora: no such group.*'pm'; 'seq_lora'"):
        _table([sweep], vs="sd_lora")


def test_a_metric_that_is_not_a_number_names_the_file_and_key(tmp_path):
    run = write_seed_run(tmp_path / "a", "seq_lora", 0, 80.0)
    (run / "metrics.json").write_text(json.dumps({"acc": "high"}))
    with pytest.raises(InputError, match=r"a/metrics.json: 'acc' should be a number"):
        _table([tmp_path], metrics=["acc"])


def test_csv_parses_back(sweep):
    text = tables.render(_table([sweep], vs="seq_lora"), "csv")
    rows = {r["method.name"]: r for r in csv.DictReader(io.StringIO(text))}
    assert float(rows["seq_lora"]["acc_mean"]) == 83.0
    assert float(rows["seq_lora"]["acc_se"]) == pytest.approx(math.sqrt(13 / 3))
    assert rows["pm"]["acc_n"] == "4" and rows["pm"]["runs"] == "4"
    assert float(rows["pm"]["d_acc_mean"]) == 4.0 and rows["pm"]["d_acc_n"] == "3"
    assert rows["seq_lora"]["d_acc_mean"] == "" and rows["pm"]["fwt_mean"] == ""


def test_json_parses_back(sweep):
    doc = json.loads(tables.render(_table([sweep], vs="seq_lora"), "json"))
    groups = {g["label"]: g for g in doc["groups"]}
    assert groups["pm"]["metrics"]["acc"]["mean"] == 88.0
    assert groups["pm"]["vs"]["acc"]["se"] == pytest.approx(1 / math.sqrt(3))
    assert groups["pm"]["unpaired"] == [str(sweep / "method.name=pm,seed=3")]
    assert groups["seq_lora"]["metrics"]["fwt"] == {"mean": None, "se": None, "n": 0}
    assert doc["skipped"] == [str(sweep / "method.name=pm,seed=9")] and doc["seeds_varied"] == ["seed"]


def test_markdown_rows_parse_back(sweep):
    text = tables.render(_table([sweep], vs="seq_lora"), "md")
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in text.splitlines() if ln.startswith("| ")]
    assert rows[0] == ["method.name", "runs", "acc", "til_acc", "fwt", "Δacc", "Δtil_acc", "Δfwt"]
    body = {r[0]: r for r in rows[1:]}
    assert body["seq_lora"][1:5] == ["3", "83.00 ± 2.08", "91.00 ± 0.58", "—"]
    assert body["pm"][5] == "+4.00 ± 0.58 (3)" and body["seq_lora"][5] == "reference"
    assert "- skipped (no metrics.json, unfinished): " + str(sweep / "method.name=pm,seed=9") in text


def test_terminal_table_keeps_numbers_whole_and_does_not_read_markup(tmp_path):
    write_seed_run(tmp_path / "a", "[bold]x[/bold]", 0, 80.0)
    text = tables.render(_table([tmp_path], metrics=["acc"]), "table", width=20)
    assert "[bold]x[/bold]" in text and "80.00" in text and "…" not in text


def test_the_reference_group_comes_first(sweep):
    assert [g.label for g in _table([sweep]).groups] == ["pm", "seq_lora"]  # in the order found
    assert [g.label for g in _table([sweep], vs="seq_lora").groups] == ["seq_lora", "pm"]


def test_ignore_takes_a_section_and_a_run_named_twice_counts_once(tmp_path):
    write_seed_run(tmp_path / "a", "seq_lora", 0, 80.0, run={"threads": 1, "progress": True})
    write_seed_run(tmp_path / "b", "seq_lora", 1, 82.0, run={"threads": 2, "progress": False})
    t = _table([tmp_path, tmp_path / "a", tmp_path / "." / "b"], ignore=["run"], metrics=["acc"])
    assert t.groups[0].stats["acc"] == pytest.approx({"mean": 81.0, "se": 1.0, "n": 2})


def test_config_values_that_are_not_json_are_compared_as_text(tmp_path):
    for s in (0, 1):
        run = write_seed_run(tmp_path / f"s{s}", "seq_lora", s, 80.0 + s)
        (run / "config.yaml").write_text((run / "config.yaml").read_text() + "note: 2026-11-25\n")  # a date
    assert _table([tmp_path], metrics=["acc"]).groups[0].stats["acc"]["n"] == 2
    (tmp_path / "s1" / "config.yaml").write_text((tmp_path / "s1" / "config.yaml").read_text()
                                                 .replace("2026-11-25", "2026-11-26"))
    with pytest.raises(InputError, match="differ in config keys note"):
        _table([tmp_path], metrics=["acc"])


def test_keys_that_differ_between_groups_are_noted_and_present_keys_are_named_first(tmp_path):
    write_seed_run(tmp_path / "a", "seq_lora", 0, 80.0, head={"classifier": "linear"})
    write_seed_run(tmp_path / "b", "pm", 0, 82.0, head={"classifier": "ncm"})
    t = _table([tmp_path], metrics=["acc"])
    assert t.between == ["head.classifier"]  # method.rank differs too: a method's own option, not noted
    assert "groups differ also in: head.classifier" in t.notes()
    write_seed_run(tmp_path / "c", "pm", 1, 82.0, optim={"lr": 0.1}, train={"epochs": 1})
    with pytest.raises(InputError, match=r"differ in config keys head.classifier, optim.lr, train.epochs "
                                         r"\(head.classifier: ncm in .*b, <absent> in .*c\)"):
        _table([tmp_path], metrics=["acc"])
