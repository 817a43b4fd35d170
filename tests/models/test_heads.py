"""Heads for class-incremental runs: NCM, RanPAC, SLCA alignment, shadow comparison, resume."""

import json

import pytest
import torch
import torch.nn.functional as F
import yaml
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.config import ConfigError, parse_config
from clmerge.engine.heads import extract_features
from clmerge.engine.run import prepare_run, resolve_device, restore, run_experiment
from clmerge.models.classifier import IncrementalHead
from clmerge.models.heads import RANPAC_RIDGES, ClassFeatureStats, NCMHead, RanPACHead, align_linear_head, \
    ridge_grid_choice
from conftest import tiny_config

SMALL = {"head.ranpac_dim": 64, "head.align_samples": 32, "head.align_epochs": 2}


def _cfg(**kw):
    return parse_config(tiny_config(**{**SMALL, **kw}))


def _strip(m: dict) -> dict:
    """Metrics without wall-clock fields."""
    m = json.loads(json.dumps(m))
    m.pop("timings")
    m.get("head", {}).pop("seconds_per_task", None)
    return m


# -- NCM ----------------------------------------------------------------------------------------------------
def test_ncm_logits_are_cosines_to_hand_computed_class_means():
    g = torch.Generator().manual_seed(0)
    feats, labels = torch.randn(30, 5, generator=g), torch.tensor([0, 1, 2] * 10)
    stats = ClassFeatureStats(5, cov="none")
    stats.update(feats, labels)
    x = torch.randn(7, 5, generator=g)
    means = torch.stack([feats[labels == c].mean(0) for c in range(3)])
    want = torch.tensor([[float(F.cosine_similarity(xi, m, dim=0)) for m in means] for xi in x])
    got = NCMHead(stats).logits(x, 4)
    assert torch.allclose(got[:, :3], want.to(got.dtype), atol=1e-6) and torch.isinf(got[:, 3]).all()
    eu = NCMHead(stats, "euclidean").logits(x, 3)
    assert torch.allclose(eu, -torch.cdist(x, means.float()) ** 2, atol=1e-5)


def test_ncm_run_matches_class_means_of_the_final_backbone(tmp_path):
    """Last accuracy row of an ncm run = nearest cosine class mean, recomputed by hand from the checkpoint."""
    cfg = _cfg(**{"head.classifier": "ncm", "run.keep_checkpoints": 3})
    metrics = run_experiment(cfg, tmp_path / "r")
    assert metrics["head"]["variant"] == "ncm"
    run = prepare_run(cfg, tmp_path / "r", resolve_device("cpu"), heads=False)
    restore(run)
    scenario, model, method = run.scenario, run.model, run.method
    model.eval()
    # each task's means come from the backbone at the end of that task; the final checkpoint's backbone is the
    # one that produced the last task's means, so those are recomputed by hand; prediction uses all stored means
    last = scenario.tasks[-1]
    f, y = extract_features(model, last.train, batch_size=64, device="cpu")
    mine = {c: f[y == c].double().mean(0) for c in range(last.offset, last.offset + last.n_classes)}
    from clmerge.engine.checkpoint import latest_checkpoint, load_head_tensors

    stored = load_head_tensors(latest_checkpoint(tmp_path / "r"))
    for c, m in mine.items():
        assert torch.allclose(stored[f"stats.mean.{c}"], m, atol=1e-6)
    means = torch.stack([stored[f"stats.mean.{c}"] for c in range(4)]).float()
    accs = []
    for task in scenario.tasks:
        ft, yt = extract_features(model, task.test, batch_size=64, device="cpu")
        pred = (F.normalize(ft, dim=-1) @ F.normalize(means, dim=-1).T).argmax(-1)
        accs.append(100.0 * int((pred == yt).sum()) / len(yt))
    assert metrics["accuracy_matrix"][-1] == pytest.approx(accs, abs=1e-9)


# -- RanPAC -------------------------------------------------------------------------------------------------
def test_ranpac_equals_a_direct_ridge_solve_on_the_projected_features():
    g = torch.Generator().manual_seed(1)
    head = RanPACHead(6, 40, seed=3)
    f1, y1 = torch.randn(60, 6, generator=g), torch.randint(0, 2, (60,), generator=g)
    f2, y2 = torch.randn(50, 6, generator=g), torch.randint(2, 4, (50,), generator=g)
    head.update(f1, y1, 2, torch.Generator().manual_seed(0))
    head.update(f2, y2, 4, torch.Generator().manual_seed(1))
    W_rand = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
    H = torch.relu(torch.cat([f1, f2]) @ W_rand).double()
    Y = F.one_hot(torch.cat([y1, y2]), 4).double()
    lam = head.ridges[-1]
    W = torch.linalg.solve(H.T @ H + lam * torch.eye(40, dtype=torch.float64), H.T @ Y)
    assert torch.allclose(head.W_o, W, atol=1e-8, rtol=1e-8)
    x = torch.randn(5, 6, generator=g)
    assert torch.allclose(head.logits(x, 4), (torch.relu(x @ W_rand) @ W.float()), atol=1e-4)


def test_ranpac_ridge_choice_is_the_least_held_out_mse_of_direct_solves():
    g = torch.Generator().manual_seed(2)
    H = torch.relu(torch.randn(100, 12, generator=g, dtype=torch.float64))
    Y = F.one_hot(torch.randint(0, 3, (100,), generator=g), 3).double() + 0.3 * (H[:, :3] - 0.4)
    losses = []
    for lam in RANPAC_RIDGES:  # fit on the first 80 rows, MSE on the last 20 (RanPAC's rule)
        W = torch.linalg.solve(H[:80].T @ H[:80] + lam * torch.eye(12, dtype=torch.float64), H[:80].T @ Y[:80])
        losses.append(float(((H[80:] @ W - Y[80:]) ** 2).mean()))
    want = RANPAC_RIDGES[min(range(len(losses)), key=losses.__getitem__)]
    assert ridge_grid_choice(H, Y) == want


# -- alignment ----------------------------------------------------------------------------------------------
def _toy_head_and_stats():
    """Two tasks of two Gaussian classes; each block was fit on its own task, task 1's with 3x larger logits."""
    g = torch.Generator().manual_seed(0)
    centers = torch.tensor([[4.0, 0, 0, 0], [0, 4.0, 0, 0], [0, 0, 4.0, 0], [0, 0, 0, 4.0]])
    head = IncrementalHead(4)
    head.grow(2, generator=g), head.grow(2, generator=g)
    with torch.no_grad():
        head.blocks[0].weight.copy_(centers[:2]), head.blocks[0].bias.zero_()
        head.blocks[1].weight.copy_(3 * centers[2:]), head.blocks[1].bias.zero_()
    stats = ClassFeatureStats(4)
    for c in range(4):
        stats.update(centers[c] + torch.randn(200, 4, generator=g), torch.full((200,), c))
    x = torch.cat([centers[c] + torch.randn(200, 4, generator=g) for c in range(4)])
    y = torch.arange(4).repeat_interleave(200)
    return head, stats, x, y


def _nll_and_acc(head, x, y):
    with torch.no_grad():
        logits = head(x)
    return float(F.cross_entropy(logits, y)), float((logits.argmax(-1) == y).float().mean())


@pytest.mark.parametrize("logit_norm", [None, 0.1])
def test_align_retrains_the_head_on_pseudo_features_and_calibrates_it(logit_norm):
    head, stats, x, y = _toy_head_and_stats()
    nll0, acc0 = _nll_and_acc(head, x, y)
    before = [p.detach().clone() for p in head.parameters()]
    # the toy's 3x miscalibration needs more steps than SLCA's 5 epochs at lr 0.005 (20 steps in all here)
    losses = align_linear_head(head, stats, [(0, 2), (2, 4)], epochs=20, lr=0.05, samples_per_class=64,
                               logit_norm=logit_norm, generator=torch.Generator().manual_seed(0))
    nll1, acc1 = _nll_and_acc(head, x, y)
    assert len(losses) == 20 and losses[-1] < losses[0]
    assert all(p.requires_grad for p in head.parameters()) and all(p.grad is None for p in head.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, head.parameters()))
    # calibration on real samples: cross-entropy of the raw logits falls by half or more, accuracy rises
    assert nll1 < 0.5 * nll0 and acc1 > acc0 + 0.03


def test_lowrank_and_diag_statistics_sample_the_right_covariance():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(6, 6, generator=g, dtype=torch.float64)
    x = torch.randn(4000, 6, generator=g, dtype=torch.float64) @ A.T + 3.0
    full = torch.cov(x.T)
    for cov, rank, tol in (("full", 0, 0.15), ("lowrank", 6, 0.15)):
        s = ClassFeatureStats(6, cov=cov, rank=max(rank, 1))
        s.update(x, torch.zeros(4000, dtype=torch.long))
        draw = s.sample(0, 20000, torch.Generator().manual_seed(1))
        assert torch.allclose(torch.cov(draw.T), full, atol=tol * float(full.abs().max()))
        assert torch.allclose(draw.mean(0), x.mean(0), atol=0.15)
    d = ClassFeatureStats(6, cov="diag")
    d.update(x, torch.zeros(4000, dtype=torch.long))
    assert d.nbytes() == 2 * 6 * 8 and torch.allclose(d.tensors["diag.0"], full.diagonal() + 1e-4)


# -- engine: compare, resume, errors ------------------------------------------------------------------------
def test_compare_mode_leaves_the_primary_metrics_unchanged_and_shadows_equal_primary_runs(tmp_path, monkeypatch):
    base = {"scenario.n_tasks": 3, "scenario.classes_per_task": [2, 2, 2], "scenario.val_fraction": 0.2}
    off = run_experiment(_cfg(**base), tmp_path / "off")
    import clmerge.engine.run as engine_run

    passes = []
    plain = engine_run.evaluate_tasks
    monkeypatch.setattr(engine_run, "evaluate_tasks", lambda *a, **k: passes.append(1) or plain(*a, **k))
    on = run_experiment(_cfg(**base, **{"head.compare": True}), tmp_path / "on")
    monkeypatch.setattr(engine_run, "evaluate_tasks", plain)
    assert passes == []  # the linear primary row is the linear shadow's: one backbone pass per batch, not two
    for key in ("accuracy_matrix", "til_accuracy_matrix", "acc", "aaa", "method_metrics"):
        assert on[key] == off[key], key
    assert set(on["heads"]) == {"linear", "linear+align", "ncm", "ranpac"}
    assert on["heads"]["linear"]["accuracy_matrix"] == off["accuracy_matrix"]
    assert on["heads"]["linear"]["val_acc"] == off["head"]["val_acc"]
    for variant, kw in (("ncm", {"head.classifier": "ncm"}), ("ranpac", {"head.classifier": "ranpac"}),
                        ("linear+align", {"head.align": True})):
        primary = run_experiment(_cfg(**base, **kw), tmp_path / variant)
        shadow = on["heads"][variant]
        assert primary["accuracy_matrix"] == shadow["accuracy_matrix"], variant
        assert primary["til_accuracy_matrix"] == shadow["til_accuracy_matrix"], variant
        assert primary["head"]["val_acc"] == shadow["val_acc"], variant
    assert on["head"]["stats_bytes"]["class_stats"] > 0 and on["head"]["stats_bytes"]["ranpac"] > 0
    from clmerge.report import build_report

    html = build_report(tmp_path / "ncm").read_text()
    assert "<b>head:</b> ncm" in html
    html = build_report(tmp_path / "on").read_text()
    assert "<h2>Heads</h2>" in html and "linear (reported)" in html and "ranpac" in html


def test_resume_with_heads_gives_identical_metrics(tmp_path, monkeypatch):
    cfg = _cfg(**{"scenario.n_tasks": 3, "scenario.classes_per_task": [2, 2, 2], "head.align": True,
                  "head.compare": True})
    full = run_experiment(cfg, tmp_path / "full")
    from clmerge.methods.seq_lora import SeqLoRA

    original = SeqLoRA.end_task

    def crash(self, task, ctx):
        if task.index == 2:
            raise RuntimeError("simulated crash")
        return original(self, task, ctx)

    monkeypatch.setattr(SeqLoRA, "end_task", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_experiment(cfg, tmp_path / "crashed")
    monkeypatch.setattr(SeqLoRA, "end_task", original)
    resumed = run_experiment(cfg, tmp_path / "crashed", resume=True)
    assert _strip(resumed) == _strip(full)


def test_head_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="head.align=true .* head.classifier=linear"):
        parse_config(tiny_config(**{"head.align": True, "head.classifier": "ncm"}))
    with pytest.raises(ConfigError, match="domain_incremental"):
        parse_config(tiny_config(**{"head.classifier": "ranpac", "scenario.kind": "domain_incremental",
                                    "scenario.transform": "permutation"}))
    with pytest.raises(ConfigError, match="head.classifier"):
        parse_config(tiny_config(**{"head.classifier": "knn"}))
    cfg = tiny_config(**{"head.classifier": "ncm", "scenario.kind": "task_incremental", "method": {"name": "stl"}})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = CliRunner().invoke(app, ["run", str(path), "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "head.classifier=ncm" in r.output and "stl" in r.output
    assert "Traceback" not in r.output and not (tmp_path / "x" / "config.yaml").exists()


def test_embedded_default_uses_the_validated_head_and_config_files_keep_linear(tmp_path):
    from clmerge.config import EMBEDDED_DEFAULT, default_config, load_config

    assert default_config().head.classifier == "ranpac"
    assert EMBEDDED_DEFAULT == {"method": {"name": "ranpac_rp"}, "head": {"ranpac_dim": 2000}}
    assert load_config(None, ["head.classifier=ncm"]).head.classifier == "ncm"  # the user's head key wins
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"seed": 1}))
    assert load_config(path).head.classifier == "linear" and parse_config({}).head.classifier == "linear"


def test_adapt_tasks_trains_the_backbone_in_the_first_task_only(tmp_path):
    base = {"scenario.n_tasks": 3, "scenario.classes_per_task": [2, 2, 2], "run.keep_checkpoints": 3}
    run_experiment(_cfg(**base, **{"train.adapt_tasks": 1}), tmp_path / "fsa")
    from clmerge.engine.checkpoint import load_checkpoint

    states = [load_checkpoint(tmp_path / "fsa" / "checkpoints" / f"task_{t:03d}.safetensors")[0] for t in range(3)]
    body = [k for k in states[0] if k.startswith("backbone.") and "lora_" not in k]
    assert body and all(torch.equal(states[0][k], states[2][k]) for k in body)  # seq_lora folds a zero delta
    events = [json.loads(x) for x in (tmp_path / "fsa" / "events.jsonl").read_text().splitlines()]
    losses = [e["loss"] for e in events if e["event"] == "epoch" and e["task"] == 2]
    assert len(losses) == 2 and losses[1] < losses[0]  # the head still trains in later tasks
    run_experiment(_cfg(**base), tmp_path / "all")
    full = load_checkpoint(tmp_path / "all" / "checkpoints" / "task_002.safetensors")[0]
    assert any(not torch.equal(states[2][k], full[k]) for k in body)


def test_alignment_starts_at_the_second_task_unless_asked(tmp_path):
    """The official SLCA / InfLoRA-CA code aligns from the second task on: after task 1 the aligned head is
    the trained head (same accuracies); ``align_first_task`` aligns there too and changes them."""
    base = {"scenario.n_tasks": 2, "scenario.classes_per_task": [2, 2], "head.compare": True}
    off = run_experiment(_cfg(**base), tmp_path / "off")
    first = off["heads"]["linear+align"]["accuracy_matrix"][0]
    assert first == off["heads"]["linear"]["accuracy_matrix"][0]
    assert off["head"]["align_losses"][0] == [] and len(off["head"]["align_losses"][1]) == 2
    on = run_experiment(_cfg(**base, **{"head.align_first_task": True}), tmp_path / "on")
    assert len(on["head"]["align_losses"][0]) == 2
    assert on["heads"]["linear"]["accuracy_matrix"] == off["heads"]["linear"]["accuracy_matrix"]


def test_ridge_solve_keeps_the_exact_solution_when_g_is_rank_deficient_and_lambda_tiny():
    """Fewer training rows than M: G + 1e-8 I is numerically singular (condition ~1e17). The floor keeps the
    solve equal to the exact ridge solution, the SVD form that ridge_grid_choice scores; without it the
    Cholesky solve is far off."""
    from clmerge.models.heads import ridge_floor, ridge_solve

    g = torch.Generator().manual_seed(0)
    M, N, C = 600, 200, 5
    H = torch.relu(torch.randn(N, 48, generator=g) @ torch.randn(48, M, generator=g) * 30).double()
    Y = torch.nn.functional.one_hot(torch.randint(0, C, (N,), generator=g), C).double()
    G, Q = H.T @ H, H.T @ Y
    U, s, Vh = torch.linalg.svd(H, full_matrices=False)
    lam = 1e-8
    exact = Vh.T @ ((s / (s ** 2 + lam))[:, None] * (U.T @ Y))
    assert lam < ridge_floor(G)
    got = ridge_solve(G, Q, lam)
    rel = float((got - exact).norm() / exact.norm())
    assert rel < 1e-3, rel
    A = G.clone()
    A.diagonal().add_(lam)
    bare = torch.linalg.solve(A, Q)  # what the solve did before the floor
    assert float((bare - exact).norm() / exact.norm()) > 100 * rel
    big = 10 * ridge_floor(G)  # above the floor nothing changes
    A = G.clone()
    A.diagonal().add_(big)
    assert torch.equal(ridge_solve(G, Q, big), torch.cholesky_solve(Q, torch.linalg.cholesky(A)))
