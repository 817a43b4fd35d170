"""The fast paths of HALRP / task-routed evaluation give the same numbers as the direct computations they replace.

- One SVD per layer and task (``lrp.residual_svd``): its vectors give the same factors as ``svd_factors``, bit
  for bit; its sigma (ranking) equals ``svdvals`` to rounding (different LAPACK paths).
- Task-id-known evaluation (``evaluate_tasks(til_only=True)``) asks ``TaskRoutedModel.task_logits`` for one
  task's logits instead of running the backbone once per task: the logits are the same slice of the full output.
- End to end on a tiny LeNet: the old code (a transcription below) and the new code give identical ranks,
  metrics and checkpoints.
"""

from __future__ import annotations

import pytest
import torch

from clmerge.methods.halrp.layers import halrp_layers
from clmerge.adapters.structure import rebuild_structure
from clmerge.adapters.task_modules import TaskBatchNorm, TaskRoutedModel
from clmerge.config import parse_config
from clmerge.engine import run as engine_run
from clmerge.engine.checkpoint import load_checkpoint
from clmerge.engine.evaluate import evaluate_tasks
from clmerge.engine.run import run_experiment
from clmerge.methods.halrp import HALRP
from clmerge.methods.halrp import low_rank_perturbation as lrp


@pytest.mark.parametrize("shape", [(7, 3), (3, 7), (40, 160), (160, 40), (1, 5)])
@pytest.mark.parametrize("k", [1, 3])
def test_factors_from_one_svd_equal_the_direct_formula(shape, k):
    b = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=torch.float64)
    k = min(k, min(shape))
    u, sig, vh = torch.linalg.svd(b, full_matrices=False)  # the old svd_factors, transcribed
    root = sig[:k].sqrt()
    ref_u, ref_v = u[:, :k] * root, root[:, None] * vh[:k]
    svd = lrp.residual_svd(b)
    new_u, new_v = lrp.factors_from_svd(*svd, k)
    assert torch.equal(new_u, ref_u) and torch.equal(new_v, ref_v)
    old_u, old_v, old_sig = lrp.svd_factors(b, k)
    assert torch.equal(old_u, ref_u) and torch.equal(old_v, ref_v) and torch.equal(old_sig, sig)
    torch.testing.assert_close(svd[1], torch.linalg.svdvals(b), rtol=1e-12, atol=1e-12)  # old ranking input


# -- the pre-change HALRP steps 2b-2g, transcribed -------------------------------------------------------------
def _old_select_ranks(self, free, task, ctx):
    o = self.options
    g = self._importance(free, task, ctx)
    main_layers, free_layers = halrp_layers(self.model.backbone), halrp_layers(free.backbone)
    info = {}
    for name, layer in main_layers.items():
        w_base = layer.base_layer.weight.detach()
        w_free = free_layers[name].base_layer.weight.detach()
        r, s = lrp.least_squares_scalings(w_free, w_base)
        b = lrp.residual_matrix(w_free, w_base, r, s)
        w_mat = w_free.double().mean((2, 3)) if w_free.dim() == 4 else w_free.double()
        sig_src = b if o.sigma_source == "residual" else w_mat
        info[name] = {"r": r, "s": s, "b": b, "sigma": torch.linalg.svdvals(sig_src.double()),
                      "c": layer.kernel_positions if o.conv_scale else 1, "bias": free_layers[name].base_layer.bias}
    names = list(info)
    if o.rank_method == "flat":
        ranks = [min(o.upper_rank, len(info[n]["sigma"])) for n in names]
    else:
        scores = lrp.component_scores([info[n]["sigma"] for n in names], [g[n] for n in names],
                                      [info[n]["c"] for n in names])
        ranks = lrp.global_rank_selection(scores, o.alpha, upper_rank=o.upper_rank)
    for n, k in zip(names, ranks):
        info[n]["rank"] = k
    self.record("ranks", {n: k for n, k in zip(names, ranks)})
    self.record("importance", {n: g[n] for n in names})
    return info


def _old_init_task(self, free, t, info, ctx):
    free_bns = {n: m for n, m in free.backbone.named_modules() if isinstance(m, TaskBatchNorm)}
    with torch.no_grad():
        for name, layer in halrp_layers(self.model.backbone).items():
            d = info[name]
            f = layer.add_task(t, d["rank"])
            u, v, _ = lrp.svd_factors(d["b"], d["rank"])
            if self.options.factor_init == "random":
                u, v = self._random_like(u, ctx.generator), self._random_like(v, ctx.generator)
            f.r.copy_(d["r"]), f.s.copy_(d["s"]), f.u.copy_(u), f.v.copy_(v)
            if f.bias is not None:
                f.bias.copy_(d["bias"])
        for name, bn in {n: m for n, m in self.model.backbone.named_modules()
                         if isinstance(m, TaskBatchNorm)}.items():
            bn.add_task(free_bns[name].per_task[0])
        self.model.head.blocks[t].load_state_dict(free.head.blocks[t].state_dict())


def _old_evaluate_tasks(*args, til_only=False, **kwargs):  # every head through its own backbone pass
    return evaluate_tasks(*args, **kwargs)


def tiny_lenet_cfg(method: str, **options) -> dict:
    return {
        "scenario": {"dataset": "digits", "kind": "task_incremental", "n_tasks": 3, "transform": "permutation",
                     "val_fraction": 0.2, "train_per_task": 200, "test_per_class": 10},
        "model": {"name": "lenet", "config": {"image_size": 8, "channels": [4, 6], "fc": [24, 16]}},
        "method": {"name": method, **options},
        "optim": {"lr": 1e-2}, "train": {"epochs": 1, "batch_size": 40, "eval_batch_size": 37},
        "run": {"progress": False, "report": False, "keep_checkpoints": 3, "threads": 1},
    }


@pytest.mark.parametrize("method,options", [
    ("halrp", {"prune_q": 0.6, "grad_multiplier": 10.0, "l2_half": True, "base_l2": True}),
    ("halrp", {"sigma_source": "weight", "factor_init": "random", "alpha": 0.6}),
    ("stl", {}),
])
def test_fast_paths_reproduce_the_old_run_bit_for_bit(tmp_path, monkeypatch, method, options):
    data = tiny_lenet_cfg(method, **options)
    new = run_experiment(parse_config(data), tmp_path / "new")
    with monkeypatch.context() as mp:
        mp.setattr(HALRP, "_select_ranks", _old_select_ranks)
        mp.setattr(HALRP, "_init_task", _old_init_task)
        mp.setattr(engine_run, "evaluate_tasks", _old_evaluate_tasks)
        old = run_experiment(parse_config(data), tmp_path / "old")
    assert new["accuracy_matrix"] == old["accuracy_matrix"]
    assert new["method_metrics"] == old["method_metrics"]  # ranks, importance, growth, pruned entries
    for t in range(3):
        a = load_checkpoint(tmp_path / "new" / "checkpoints" / f"task_{t:03d}.safetensors")
        b = load_checkpoint(tmp_path / "old" / "checkpoints" / f"task_{t:03d}.safetensors")
        assert a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
    if method == "halrp" and "prune_q" in options:
        assert new["method_metrics"]["pruned_entries"][-1] > 0  # the pruning path ran too


def test_task_logits_are_the_slice_of_the_routed_output(tmp_path):
    cfg = parse_config(tiny_lenet_cfg("halrp", prune=False))
    scenario, model, _, _ = engine_run.prepare(cfg)
    run_experiment(cfg, tmp_path / "run")
    state, _, meta = load_checkpoint(tmp_path / "run" / "checkpoints" / "task_002.safetensors")
    rebuild_structure(model, meta["structure"])
    model.load_state_dict(state, strict=True)
    routed = TaskRoutedModel(model).eval()
    x = torch.rand(9, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = routed(x)
        for t in range(3):
            lo, hi = routed.task_range(t)
            assert (lo, hi) == scenario.tasks[t].class_range
            assert torch.equal(routed.task_logits(x, t), full[:, lo:hi])
    assert routed.task_range(3) is None
    fast = evaluate_tasks(routed, scenario.tasks, n_outputs=30, batch_size=7, til_only=True)
    slow = evaluate_tasks(routed, scenario.tasks, n_outputs=30, batch_size=7)
    assert [r["til_acc"] for r in fast] == [r["til_acc"] for r in slow]
    assert all(r["acc"] is None and r["loss"] is None for r in fast)
    assert all(r["acc"] is not None for r in slow)
