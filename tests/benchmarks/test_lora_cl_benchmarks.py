"""The evidence and speed scripts of benchmarks/lora_cl run on a tiny setting; the combined data source."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clmerge.data import build_dataset
from bench_helpers import load_bench


def _load(name: str):
    return load_bench("lora_cl", name)


def _has_fmnist() -> bool:
    try:
        build_dataset("fashion_mnist")
        return True
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not _has_fmnist(), reason="Fashion-MNIST IDX files not installed")
def test_mnist5k_fmnist20_source() -> None:
    s = build_dataset("mnist5k_fmnist20")
    m = build_dataset("mnist5k")
    assert s.num_classes == 20 and len(s.class_names) == 20
    ytr, yte = s.train.targets, s.test.targets
    assert len(ytr) == len(m.train) + 4000 and len(yte) == len(m.test) + 1000
    assert np.bincount(ytr[ytr >= 10] - 10).tolist() == [400] * 10
    x, _ = s.train.get_batch(np.asarray([0, len(ytr) - 1]))
    assert x.shape == (2, 1, 28, 28) and 0 <= float(x.min()) and float(x.max()) <= 1
    again = build_dataset("mnist5k_fmnist20")
    assert np.array_equal(again.train.targets, ytr)


def test_evidence_config_holds_out_validation() -> None:
    ev = _load("run_evidence")
    cfg = ev.make_config("split_mnist5k", "pm_gauss", 1, 5e-3, smoke=False)
    assert cfg["scenario"]["val_fraction"] > 0
    assert cfg["method"] == {"name": "pm", "perturbation": "gaussian", "targets": ["key", "value"]}
    assert cfg["head"] == {"compare": True}
    from clmerge.config import parse_config

    sites = set()
    for label in ev.METHODS:
        resolved = parse_config(ev.make_config("mnist_fmnist10", label, 0, 1e-3, smoke=True))
        o = resolved.method_options()
        if label in ev.NO_LORA_SITES:  # a baseline on its own paper's sites (cl_lora: query and value)
            continue
        if hasattr(o, "targets") and getattr(o, "variant", "lora") == "lora":  # every LoRA method: same sites
            sites.add(tuple(o.targets))  # (ranpac's first session is an adapter here: its targets are unused)
    assert sites == {("key", "value")}


def test_text_benchmark_config_and_grid(tmp_path) -> None:
    """wordnet10 (the text regime) runs MiniLM on the WordNet source with its own LoRA grid."""
    from clmerge.config import parse_config

    ev = _load("run_evidence")
    cfg = parse_config(ev.make_config("wordnet10", "pm", 0, 1e-3, smoke=False))
    assert (cfg.model.name, cfg.scenario.dataset, cfg.scenario.n_tasks) == ("minilm-l6", "wordnet_supersense", 10)
    assert cfg.scenario.options["max_length"] == 32 and cfg.method_options().fisher_samples == 256
    assert parse_config(ev.make_config("split_mnist5k", "pm", 0, 1e-3, smoke=False)).method_options().fisher_samples is None
    assert ev.lr_grid("wordnet10", "seq_lora") == ev.TEXT_LORA_LRS != ev.lr_grid("split_mnist5k", "seq_lora")
    assert ev.lr_grid("wordnet10", "finetune") == ev.FULL_LRS
    assert "wordnet10" not in ev.DEFAULT_BENCHMARKS


def test_each_method_is_a_sweep_spec_with_the_class_order_linked_to_the_seed(tmp_path) -> None:
    """run_evidence.py builds clmerge sweep specs: one cell per seed, scenario.seed following seed (as the
    script's runs always had it), and the learning rate chosen by the sweep's select: block at seed 0."""
    from clmerge.sweep.grid import expand_cells, spec_from_dict

    ev = _load("run_evidence")
    spec = spec_from_dict(ev._spec(tmp_path / "base.yaml", [0, 1, 2], ev.LORA_LRS))
    assert [c.overrides for c in expand_cells(spec)] == [{"seed": s, "scenario.seed": s} for s in (0, 1, 2)]
    assert (spec.select.key, spec.select.values, spec.select.seeds) == ("optim.lr", ev.LORA_LRS, [0])
    assert spec.select.extend == ev.EXTEND and spec_from_dict(ev._spec(tmp_path, [0], None)).select is None


def test_reuse_selection_takes_the_stored_rate_and_never_the_image_rate_for_text(tmp_path) -> None:
    ev = _load("run_evidence")
    with pytest.raises(ValueError, match="no learning rate for seq_lora on wordnet10"):
        ev.reused_selection(tmp_path, ["wordnet10"], ["seq_lora"])
    got = ev.reused_selection(tmp_path, ["split_mnist5k"], ["seq_lora"])
    assert got["split_mnist5k"]["seq_lora"] == {"lr": ev.LINEAR_HEAD_SELECTION["seq_lora"],
                                            "selected_on": "linear-head grid selection"}
    stored = {"wordnet10": {"seq_lora": {"lr": 0.003, "val_acc": {"0.003": 23.2}}},
              "split_mnist5k": {"seq_lora": {"lr": 0.01, "val_acc": {"0.01": 50.0}}}}
    (tmp_path / "selected.json").write_text(json.dumps(stored))
    got = ev.reused_selection(tmp_path, ["wordnet10", "split_mnist5k"], ["seq_lora"])
    assert got == stored


@pytest.mark.slow  # the whole evidence pipeline, 9 short runs: 20-30 s on a loaded 2-core machine
def test_evidence_smoke_runs_selects_on_val_and_resumes(tmp_path) -> None:
    ev = _load("run_evidence")
    args = ["--smoke", "--methods", "sd_lora_kd,pm", "--seeds", "0",
            "--benchmarks", "split_mnist5k", "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "r.md"),
            "--figures", str(tmp_path / "fig")]
    ev.main(args)
    text = (tmp_path / "r.md").read_text()
    for label in ("sd_lora_kd", "pm"):
        for head in ("linear", "linear+align", "ncm", "ranpac"):
            assert f"| {label} | {head} |" in text
    ranking = text[text.index("## Validation ranking (split_mnist5k)"):]
    assert "| sd_lora_kd + ranpac |" in ranking and "| pm + linear |" in ranking and "| 8 |" in ranking
    sel = json.loads((tmp_path / "runs" / "selected.json").read_text())
    # sd_lora_kd is a variant: its parent sd_lora is selected and sd_lora_kd takes the parent's rate
    assert set(sel["split_mnist5k"]) == {"sd_lora_kd", "pm", "sd_lora"}
    assert sel["split_mnist5k"]["sd_lora_kd"]["lr"] == sel["split_mnist5k"]["sd_lora"]["lr"]
    assert "sd_lora" in sel["split_mnist5k"]["sd_lora_kd"]["selected_on"]
    assert not (tmp_path / "runs" / "main" / "split_mnist5k" / "sd_lora_kd" / "select").exists()
    assert (tmp_path / "runs" / "select-only" / "split_mnist5k" / "sd_lora" / "selected.json").is_file()
    # the selection read each run's validation accuracy from metrics.json (recorded per head with head.compare)
    pm = tmp_path / "runs" / "main" / "split_mnist5k" / "pm"
    run = json.loads((pm / "select" / "seed0-lr0.002" / "metrics.json").read_text())
    assert sel["split_mnist5k"]["pm"]["val_acc"]["0.002"] == run["heads"]["linear"]["val_acc"]
    assert (tmp_path / "fig" / "split_mnist5k_pm_alpha.png").exists()
    assert (tmp_path / "fig" / "split_mnist5k_sd_lora_kd_kd.png").exists()
    done = tmp_path / "runs" / "main" / "split_mnist5k" / "pm" / "seed0" / "metrics.json"
    stamp = done.stat().st_mtime_ns
    ev.main(args)  # everything finished: nothing reruns
    assert done.stat().st_mtime_ns == stamp


def test_validation_ranking_is_best_first_over_finished_seeds(tmp_path) -> None:
    rep = _load("evidence_report")
    val = {"a": [30.0, 40.0], "b": [50.0], "c": [10.0, 20.0, 90.0]}
    for m, vs in val.items():
        for i, v in enumerate(vs):
            run = tmp_path / "main" / "bench" / m / f"seed{i}"
            run.mkdir(parents=True)
            (run / "metrics.json").write_text("{}")
            (run / "v").write_text(str(v))
    (tmp_path / "main" / "bench" / "a" / "seed9").mkdir()  # unfinished: no metrics.json, not counted
    rows = rep.validation_ranking(tmp_path, "bench", lambda r, head: float((r / "v").read_text()))
    # runs without head.compare count for their own head only (linear in the older runs)
    assert [(m, n) for m, _, _, n in rows] == [("b + linear", 1), ("c + linear", 3), ("a + linear", 2)]
    assert rows[1][1] == pytest.approx(40.0) and rows[2][2] == pytest.approx(5.0)


@pytest.mark.slow  # times every method: 10-17 s on a loaded 2-core machine
def test_speed_smoke(tmp_path) -> None:
    sp = _load("speed")
    out = tmp_path / "speed.md"
    sp.main(["--smoke", "--out", str(out), "--tmp", str(tmp_path / "tmp")])
    text = out.read_text()
    assert "ratio to seq_lora" in text and "| pm (running sums) |" in text and "speed-up" in text
    row = next(line for line in text.splitlines() if line.startswith("| pm (running sums) |"))
    vals = [float(v) for v in row.strip("|").split("|")[1:]]
    assert len(vals) == 3 and vals[1] == vals[2]  # running sums: constant memory after the first task


def test_archive_keeps_runs_whose_directories_are_gone(tmp_path) -> None:
    rep = _load("evidence_report")
    heads = lambda acc, val: {h: {"acc": acc, "aaa": acc, "til": {"acc": acc, "aaa": acc}, "val_acc": val}  # noqa: E731
                              for h in rep.HEADS}
    run = tmp_path / "main" / "bench" / "m" / "seed1"
    run.mkdir(parents=True)
    (run / "metrics.json").write_text(json.dumps({"heads": heads(60.0, 55.0)}))
    # seed 0 lives only in the archive; seed 1's archived copy is stale and the run directory must win
    archive = {"bench": {"m": {"seed0": {"heads": heads(40.0, 35.0)}, "seed1": {"heads": heads(1.0, 1.0)}}}}
    data = rep.collect(tmp_path, archive)
    assert [r["heads"]["ncm"]["acc"] for r in data["bench"]["m"]] == [40.0, 60.0]
    rows = rep.validation_ranking(tmp_path, "bench", lambda r, head: 55.0 if r == run else None, archive)
    assert rows[0][1:] == (pytest.approx(45.0), pytest.approx(10.0), 2)
    path = tmp_path / "runs.json"
    rep.write_archive(tmp_path, path, archive)
    again = rep.load_archive(path)
    assert again["bench"]["m"]["seed1"]["heads"]["linear"]["acc"] == 60.0
    assert again["bench"]["m"]["seed0"]["heads"]["linear"]["acc"] == 40.0
    assert rep.load_archive(tmp_path / "absent.json") == {}


def _planted(acc: float, *, variant: str = "linear", til: float = 90.0, heads: bool = False) -> dict:
    """A run's metrics.json with planted numbers: ``acc`` for the primary head (and every shared head)."""
    one = {"acc": acc, "aaa": acc + 10, "til": {"acc": til, "aaa": til}, "val_acc": acc - 1}
    run = {**one, "head": {"variant": variant}, "timings": {"total_s": 100.0}}
    if heads:
        run["heads"] = {h: dict(one) for h in ("linear", "linear+align", "ncm", "ranpac")}
    return run


def test_baselines_config_uses_each_papers_head_and_selects_on_it() -> None:
    """The baselines run with their papers' heads (the primary head, which the sweep's selection scores),
    the four shared heads where the method allows them, and the default 200-example buffer for rehearsal."""
    import clmerge.methods  # noqa: F401  (registers the methods the config names)
    from clmerge.config import parse_config

    ev = _load("run_evidence")
    got = {m: parse_config(ev.make_config("split_mnist5k", m, 0, 1e-3, smoke=False)) for m in ev.CL_BASELINES}
    assert {m: (c.head.classifier, c.head.align, c.head.compare) for m, c in got.items()} == {
        "simplecil": ("ncm", False, False), "ranpac": ("ranpac", False, False), "aper": ("ncm", False, False),
        "ranpac_rp": ("ranpac", False, False), "aper_finetune": ("ncm", False, False),
        "ease": ("linear", False, False), "mos": ("linear", False, False), "slca": ("linear", True, True),
        "er": ("linear", False, True), "der": ("linear", False, True), "derpp": ("linear", False, True),
        "lae": ("linear", False, False), "fecam": ("linear", False, False),  # their own heads alone
        "cl_lora": ("linear", False, False),  # its diagonal prototype classifier alone
        "lwf": ("linear", False, True), "xder": ("linear", False, True),
        "er_ace": ("linear", False, False), "icarl": ("linear", False, False)}  # cosine / NME classifiers: alone
    assert all(got[m].method_options().buffer_size == 200 for m in ("er", "der", "derpp"))
    assert ev.lr_grid("split_mnist5k", "simplecil") == [] == ev.lr_grid("split_mnist5k", "ranpac_rp")
    assert ev.LR_FROM["ranpac"] == "aper"  # the same first-session adapter and head: aper's selected rate
    assert ev.lr_grid("split_mnist5k", "er") == ev.FULL_LRS and len(ev.lr_grid("split_mnist5k", "ease")) == 3
    assert "der" not in ev.LR_FROM and "derpp" not in ev.LR_FROM  # each selects its own rate, as er does
    assert ev.lr_grid("split_mnist5k", "der") == ev.lr_grid("split_mnist5k", "derpp") == ev.FULL_LRS


def test_untrained_baselines_take_no_rate_and_reuse_refuses_unselected_ones(tmp_path) -> None:
    ev = _load("run_evidence")
    assert ev._fixed_rate({}, "split_mnist5k", "simplecil", "split_mnist5k", True) == ev.UNTRAINED
    assert ev._fixed_rate({"split_mnist5k": {"sd_lora": {"lr": 3e-4}}}, "split_mnist5k", "sd_lora_kd",
                          "split_mnist5k", True) == {"lr": 3e-4, "selected_on": "sd_lora's selection"}
    got = ev.reused_selection(tmp_path, ["split_mnist5k"], ["simplecil"])
    assert got == {"split_mnist5k": {"simplecil": ev.UNTRAINED}}
    with pytest.raises(ValueError, match="no learning rate for ease on split_mnist5k"):
        ev.reused_selection(tmp_path, ["split_mnist5k"], ["ease"])


def test_baselines_section_reports_se_rates_and_claim_verdicts_on_planted_numbers(tmp_path) -> None:
    rep = _load("evidence_report")
    seeds = ("seed0", "seed1", "seed2")
    plant = {"simplecil": ([50, 52, 54], "ncm", False), "aper": ([51, 52, 53], "ncm", False),
             "ease": ([60, 61, 62], "linear", False), "l2p": ([20, 21, 22], "linear", True),
             "er": ([30, 31, 29], "linear", True), "derpp": ([40, 42, 44], "linear", True),
             "seq_lora": ([28, 29, 30], "linear", True), "sd_lora": ([29, 28, 27], "linear", True),
             "pm": ([41, 43, 45], "linear", True), "frozen": ([32, 33, 34], "linear", True)}
    archive = {"bench": {m: {s: _planted(a, variant=v, heads=h) for s, a in zip(seeds, accs)}
                         for m, (accs, v, h) in plant.items()},
               "other": {"simplecil": {"seed0": _planted(50.0, variant="ncm")}}}
    archive["bench"]["er"]["seed0"]["timings"] = {"total_s": 5650.0}  # one seed ran under heavy load
    (tmp_path / "selected.json").write_text(json.dumps({"bench": {
        "er": {"lr": 3e-4, "val_acc": {"0.0001": 25.0, "0.0003": 30.5, "0.001": 28.25}},
        "derpp": {"lr": 3e-4, "selected_on": "er's selection"},
        "simplecil": {"lr": None, "selected_on": "trains nothing"}}}))
    path = tmp_path / "results.md"
    rep.write_results(tmp_path, path, ["bench", "other"], list(plant), archive=archive, val_fn=lambda r, h: None,
                      rank_on="bench", baselines=["simplecil", "aper", "ease", "mos", "er", "derpp"])
    text = path.read_text()
    main, section = text.split("## Continual-learning baselines")
    assert "| simplecil |" not in main and "simplecil + " not in main and "| seq_lora | linear |" in main
    # mean ± standard error (sample std / sqrt(n)): 52 ± 2/sqrt(3); TIL and AAA too; the rate and its scores
    assert "| simplecil | cosine prototypes | 52.00 ± 1.15 | 62.00 ± 1.15 | 90.00 ± 0.00 | 90.00 ± 0.00 | 3 | " \
           "— (trains nothing) |  | 100 |" in section
    assert "| er | linear | 30.00 ± 0.58 |" in section
    assert [ln for ln in section.splitlines() if ln.startswith("| er | linear")][0].endswith("| 100 |")  # fastest seed
    assert "| 0.0003 | 0.0001: 25.00; 0.0003: 30.50; 0.001: 28.25 |" in section
    assert "| derpp | linear | 42.00 ± 1.15 |" in section and "0.0003 (er's selection)" in section
    assert "| frozen | ranpac | 33.00 ± 0.58 |" in section  # the reference row: the frozen backbone's RanPAC head
    assert "| er | 30.00 ± 0.58 / 90.00 ± 0.00 |" in section  # the four shared heads, where recorded
    bench, other = section.split("### other")
    claims = bench[bench.index("Claims"):].splitlines()
    pilot = next(line for line in claims if "PILOT" in line)
    # mos is missing: the measured pairs all hold, so the claim is not resolved, partly measured
    assert "not resolved; partly measured (missing: mos)" in pilot
    assert "  - ease − simplecil: +9.00 ± 0.58 (+10.0, +9.0, +8.0; holds" in bench
    assert "  - mos − aper: not measured" in bench
    rehearsal = next(line for line in claims if "rehearsal" in line)
    assert "does not hold" in rehearsal  # er − pm: -12 ± 0.58
    assert "  - er − seq_lora: +1.00 ± 1.00 (+2.0, +2.0, -1.0; not resolved" in bench
    seeds_claim = next(line for line in claims if "SD-LoRA / P&M" in line)
    assert "does not hold" in seeds_claim
    assert "**rehearsal with a small buffer (er, derpp) beats rehearsal-free LoRA (seq_lora, sd_lora, pm) on CIL**: " \
           "not measured (missing: derpp, er, pm, sd_lora, seq_lora)." in other
    assert "| simplecil | cosine prototypes | 50.00 | " in other  # one seed: the mean alone


def test_validation_accuracy_of_a_run_of_its_own_head_alone_is_its_recorded_one(tmp_path) -> None:
    """A baseline without head.compare (SimpleCIL's prototypes) records head.val_acc for its own head only: the
    ranking reads it instead of rebuilding the run (which has no config here to rebuild from)."""
    ev = _load("run_evidence")
    (tmp_path / "metrics.json").write_text(json.dumps({"head": {"variant": "ncm", "val_acc": 42.5}}))
    assert ev.val_accuracy(tmp_path, "ncm") == 42.5


@pytest.mark.slow  # 6 short runs: 1-2 min on a loaded 2-core machine
def test_evidence_smoke_runs_baselines_into_their_section(tmp_path) -> None:
    """simplecil trains nothing (no selection, one run per seed); derpp selects its own rate on validation (its
    phase 1 under select/); both land in the baselines' section, not in the per-head tables."""
    ev = _load("run_evidence")
    ev.main(["--smoke", "--methods", "simplecil,derpp", "--seeds", "0,1", "--benchmarks", "split_mnist5k",
             "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "r.md"), "--figures", str(tmp_path / "f")])
    main, section = (tmp_path / "r.md").read_text().split("## Continual-learning baselines")
    assert "| simplecil |" not in main and "| derpp |" not in main
    assert "| simplecil | cosine prototypes |" in section and "| 2 | — (trains nothing) |" in section
    sel = json.loads((tmp_path / "runs" / "selected.json").read_text())["split_mnist5k"]
    assert sel["derpp"]["lr"] == ev.FULL_LRS[0] and list(sel["derpp"]["val_acc"]) == [f"{ev.FULL_LRS[0]:g}"]
    assert "er" not in sel and not (tmp_path / "runs" / "select-only").exists()
    assert "| derpp | linear |" in section and f"| {ev.FULL_LRS[0]:g} | {ev.FULL_LRS[0]:g}: " in section
    assert (tmp_path / "runs" / "main" / "split_mnist5k" / "derpp" / "select").is_dir()
    assert not (tmp_path / "runs" / "main" / "split_mnist5k" / "simplecil" / "select").exists()
    assert "- **rehearsal with a small buffer (er, derpp) beats rehearsal-free LoRA (seq_lora, sd_lora, pm) on " \
           "CIL**: not measured (missing: er, pm, sd_lora, seq_lora)." in section


def test_set_overrides_reach_every_run_config(tmp_path, monkeypatch) -> None:
    """``--set KEY=VALUE`` (e.g. the rehearsal head convention) is applied to the sweep's base config."""
    import yaml

    import clmerge.sweep

    ev = _load("run_evidence")
    monkeypatch.setattr(clmerge.sweep, "run_sweep", lambda spec, out, **kw: None)
    monkeypatch.setattr(ev, "OVERRIDES", ["method.head_convention=grow", "head.ranpac_dim=2000"])
    ev.run_sweep_of(tmp_path, "split_mnist5k", "er", [0], 1e-4, jobs=1, smoke=True)
    base = yaml.safe_load((tmp_path / "specs" / "split_mnist5k-er.yaml").read_text())
    assert base["method"]["head_convention"] == "grow" and base["head"] == {"compare": True, "ranpac_dim": 2000}
    assert base["method"]["buffer_size"] == 16  # the rest of the smoke config as make_config builds it
