"""Studies end to end: the shipped smoke spec (tiny random-init ViT), resume, and local == Ray."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.sweep import finish_study
from clmerge.sweep import read_results, run_study
from clmerge.sweep import study as study_mod
from clmerge.theory.spec import load_study, parse_study

from executor_helpers import FakeRay as _FakeRay

ROOT = Path(__file__).resolve().parents[2]
TINY = "{num_hidden_layers: 1, hidden_size: 32, num_attention_heads: 2, intermediate_size: 64}"
SMOKE_OVERRIDES = ["base.pretrained=false", f"base.arch={TINY}", "seeds=[0]",
                   "methods=[{name: weight_average}, {name: ties, density: 0.2}]", "data.max_train=48",
                   "data.max_eval=24", "measure.noise_samples=6", "grid.steps=[2, 4, 8]", "defaults.steps=4",
                   "measure.weighting_steps=[2, 8]",
                   "suite=[digits:identity, digits:rot90, digits:rot180, digits:invert, digits:perm1]"]


def _strip(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "timings"} for r in rows]


def _approx(v):
    """``v`` with every float compared to 1e-9 relative: a least-squares solve (the implicit weights) may
    differ in the last bits between two runs of the same code, as multithreaded BLAS sums in another order."""
    if isinstance(v, float):
        return pytest.approx(v, rel=1e-9, abs=1e-12)
    if isinstance(v, list):
        return [_approx(x) for x in v]
    if isinstance(v, dict):
        return {k: _approx(x) for k, x in v.items()}
    return v


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    spec = load_study(ROOT / "benchmarks" / "study_smoke.yaml", SMOKE_OVERRIDES)
    rows = run_study(spec, out, log=lambda *_: None)
    fits = finish_study(out, n_boot=30)
    return out, spec, rows, fits


def test_the_smoke_study_fits_every_law(smoke):
    out, spec, rows, fits = smoke
    assert set(fits["laws"]) == {"steps", "lr", "batch_size", "data_ratio", "n_experts"}
    assert all(set(per) == {"weight_average", "ties"} for per in fits["laws"].values())
    assert {"lr", "steps", "n_train"} <= set(fits["stability"])
    assert fits["sparsification"]["ties"]["n"] > 0
    assert len(fits["weighting"]["measured"]) == 2 and fits["weighting"]["predicted"] == [0.2, 0.8]
    r = rows[0]
    for key in ("merged_loss", "merged_acc", "sigma2", "zeta2", "het_before", "het_after", "stability_sq",
                "experts", "timings", "lr", "steps", "batch_size", "data_ratio", "optimizer", "n_experts"):
        assert key in r
    assert len(r["experts"]) == r["n_experts"] == len(r["sigma2"])
    html = (out / "report.html").read_text()
    assert html.count("<img") >= 6 and "Fitted laws" in html
    assert json.loads((out / "fits.json").read_text())["laws"]["lr"]["weight_average"]["equation"] == "c0 + c2*eta^2"


def test_predict_and_advise_commands(smoke):
    out = smoke[0]
    runner = CliRunner()
    res = runner.invoke(app, ["predict", str(out), "lr=0.03", "--method", "weight_average"])
    assert res.exit_code == 0, res.output
    assert "merged loss" in res.output and "[" in res.output
    bad = runner.invoke(app, ["predict", str(out), "momentum=0.9"])
    assert bad.exit_code == 2 and "no fitted law" in bad.output
    adv = runner.invoke(app, ["advise", str(out)])
    assert adv.exit_code == 0 and "dominates" in adv.output
    # a random-init one-layer ViT after a few steps merges at chance: no model is called best
    assert adv.output.startswith("No merged model is called best: every merged loss is near chance")


def test_resume_skips_finished_points(smoke, monkeypatch):
    out, spec, rows, _ = smoke
    with pytest.raises(FileExistsError):
        run_study(spec, out, log=lambda *_: None)
    calls = []
    real = study_mod.merge_job
    monkeypatch.setattr(study_mod, "merge_job", lambda *a: calls.append(a[0]["method"]["name"]) or real(*a))
    monkeypatch.setattr(study_mod, "expert_job", lambda *a: pytest.fail("retrained a cached expert"))
    assert _strip(run_study(spec, out, resume=True, log=lambda *_: None)) == _approx(_strip(rows))
    assert calls == []
    lines = (out / "results.jsonl").read_text().splitlines()
    (out / "results.jsonl").write_text("\n".join(lines[:-3]) + "\n" + lines[-3][:20])  # a torn line too
    again = run_study(spec, out, resume=True, log=lambda *_: None)
    assert len(calls) == 3 and _strip(again) == _approx(_strip(rows))


def _two_point_spec():
    return parse_study({
        "base": {"pretrained": False, "arch": {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
                                               "intermediate_size": 64}},
        "suite": "tiny", "data": {"max_train": 32, "max_eval": 16},
        "defaults": {"steps": 3, "n_experts": 2, "batch_size": 8, "lr": 0.05},
        "methods": [{"name": "weight_average"}, {"name": "dare", "drop_rate": 0.3}],
        "measure": {"noise_samples": 4}})


@pytest.mark.slow  # a real local Ray cluster: its start-up took 6 minutes on a loaded 2-core machine
def test_a_two_point_study_is_identical_on_local_and_ray(tmp_path):
    pytest.importorskip("ray")
    spec = _two_point_spec()
    local = run_study(spec, tmp_path / "local", log=lambda *_: None)
    ray_rows = run_study(spec, tmp_path / "ray", backend="ray", num_cpus=2, log=lambda *_: None)
    assert len(local) == 2
    assert _strip(local) == _approx(_strip(ray_rows))
    assert _strip(read_results(tmp_path / "ray")) == _approx(_strip(local))


def test_the_ray_backend_protocol_gives_the_local_rows(tmp_path, monkeypatch):
    """The fast tier's check of the Ray backend: the real ``RayExecutor`` and scheduler on an in-process Ray
    stand-in (the real cluster is the slow test above)."""
    fake = _FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    spec = _two_point_spec()
    local = run_study(spec, tmp_path / "local", log=lambda *_: None)
    ray_rows = run_study(spec, tmp_path / "ray", backend="ray", num_cpus=2, log=lambda *_: None)
    assert len(local) == 2 and fake.calls >= 4 and not fake.initialized  # experts + merges ran; shut down
    assert _strip(local) == _approx(_strip(ray_rows))
    assert _strip(read_results(tmp_path / "ray")) == _approx(_strip(local))

