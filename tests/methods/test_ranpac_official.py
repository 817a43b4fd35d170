"""RanPAC against the official code's rules: LAMDA-PILOT models/ranpac.py and exps/ranpac.json at 2647455 (the
RanPAC repository's method file, RanPACOCL/RanPAC at 012927f, is the same algorithm: Phase 1 first-session
adaptation, Phase 2 random projection + ridge).

Each test transcribes one rule of that file in its own words and checks clmerge against it:

- ``setup_RP`` (models/ranpac.py:56-64): ``W_rand = randn(D, M)``; ``M`` is 10000 (exps/ranpac.json:25-26).
- ``replace_fc`` (models/ranpac.py:47-51): ``h = relu(f @ W_rand)``; ``Q += hᵀY``, ``G += hᵀh``;
  ``W_o = solve(G + λI, Q)``, with λ from ``optimise_ridge_parameter``.
- ``optimise_ridge_parameter`` (models/ranpac.py:66-78): λ in 10^-8 … 10^8; fit on the first 80% of the task's
  (shuffled) features, the MSE on the rest; the smallest loss's λ.
- ``_train`` (models/ranpac.py:105-129): the network (the adapter backbone of exps/ranpac.json:11, its fc the
  ``CosineLinear`` of ``SimpleVitNet``) is trained in the first task only; ``replace_fc`` then reads the
  adapted backbone's features in every task.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from clmerge.config import HeadConfig, load_config, parse_config
from clmerge.engine import run as run_mod
from clmerge.engine.checkpoint import load_checkpoint, load_head_tensors
from clmerge.engine.run import run_experiment
from clmerge.engine.setup import prepare
from clmerge.models.heads import RanPACHead, ridge_grid_choice, ridge_solve
from _lora_cl_helpers import uncommit_checkpoint
from conftest import tiny_config

RIDGES = 10.0 ** np.arange(-8, 9)  # models/ranpac.py:67


def _official_lambda(H: torch.Tensor, Y: torch.Tensor) -> float:
    """models/ranpac.py:66-78, transcribed: per λ an M×M solve on the first 80%, the MSE on the last 20%."""
    k = int(H.shape[0] * 0.8)
    G1, Q1 = H[:k].T @ H[:k], H[:k].T @ Y[:k]
    losses = []
    for lam in RIDGES:
        W = torch.linalg.solve(G1 + lam * torch.eye(G1.shape[0], dtype=H.dtype), Q1).T
        losses.append(float(F.mse_loss(H[k:] @ W.T, Y[k:])))
    return float(RIDGES[int(np.argmin(losses))])


def test_the_projection_width_is_the_official_M_and_the_projection_is_relu_of_a_gaussian_map():
    # exps/ranpac.json:26 "M": 10000 for the RanPAC methods; the shared head suite's shadow head stays 2000
    assert load_config(None, ["method.name=ranpac"]).head.ranpac_dim == 10000
    assert HeadConfig().ranpac_dim == 2000
    head = RanPACHead(12, 40, seed=3)
    # models/ranpac.py:60: W_rand = torch.randn(in_features, M)
    torch.testing.assert_close(head.W_rand, torch.randn(12, 40, generator=torch.Generator().manual_seed(3)))
    f = torch.randn(7, 12)
    torch.testing.assert_close(head.project(f), torch.relu(f @ head.W_rand))  # models/ranpac.py:47


@pytest.mark.parametrize("case", range(6))
def test_lambda_is_selected_as_optimise_ridge_parameter_selects_it(case):
    g = torch.Generator().manual_seed(case)
    n, m, c = 120 + 40 * case, 30 + 25 * case, 2 + case % 3
    f = torch.randn(n, 8, generator=g, dtype=torch.float64) * (0.1 + case)
    H = torch.relu(f @ torch.randn(8, m, generator=g, dtype=torch.float64))
    Y = F.one_hot(torch.randint(0, c, (n,), generator=g), c).double()
    Y = Y + 0.3 * torch.randn(n, c, generator=g, dtype=torch.float64) * (case % 2)  # noisy targets: λ varies
    assert ridge_grid_choice(H, Y) == _official_lambda(H, Y)


def test_extra_zero_target_columns_do_not_change_the_selected_lambda():
    """The official Y has a column per class of the whole dataset (``nb_classes``, models/ranpac.py:46);
    clmerge's has the classes seen so far. The extra columns add nothing to any loss: the argmin is the same."""
    g = torch.Generator().manual_seed(0)
    H = torch.relu(torch.randn(200, 60, generator=g, dtype=torch.float64))
    Y = F.one_hot(torch.randint(0, 3, (200,), generator=g), 3).double()
    wide = torch.cat([Y, torch.zeros(200, 7, dtype=torch.float64)], 1)
    assert _official_lambda(H, Y) == _official_lambda(H, wide) == ridge_grid_choice(H, Y)


def test_two_tasks_of_updates_give_the_official_gram_targets_and_ridge_solution():
    D, M, C = 10, 48, 4
    head = RanPACHead(D, M, seed=1)
    g = torch.Generator().manual_seed(5)
    G = torch.zeros(M, M, dtype=torch.float64)
    Q = torch.zeros(M, C, dtype=torch.float64)
    for t in range(2):
        f = torch.randn(90, D, generator=g)
        y = torch.randint(2 * t, 2 * t + 2, (90,), generator=g)
        order = torch.randperm(90, generator=torch.Generator().manual_seed(100 + t))  # the shuffled loader
        head.update(f, y, 2 * t + 2, torch.Generator().manual_seed(100 + t))
        h = torch.relu(f.double()[order] @ head.W_rand.double())  # models/ranpac.py:47 (in float64 here)
        Y = F.one_hot(y[order], C).double()  # models/ranpac.py:46: every class of the dataset
        Q += h.T @ Y  # models/ranpac.py:48
        G += h.T @ h  # models/ranpac.py:49
        lam = _official_lambda(h, Y)  # models/ranpac.py:50
        W = torch.linalg.solve(G + lam * torch.eye(M, dtype=torch.float64), Q)  # models/ranpac.py:51
        assert head.ridges[-1] == lam
        torch.testing.assert_close(head.G, G, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(head.Q, Q[:, : 2 * t + 2], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(head.W_o, W[:, : 2 * t + 2], rtol=1e-4, atol=1e-6)
        assert not W[:, 2 * t + 2:].any()  # classes not seen yet: zero columns, as clmerge's absent ones


def test_the_cholesky_ridge_solve_is_the_lu_solve():
    g = torch.Generator().manual_seed(0)
    H = torch.relu(torch.randn(300, 80, generator=g, dtype=torch.float64))
    G, Q = H.T @ H, H.T @ torch.randn(300, 3, generator=g, dtype=torch.float64)
    for lam in (1e-3, 1.0, 1e4):
        lu = torch.linalg.solve(G + lam * torch.eye(80, dtype=torch.float64), Q)
        torch.testing.assert_close(ridge_solve(G, Q, lam), lu, rtol=1e-9, atol=1e-12)


def _cfg(name: str, **kw):
    base = {"method": {"name": name, "bottleneck": 4} if name == "ranpac" else {"name": name},
            "head.ranpac_dim": 64, "run.keep_checkpoints": 2}
    return parse_config(tiny_config(**{**base, **kw}))


def test_ranpac_adapts_an_adapter_with_the_cosine_head_on_the_first_task_only(tmp_path, monkeypatch):
    """models/ranpac.py:108-126: the first task trains the network (adapter backbone + CosineLinear), later
    ones nothing; exps/ranpac.json:11 ``pretrained_vit_b16_224_adapter``."""
    o = load_config(None, ["method.name=ranpac"]).method_options()
    assert (o.first_session_adapt, o.variant, o.adapt_head, o.bottleneck) == (True, "adapter", "cosine", 64)
    calls, real = [], run_mod.fit

    def fit(model, data, *, groups, **kw):
        names = {id(p): n for n, p in model.named_parameters()}
        calls.append({g["name"]: [names.get(id(p), "<first-session head>") for p in g["params"]]
                      for g in groups})
        return real(model, data, groups=groups, **kw)

    monkeypatch.setattr(run_mod, "fit", fit)
    run_experiment(_cfg("ranpac", **{"scenario.n_tasks": 3, "scenario.classes_per_task": [2, 2, 2]}),
                   tmp_path / "run")
    assert len(calls) == 1  # tasks 2 and 3 train nothing
    assert calls[0]["body"] and all(".bottleneck_adapters.sets.ranpac." in n for n in calls[0]["body"])
    assert calls[0]["head"] == ["<first-session head>"] * 2  # the cosine head's weight and sigma
    ck = tmp_path / "run" / "checkpoints"
    s1, s2 = (load_checkpoint(ck / f"task_00{t}.safetensors")[0] for t in (1, 2))
    assert all(torch.equal(s1[k], s2[k]) for k in s1 if k.startswith("backbone."))  # frozen after task 1


def test_ranpacs_gram_matrix_is_of_the_adapted_backbones_features(tmp_path):
    """models/ranpac.py:129 then 40-49: every task's G comes from the adapted network's features."""
    for name in ("ranpac", "ranpac_rp"):
        cfg = _cfg(name)
        run_experiment(cfg, tmp_path / name)
        ck = tmp_path / name / "checkpoints" / "task_001.safetensors"
        scenario, model, method, _ = prepare(cfg)
        state = load_checkpoint(ck)[0]
        model.load_state_dict({k: v for k, v in state.items() if not k.startswith("head.")}, strict=False)
        model.eval()
        head = RanPACHead(model.backbone.feature_dim, 64, seed=cfg.seed)
        G = torch.zeros(64, 64, dtype=torch.float64)
        with torch.no_grad():
            for task in scenario.tasks:
                x = torch.cat([b[0] for b in task.train.batches(50)])
                h = head.project(model.forward_features(x)).double()
                G += h.T @ h
        torch.testing.assert_close(load_head_tensors(ck)["ranpac.G"], G, rtol=1e-5, atol=1e-4)
    adapted = load_checkpoint(tmp_path / "ranpac" / "checkpoints" / "task_001.safetensors")[0]
    assert any("bottleneck_adapters" in k for k in adapted)
    plain = load_checkpoint(tmp_path / "ranpac_rp" / "checkpoints" / "task_001.safetensors")[0]
    assert not any("bottleneck_adapters" in k for k in plain)  # random projection only: pretrained features


def test_random_projection_only_is_its_own_method_that_trains_nothing(tmp_path):
    cfg = load_config(None, ["method.name=ranpac_rp"])
    assert (cfg.head.classifier, cfg.head.ranpac_dim) == ("ranpac", 10000)
    assert cfg.method_options().model_dump() == {}
    with pytest.raises(Exception, match="first_session_adapt"):
        load_config(None, ["method.name=ranpac_rp", "method.first_session_adapt=true"])


@pytest.mark.parametrize("name", ["ranpac", "ranpac_rp"])
def test_a_resumed_ranpac_run_gives_the_same_numbers(tmp_path, name):
    cfg = tiny_config(**{"method": {"name": name, **({"bottleneck": 4} if name == "ranpac" else {})},
                         "head.ranpac_dim": 64, "run.keep_checkpoints": 2})
    full = run_experiment(parse_config(cfg), tmp_path / "full")
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    (tmp_path / "resumed" / "metrics.json").unlink()
    uncommit_checkpoint(tmp_path / "resumed", "task_001.safetensors")  # killed after the first task
    resumed = run_experiment(parse_config(cfg), tmp_path / "resumed", resume=True)
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    a, b = (load_head_tensors(tmp_path / d / "checkpoints" / "task_001.safetensors")
            for d in ("full", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
