"""MagMax: the merge against a direct transcription (ties in magnitude and sign), the running fold against the
batch merge, the continual method's merged model against the merge of its sequential checkpoints, resume,
the CLI and the paper configs."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from clmerge import merging
from clmerge.cli import app
from clmerge.config import ConfigError, load_config, parse_config
from clmerge.engine.checkpoint import load_checkpoint
from clmerge.engine.run import prepare, run_experiment
from clmerge.merging.methods.magmax import max_magnitude_fold
from clmerge.methods.base import TaskContext
from clmerge.paper_configs import PAPER_DIR

from _lora_cl_helpers import assert_same_run, uncommit_checkpoint
from conftest import tiny_config

PAPER = PAPER_DIR


def transcribe(base: list[float], taus: list[list[float]], lam: float, tie_break: str) -> list[float]:
    """Paper Sec. 4 entry by entry: k = argmax_t |tau_t^p| (tied: the last or first such t), then
    theta_0 + lam tau_k."""
    out = []
    for p, b in enumerate(base):
        mags = [abs(tau[p]) for tau in taus]
        tied = [t for t, m in enumerate(mags) if m == max(mags)]
        k = tied[-1] if tie_break == "last" else tied[0]
        out.append(b + lam * taus[k][p])
    return out


def _tied_models(n_experts: int = 4, d: int = 300, seed: int = 0):
    """Base and experts whose task vectors take values in {0, +-1/4, +-1/2}: ties in magnitude everywhere, of
    equal and of opposite sign; every value is exact in float32, so results compare bit for bit."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(-32, 33, (d,), generator=g).float() / 8
    levels = torch.tensor([-0.5, -0.25, 0.0, 0.25, 0.5])
    taus = [levels[torch.randint(0, 5, (d,), generator=g)] for _ in range(n_experts)]
    # entry 0: a tie of opposite signs, entry 1: of equal signs
    taus[0][:2], taus[1][:2] = torch.tensor([0.5, 0.5]), torch.tensor([-0.5, 0.5])
    for tau in taus[2:]:
        tau[:2] = 0.25
    return base, taus


@pytest.mark.parametrize("tie_break", ["last", "first"])
@pytest.mark.parametrize("lam", [0.5, 1.0])
def test_merge_equals_transcription_with_ties(tie_break: str, lam: float) -> None:
    base, taus = _tied_models()
    experts = [{"w": (base + tau).reshape(20, 15)} for tau in taus]
    out = merging.merge("magmax", base={"w": base.reshape(20, 15)}, experts=experts, scaling=lam,
                        tie_break=tie_break)["w"].reshape(-1)
    want = torch.tensor(transcribe(base.tolist(), [t.tolist() for t in taus], lam, tie_break))
    assert torch.equal(out, want)
    # entry 0: +1/2 then -1/2 (opposite signs tie); entry 1: +1/2 twice
    assert out[0] == base[0] + lam * (-0.5 if tie_break == "last" else 0.5)
    assert out[1] == base[1] + lam * 0.5


def test_fold_is_the_batch_merge_and_tracks_sources() -> None:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(7, 9, generator=g)
    taus = [torch.randn(7, 9, generator=g) * (t + 1) / 4 for t in range(5)]
    running, sources = torch.zeros(7, 9), torch.full((7, 9), -1)
    for t, tau in enumerate(taus):
        running, taken = max_magnitude_fold(running, tau)
        sources[taken] = t
    batch = merging.magmax(base={"w": base}, experts=[{"w": base + tau} for tau in taus], scaling=1.0)["w"]
    torch.testing.assert_close(base + running, batch, atol=0, rtol=0)
    assert torch.equal(sources, torch.stack(taus).abs().argmax(0))  # distinct magnitudes: argmax is unique
    with pytest.raises(ValueError, match="tie_break"):
        merging.magmax(base={"w": base}, experts=[{"w": base}], tie_break="middle")


def test_cli_merge_files(tmp_path) -> None:
    base, taus = _tied_models(3)
    save_file({"w": base}, str(tmp_path / "base.safetensors"))
    args = ["merge", "--method", "magmax", "--base", str(tmp_path / "base.safetensors")]
    for i, tau in enumerate(taus):
        save_file({"w": base + tau}, str(tmp_path / f"e{i}.safetensors"))
        args += ["--expert", str(tmp_path / f"e{i}.safetensors")]
    out = tmp_path / "m.safetensors"
    r = CliRunner().invoke(app, [*args, "--out", str(out), "--set", "scaling=0.7",
                                 "--set", "tie_break=first"])
    assert r.exit_code == 0, r.output
    want = transcribe(base.tolist(), [t.tolist() for t in taus], 0.7, "first")
    torch.testing.assert_close(load_file(str(out))["w"], torch.tensor(want))
    bad = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "bad.safetensors"), "--set", "tie_break=mid"])
    assert bad.exit_code == 2 and "tie_break" in bad.output and not (tmp_path / "bad.safetensors").exists()


# -- the continual method ---------------------------------------------------------------------------------
def _context(scenario, t: int) -> TaskContext:
    return TaskContext(task=scenario.tasks[t], seen_tasks=scenario.tasks[: t + 1], device=torch.device("cpu"),
                       generator=torch.Generator().manual_seed(t), n_tasks=len(scenario))


def _backbone(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.backbone.named_parameters()}


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_method_evaluates_the_merge_of_its_sequential_models(finetune: str) -> None:
    """Hooks driven by hand, 3 tasks, the 'training' a random step from the current weights: the evaluated
    backbone is magmax(theta_0; theta_1..theta_t) after each t, the live model stays theta_t."""
    cfg = parse_config(tiny_config(**{"method": {"name": "magmax", "finetune": finetune, "rank": 2},
                                      "scenario.n_tasks": 3, "scenario.classes_per_task": [2, 2, 2]}))
    scenario, model, method, _ = prepare(cfg)
    theta0, models = _backbone(model), []
    g = torch.Generator().manual_seed(5)
    for t in range(3):
        method.begin_task(scenario.tasks[t], _context(scenario, t))
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:  # a sparse step: some entries keep their value (zero task-vector entries)
                    p.add_(torch.randn(p.shape, generator=g) * (torch.rand(p.shape, generator=g) < 0.7) * 0.1)
        method.end_task(scenario.tasks[t], _context(scenario, t))
        live = _backbone(model)
        merged_keys = set(method.theta0)
        models.append({k: v for k, v in live.items() if k in merged_keys})
        want = merging.magmax(base={k: theta0[k] for k in merged_keys}, experts=models, scaling=0.5)
        inf = dict(method.inference_model().backbone.named_parameters())
        for k, v in live.items():
            assert torch.equal(inf[k], want[k] if k in merged_keys else v), k
        assert all(torch.equal(a, b) for a, b in zip(method.inference_model().head.parameters(),
                                                     model.head.parameters()))
        taus = {k: torch.stack([m[k] - theta0[k] for m in models]) for k in merged_keys}
        won = torch.cat([(tau.abs() == tau.abs().amax(0)).flip(0).float().argmax(0).neg().add(t).reshape(-1)
                         for tau in taus.values()])  # last index of the largest magnitude
        changed = torch.cat([tau.ne(0).any(0).reshape(-1) for tau in taus.values()])
        rec = method.metrics()["merge"][t]
        want_shares = [float(((won == k) & changed).double().mean()) for k in range(t + 1)]
        assert rec["source_shares"] == pytest.approx(want_shares, abs=1e-12)
        assert rec["unchanged_share"] == pytest.approx(float((~changed).double().mean()), abs=1e-12)
        if t > 0:  # old tasks keep entries, the new one takes some: a real mixture
            assert sum(rec["source_shares"][:-1]) > 0.1 and rec["source_shares"][-1] > 0.1
    if finetune == "lora":
        assert all(k.endswith("base_layer.weight") for k in method.theta0)


def test_run_checkpoints_hold_the_merge_and_resume_is_identical(tmp_path) -> None:
    cfg = parse_config(tiny_config(**{"method": {"name": "magmax"}, "run.keep_checkpoints": 2}))
    a, b = tmp_path / "a", tmp_path / "b"
    full = run_experiment(cfg, a)
    states = [load_checkpoint(a / "checkpoints" / f"task_{t:03d}.safetensors") for t in range(2)]
    theta0 = {k[len("theta0/"):]: v for k, v in states[1][1].items() if k.startswith("theta0/")}
    running = {k[len("running/"):]: v for k, v in states[1][1].items() if k.startswith("running/")}
    experts = [{k: s[0][f"backbone.{k}"] for k in theta0} for s in states]  # sequential theta_1, theta_2
    assert not all(torch.equal(experts[0][k], experts[1][k]) for k in theta0)
    want = merging.magmax(base=theta0, experts=experts, scaling=1.0)
    for k in theta0:
        assert torch.equal(theta0[k] + running[k], want[k]), k
    merges = full["method_metrics"]["merge"]
    assert [m["task"] for m in merges] == [0, 1]
    assert merges[0]["source_shares"] == [1.0 - merges[0]["unchanged_share"]]
    assert sum(merges[1]["source_shares"]) + merges[1]["unchanged_share"] == pytest.approx(1.0)
    shutil.copytree(a, b)
    uncommit_checkpoint(b, "task_001.safetensors")
    (b / "metrics.json").unlink()
    resumed = run_experiment(cfg, b, resume=True)
    assert_same_run(full, resumed)
    again = load_checkpoint(b / "checkpoints" / "task_001.safetensors")[1]
    assert all(torch.equal(v, again[k]) for k, v in states[1][1].items())
    # `clmerge export` writes the model the run evaluated: theta_0 + tau_MagMax, not the last task's weights
    from clmerge.engine.export import load_run_model

    exported, lam = load_run_model(a)[0].backbone.state_dict(), cfg.method_options().scaling  # paper: 0.5
    assert all(torch.equal(exported[k], theta0[k] + lam * running[k]) for k in theta0)
    assert not all(torch.equal(exported[k], experts[1][k]) for k in theta0)


def test_options_and_paper_configs() -> None:
    with pytest.raises(ConfigError, match="scaling"):
        parse_config(tiny_config(method={"name": "magmax", "scaling": 0}))
    with pytest.raises(ConfigError, match="finetune"):
        parse_config(tiny_config(method={"name": "magmax", "finetune": "prompt"}))
    for n in (10, 20):
        cfg = load_config(PAPER / f"magmax_imagenet_r_{n}.yaml")
        o = cfg.method_options()
        assert (cfg.scenario.n_tasks, cfg.model.name, o.finetune, o.scaling, o.tie_break) == \
            (n, "vit-b16", "full", 0.5, "last")
        optim = (cfg.optim.name, cfg.optim.lr, cfg.optim.weight_decay, cfg.train.batch_size)
        assert optim == ("adamw", 1e-5, 0.1, 128)
