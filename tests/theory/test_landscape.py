"""benchmarks/lora_cl/landscape.py (SD-LoRA Fig. 4, P&M Fig. 2) on its smoke setting."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from clmerge.engine.evaluate import evaluate_tasks
from clmerge.engine.run import run_experiment
from clmerge.report.plots import PNG_SIGNATURE
from bench_helpers import load_bench


def _load():
    return load_bench("lora_cl", "landscape")


def _finite(values) -> bool:
    return bool(np.all(np.isfinite(np.asarray(values, dtype=float))))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("landscape")
    _load().main(["--smoke", "--out", str(out)])
    return out, json.loads((out / "landscape.json").read_text())


@pytest.mark.slow  # the benchmark's smoke run (module fixture, ~9 s on a loaded machine)
def test_files_written(smoke) -> None:
    out, _ = smoke
    for name in ("fig4_interpolation.png", "fig2_loss_plane.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
    assert not list(out.glob(".*.tmp"))  # atomic writes left no temporary files


@pytest.mark.slow  # the benchmark's smoke run (module fixture, ~9 s on a loaded machine)
def test_replot_rebuilds_from_json(smoke, tmp_path) -> None:
    out, r = smoke
    for name in ("landscape.json", "fig4_interpolation.png"):
        (tmp_path / name).write_bytes((out / name).read_bytes())
    again = _load().main(["--replot", "--out", str(tmp_path)])
    assert (tmp_path / "fig2_loss_plane.png").read_bytes().startswith(PNG_SIGNATURE)
    assert again["fig2"]["pm"]["summary_ce_til"] == r["fig2"]["pm"]["summary_ce_til"]


@pytest.mark.slow  # the benchmark's smoke run (module fixture, ~9 s on a loaded machine)
def test_fig4_numbers(smoke) -> None:
    _, r = smoke
    assert r["setting"]["smoke"] is True and r["setting"]["fig4_split"] == "test"
    assert set(r["fig4"]) == {"sd_lora", "seq_lora"}
    for d in r["fig4"].values():
        assert d["lambdas"] == [0.0, 0.5, 1.0]
        for key in ("t1_acc", "t2_acc", "t1_til_acc", "t2_til_acc"):
            assert len(d[key]) == 3 and _finite(d[key])
            assert all(0.0 <= v <= 100.0 for v in d[key])
        assert d["relative_distance"] > 0  # task 2 moved the backbone
    assert len(r["fig4"]["sd_lora"]["method_metrics"]["magnitudes"]) == 2


@pytest.mark.slow  # the benchmark's smoke run (module fixture, ~9 s on a loaded machine)
def test_fig2_numbers(smoke) -> None:
    _, r = smoke
    assert set(r["fig2"]) == {"pm", "pm_m"}
    assert r["fig2"]["pm_m"]["method"] == {"name": "pm", "perturbation": "none"}
    for d in r["fig2"].values():
        assert d["split"] == "val" == r["setting"]["fig2_split"]
        assert d["alphas"] == d["betas"] == [0.0, 0.5, 1.0, 1.5]
        for key in ("ce", "ce_til"):
            z = np.asarray(d[key])
            assert z.shape == (4, 4) and _finite(z) and (z > 0).all()
            s = d[f"summary_{key}"]
            assert 0.0 <= s["line_min_lambda"] <= 1.0 and 0.0 <= s["valley_fraction"] <= 1.0
            assert s["excess_at_alpha_star"] >= 0.0
            assert s["line_min"] <= s["at_alpha_star"] and s["line_min"] <= min(s["at_lambda0"], s["at_lambda1"])
            assert math.isclose(s["plane_min"], z.min())
        assert 0.0 <= d["alpha_star"] <= 1.0 and math.isfinite(d["alpha_star_raw"])
        assert len(d["alpha_per_task"]) == 2 and d["alpha_per_task"][0] == 1.0  # P&M: alpha*_1 = 1
        # pm's merged backbone is exactly theta^_1 + alpha* (theta*_2 - theta^_1): the snapshot is the unmerged optimum
        assert d["merge_check_max_abs_diff"] < 1e-5
        line = d["line"]
        assert d["alpha_star"] in line["lambdas"] and len(line["ce_til"]) == len(line["lambdas"])
        # the plane's corners on the convex line are the line's endpoints
        i1 = d["alphas"].index(1.0)
        assert math.isclose(d["ce_til"][0][i1], line["ce_til"][-1], rel_tol=1e-9)
        assert math.isclose(d["ce_til"][i1][0], line["ce_til"][0], rel_tol=1e-9)


def test_training_matches_clmerge_run(tmp_path) -> None:
    """The script's two-task loop gives the same model as ``clmerge run`` after task 2."""
    mod = _load()
    cfg = mod.make_config({"name": "seq_lora"}, seed=0, epochs=1, lr=5e-3, val_fraction=0.1, smoke=True)
    r = mod.train_two_tasks(cfg)
    tasks = r["scenario"].tasks[:2]
    mine = [e["acc"] for e in evaluate_tasks(r["method"].inference_model(), tasks, n_outputs=4)]
    ours = [e["acc"] for e in mod.evaluate(r["net"], r["after"][1], tasks, mod.cached_batches(tasks, "test"), "cpu")]
    engine = run_experiment(cfg, tmp_path / "run")["accuracy_matrix"][1][:2]
    assert mine == engine == ours
