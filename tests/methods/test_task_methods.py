"""halrp / gpm / stl end-to-end on tiny permuted-digits tasks (task-incremental), resume, and P8 (no forgetting)."""

from __future__ import annotations

import shutil

import pytest
import torch

from clmerge.adapters.structure import rebuild_structure
from clmerge.adapters.task_modules import TaskRoutedModel
from clmerge.config import parse_config
from clmerge.engine.checkpoint import load_checkpoint
from clmerge.engine.run import prepare, run_experiment
from clmerge.methods.gpm import extend_basis
from _lora_cl_helpers import uncommit_checkpoint
from method_helpers import tiny_cfg


def _run(tmp_path, name: str, data: dict) -> dict:
    return run_experiment(parse_config(data), tmp_path / name)


def _resume_matches(tmp_path, data: dict, full: dict) -> None:
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    (tmp_path / "resumed" / "metrics.json").unlink()
    uncommit_checkpoint(tmp_path / "resumed", "task_002.safetensors")
    resumed = run_experiment(parse_config(data), tmp_path / "resumed", resume=True)
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    assert resumed["method_metrics"] == full["method_metrics"]
    a = load_checkpoint(tmp_path / "full" / "checkpoints" / "task_002.safetensors")[0]
    b = load_checkpoint(tmp_path / "resumed" / "checkpoints" / "task_002.safetensors")[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("method,options", [("halrp", {"prune_q": 0.6}), ("gpm", {}), ("stl", {})])
def test_end_to_end_and_resume(tmp_path, method, options):
    data = tiny_cfg(method, **options)
    full = _run(tmp_path, "full", data)
    R = full["accuracy_matrix"]
    assert len(R) == 3 and all(R[i][i] > 35 for i in range(3))  # 10-way tasks, chance = 10%
    if method == "stl":
        assert full["bwt"] == 0.0 and full["method_metrics"]["bytes_per_task"][0] > 0
    if method == "halrp":
        mm = full["method_metrics"]
        assert len(mm["bytes_per_task"]) == 3 and mm["bytes_per_task"][1] < mm["bytes_per_task"][0]
        assert mm["pruned_entries"][-1] > 0  # growth passed the budget 1 - q = 40%: earlier tasks are re-pruned
    _resume_matches(tmp_path, data, full)


def _routed_outputs(cfg, ckpt, x: torch.Tensor) -> torch.Tensor:
    _, model, _, _ = prepare(cfg)
    state, _, meta = load_checkpoint(ckpt)
    rebuild_structure(model, meta["structure"])
    model.load_state_dict(state, strict=True)
    return TaskRoutedModel(model).eval()(x)


def test_halrp_without_pruning_keeps_earlier_tasks_bit_identical(tmp_path):
    data = tiny_cfg("halrp", prune=False)
    metrics = _run(tmp_path, "run", data)
    R = metrics["accuracy_matrix"]
    assert [R[2][0], R[2][1]] == [R[0][0], R[1][1]] and metrics["bwt"] == 0.0  # P8
    cfg = parse_config(data)
    x = torch.rand(7, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    ck = tmp_path / "run" / "checkpoints"
    after1 = _routed_outputs(cfg, ck / "task_001.safetensors", x)  # logits of tasks 0, 1 (10 each)
    after2 = _routed_outputs(cfg, ck / "task_002.safetensors", x)
    assert torch.equal(after1, after2[:, :20])
    ranks = metrics["method_metrics"]["ranks"]
    assert len(ranks) == 2 and all(1 <= k <= 32 for r in ranks for k in r.values())


def test_halrp_ablation_options_run(tmp_path):
    data = tiny_cfg("halrp", rank_method="flat", factor_init="random", importance="sum", upper_rank=4,
                    l2_half=True, base_l2=True, grad_multiplier=10.0, prune_scope="global", prune_q=0.99)
    data["scenario"]["n_tasks"] = 2
    m = _run(tmp_path, "abl", data)
    assert m["method_metrics"]["ranks"] == [{"inner.body.1": 4, "inner.body.3": 4}]


def test_gpm_basis_update_captures_energy():
    g = torch.Generator().manual_seed(0)
    rep = torch.randn(6, 3, generator=g, dtype=torch.float64) @ torch.randn(3, 40, generator=g, dtype=torch.float64)
    basis = extend_basis(rep, None, 0.999)
    assert basis.shape[1] <= 3
    torch.testing.assert_close(basis.T @ basis, torch.eye(basis.shape[1], dtype=torch.float64))
    assert (rep - basis @ (basis.T @ rep)).pow(2).sum() <= 0.001 * rep.pow(2).sum() + 1e-12
    more = extend_basis(torch.randn(6, 40, generator=g, dtype=torch.float64), basis, 0.999)
    assert more.shape[1] > basis.shape[1] and torch.equal(more[:, : basis.shape[1]], basis)
    torch.testing.assert_close(more.T @ more, torch.eye(more.shape[1], dtype=torch.float64))


@pytest.mark.parametrize("method", ["finetune", "ewc", "l2"])
def test_existing_baselines_run_on_small_nets_with_task_heads(tmp_path, method):
    data = tiny_cfg(method)
    data["scenario"]["n_tasks"] = 2
    m = _run(tmp_path, method, data)
    assert len(m["accuracy_matrix"]) == 2 and m["accuracy_matrix"][1][1] > 35


def test_cli_orders_sweep(tmp_path):
    import yaml
    from typer.testing import CliRunner

    from clmerge.cli import app

    data = tiny_cfg("stl")
    data["scenario"].update(n_tasks=2, train_per_task=120)
    data["train"]["epochs"] = 1
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(app, ["run", str(cfg), "--orders", "2", "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    import json

    s = json.loads((tmp_path / "o" / "orders_summary.json").read_text())
    assert s["orders"] == [[0, 1], [1, 0]] and set(s["opd"]) == {"identity", "permutation(seed=1)"}
    assert (tmp_path / "o" / "orders_report.html").exists() and (tmp_path / "o" / "order_1" / "metrics.json").exists()


def test_gpm_projection_leaves_earlier_inputs_unchanged():
    """After end_task, a projected gradient G satisfies G M = 0, so W x is unchanged for x in the stored span."""
    from clmerge.methods.base import TaskContext

    data = tiny_cfg("gpm", threshold=1.0, samples=20)
    data["model"] = {"name": "lenet", "config": {"image_size": 8, "num_channels": 1, "channels": [2, 3], "fc": [5],
                                                 "mean": [0.5], "std": [0.5]}}
    scenario, model, method, _ = prepare(parse_config(data))
    task = scenario.tasks[0]
    ctx = TaskContext(task=task, seen_tasks=[task], device=torch.device("cpu"), generator=torch.Generator().manual_seed(0))
    method.begin_task(task, ctx)
    ctx.generator = torch.Generator().manual_seed(0)
    method.end_task(task, ctx)
    ctx.generator = torch.Generator().manual_seed(0)  # the same representation batch as end_task drew
    convs = {n: m for n, m in model.backbone.named_modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))}
    reps = method._representations(task, ctx)
    for name, layer in convs.items():
        layer.weight.grad = torch.randn_like(layer.weight)
    method.before_step(model, ctx)
    for name, layer in convs.items():
        g = layer.weight.grad.reshape(layer.weight.shape[0], -1).double()
        assert (g @ reps[name]).abs().max() < 1e-4 * max(1.0, float(reps[name].abs().max()))  # float32 roundoff
