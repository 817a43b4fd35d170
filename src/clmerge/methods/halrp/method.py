"""``halrp``: Hessian-aware low-rank perturbation (Li et al., TKDE 2024, Algorithm 1).

Task 0 trains the whole network, which becomes the frozen base. Every later task t:
1. warms up a free copy of the network (base hidden layers + new head) for ``warmup_epochs`` (step 2a);
2. per layer solves r, s in closed form (Eqs. 19-20), takes the residual B^free (Eq. 18) and its SVD (Eq. 5);
3. scores every singular component by c_l * g_l * sigma^2 (Sec. 4.3) and keeps, globally, the top components
   up to a fraction alpha of the total score (Eq. 11), each layer's rank clamped to [1, upper_rank];
4. initialises the task's factors (Eq. 6) with biases, BN and head from the warm-up, then fine-tunes only them
   with the L1/L2 penalties of Eq. 12 (the engine's training loop);
5. prunes small U', V' entries when growth exceeds the budget (Sec. 4.4, code's mixed rule).
Evaluation routes each task's head through the network with that task's parameters (``TaskRoutedModel``).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from ...adapters.task_modules import TaskBatchNorm, TaskRoutedModel, set_active_task, wrap_batchnorms
from ...models.losses import classification_loss
from ...utils.precision import full_precision
from ..base import ContinualMethod, register_method
from . import low_rank_perturbation as lrp
from .layers import halrp_layers, wrap_halrp_layers
from .options import HALRPOptions

__all__ = ["HALRP", "HALRPOptions", "official_growth", "task_parameter_count"]


def _task_bns(module: nn.Module) -> dict[str, TaskBatchNorm]:
    return {n: m for n, m in module.named_modules() if isinstance(m, TaskBatchNorm)}


def task_parameter_count(model: nn.Module, task: int, *, with_biases: bool = True, with_bn_buffers: bool = True,
                         dense: bool = False) -> int:
    """Stored numbers of one task: r, s, U'/V' entries, [biases], BN affine [and running stats], head block.

    Args:
        model: the HALRP-wrapped classifier.
        task: 0 counts the base network (weights, biases, BN, head 0); t >= 1 the task's private numbers.
        with_biases: count the per-task conv/linear biases (the official code excludes them from the growth).
        with_bn_buffers: count BatchNorm running statistics; the official ``count_parameter`` counts
            ``parameters()`` only, so it leaves them out (and so does the official base size).
        dense: count every U'/V' entry, zeros included (official ``count_parameter(sparse=False)``, the count its
            pruning budget uses); otherwise only the non-zero entries (the stored, sparse count).
    """
    n = 0
    for layer in halrp_layers(model.backbone).values():
        if task == 0:
            n += sum(p.numel() for p in layer.base_layer.parameters() if with_biases or p.dim() > 1)
            continue
        f = layer.factors(task)
        n += f.r.numel() + f.s.numel()
        n += f.u.numel() + f.v.numel() if dense else int((f.u != 0).sum()) + int((f.v != 0).sum())
        n += f.bias.numel() if (with_biases and f.bias is not None) else 0
    for bn in _task_bns(model.backbone).values():
        n += sum(p.numel() for p in bn.per_task[task].parameters())
        if with_bn_buffers:
            n += sum(b.numel() for k, b in bn.per_task[task].named_buffers() if k != "num_batches_tracked")
    return n + sum(p.numel() for p in model.head.blocks[task].parameters())


def official_growth(model: nn.Module, t: int, *, dense: bool) -> float:
    """``count_parameter(sparse=not dense) / baseSize - 1`` of the official code after task t (Sec. 4.4).

    The base size is ``sum(p.numel() for p in model.parameters())`` of the task-0 network (weights, biases, BN
    affine, head 0; no BN running statistics); each task adds r, s, U', V' (all entries if ``dense``, else the
    non-zero ones), its BN affine parameters and its head; per-task biases are not counted.
    """
    base = task_parameter_count(model, 0, with_bn_buffers=False)
    extra = sum(task_parameter_count(model, k, with_biases=False, with_bn_buffers=False, dense=dense)
                for k in range(1, t + 1))
    return extra / base


@register_method
class HALRP(ContinualMethod):
    name = "halrp"
    description = "HALRP: frozen base + per-task row/column scalings and Hessian-aware low-rank residuals"
    Options = HALRPOptions
    # the paper's rate (Adam 1e-3 in most of its configs, src/clmerge/configs/paper/halrp_*.yaml); HALRP is
    # not in the validation grid
    optim_defaults = {"lr": 1e-3}
    optim_source = "paper (Adam 1e-3, its configs' rate; its networks are trained from scratch)"

    def setup(self, model) -> None:
        super().setup(model)
        wrap_halrp_layers(model.backbone)
        wrap_batchnorms(model.backbone)
        model.requires_grad_(True)

    # -- task start ------------------------------------------------------------------------------------------
    def begin_task(self, task, ctx) -> None:
        super().begin_task(task, ctx)
        t = task.index
        if len(self.model.head.blocks) != t + 1:
            raise ValueError("halrp needs one head block per task (scenario.kind: task_incremental)")
        if t == 0:
            self._train_base_extra(task, ctx)
            return
        free = self._warm_up(task, ctx)
        ranks = self._select_ranks(free, task, ctx)
        self._init_task(free, t, ranks, ctx)
        self._freeze_all_but(t)
        set_active_task(self.model, t)

    def _train_base_extra(self, task, ctx) -> None:
        set_active_task(self.model, 0)
        self.model.requires_grad_(True)
        if self.options.first_task_extra_epochs and ctx.fit is not None:
            ctx.fit(model=self.model, data=task.train, groups=self.parameter_groups(self.model),
                    loss_fn=lambda m, x, y: self.loss(m, x, y, ctx), epochs=self.options.warmup_epochs,
                    desc="halrp base (extra epochs)")

    def _warm_up(self, task, ctx) -> nn.Module:
        """Step 2a: a free copy (base hidden layers, BN_0, biases_0, head_t) trained with plain CE."""
        free = copy.deepcopy(self.model)
        set_active_task(free, 0)
        free.requires_grad_(False)
        if self.options.warmup_from == "scratch":
            for m in free.backbone.modules():
                if hasattr(m, "reset_parameters") and not isinstance(m, TaskBatchNorm):
                    m.reset_parameters()
        body = [p for layer in halrp_layers(free.backbone).values() for p in layer.base_layer.parameters()]
        body += [p for bn in _task_bns(free.backbone).values() for p in bn.per_task[0].parameters()]
        head = list(free.head.blocks[task.index].parameters())
        for p in body + head:
            p.requires_grad_(True)
        if ctx.fit is None:
            raise RuntimeError("halrp needs the engine's training loop (TaskContext.fit) for its warm-up")
        groups = [{"params": body, "name": "body"}, {"params": head, "name": "head"}]
        res = ctx.fit(model=free, data=task.train, groups=groups,
                      loss_fn=lambda m, x, y: classification_loss(m(x), y, task, ctx.head_loss),
                      epochs=self.options.warmup_epochs, desc=f"halrp warm-up task {task.index}")
        self.record("warmup_loss", res["losses"][-1])
        return free

    # -- rank selection ------------------------------------------------------------------------------------
    @full_precision
    def _importance(self, free: nn.Module, task, ctx) -> dict[str, float]:
        """g_l (Sec. 4.3; computed as the official code does): squared mini-batch gradients w.r.t. W_l at W^free, eval mode, true labels."""
        o = self.options
        layers = halrp_layers(free.backbone)
        if o.importance == "none":
            return {n: 1.0 for n in layers}
        data = task.val if (o.importance_split == "val" and task.val is not None and len(task.val)) else task.train
        sums = {n: 0.0 for n in layers}
        n_batches = 0
        free.eval()
        for x, y in data.batches(ctx.batch_size, max_batches=o.importance_batches):
            free.zero_grad(set_to_none=True)
            classification_loss(free(x.to(ctx.device)), y.to(ctx.device), task, "local").backward()
            for name, layer in layers.items():
                g2 = layer.base_layer.weight.grad.double().pow(2)
                sums[name] += float(g2.mean() if o.importance == "mean" else g2.sum()) * len(x)
            n_batches += 1
        free.zero_grad(set_to_none=True)
        return {n: s / max(n_batches, 1) for n, s in sums.items()}

    def _select_ranks(self, free: nn.Module, task, ctx) -> dict[str, dict]:
        """Steps 2b-2f: scalings, residual SVD, scores and the global cut; returns per-layer init data."""
        o = self.options
        g = self._importance(free, task, ctx)
        main_layers, free_layers = halrp_layers(self.model.backbone), halrp_layers(free.backbone)
        info: dict[str, dict] = {}
        for name, layer in main_layers.items():
            w_base = layer.base_layer.weight.detach()
            w_free = free_layers[name].base_layer.weight.detach()
            r, s = lrp.least_squares_scalings(w_free, w_base, column_scale=o.column_scale)
            b = lrp.residual_matrix(w_free, w_base, r, s)
            svd = lrp.residual_svd(b)  # one SVD per layer: its sigma ranks, its vectors initialise (2g)
            if o.sigma_source == "residual":
                sigma = svd[1]
            else:  # Eq. 9 as printed uses W^free
                w_mat = w_free.double().mean((2, 3)) if w_free.dim() == 4 else w_free.double()
                sigma = torch.linalg.svdvals(w_mat)
            info[name] = {"r": r, "s": s, "b": b, "svd": svd, "sigma": sigma,
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

    def _init_task(self, free: nn.Module, t: int, info: dict[str, dict], ctx) -> None:
        """Step 2g: factors from the SVD (Eq. 6), biases, BN and head_t carried over from the warm-up."""
        free_bns = _task_bns(free.backbone)
        with torch.no_grad():
            for name, layer in halrp_layers(self.model.backbone).items():
                d = info[name]
                f = layer.add_task(t, d["rank"])
                u, v = lrp.factors_from_svd(*d["svd"], d["rank"])
                if self.options.factor_init == "random":
                    u, v = self._random_like(u, ctx.generator), self._random_like(v, ctx.generator)
                f.r.copy_(d["r"]), f.s.copy_(d["s"]), f.u.copy_(u), f.v.copy_(v)
                if f.bias is not None:
                    f.bias.copy_(d["bias"])
            for name, bn in _task_bns(self.model.backbone).items():
                bn.add_task(free_bns[name].per_task[0])
            self.model.head.blocks[t].load_state_dict(free.head.blocks[t].state_dict())

    @staticmethod
    def _random_like(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        z = torch.randn(x.shape, generator=generator, dtype=torch.float64)
        return z * (x.norm() / z.norm().clamp_min(1e-30))

    def _freeze_all_but(self, t: int) -> None:
        """Only task t's factors, biases, BN and head train (step 2h); W_base and earlier tasks stay frozen."""
        self.model.requires_grad_(False)
        for layer in halrp_layers(self.model.backbone).values():
            layer.factors(t).requires_grad_(True)
        for bn in _task_bns(self.model.backbone).values():
            bn.per_task[t].requires_grad_(True)
        self.model.head.blocks[t].requires_grad_(True)

    # -- training ------------------------------------------------------------------------------------------
    def loss(self, model, x, y, ctx) -> torch.Tensor:
        """CE + lambda0 sum(|U'|_1 + |V'|_1) + lambda1 [1/2] sum(||r||^2 + ||s||^2 + ||U'||^2 + ||V'||^2) (Eq. 12)."""
        base = super().loss(model, x, y, ctx)
        o, t = self.options, ctx.task.index
        l2_factor = 0.5 if o.l2_half else 1.0
        layers = halrp_layers(self.model.backbone).values()
        if t == 0:
            if not o.base_l2:
                return base
            return base + 0.5 * o.lambda_l2 * sum(layer.base_layer.weight.pow(2).sum() for layer in layers)
        l1 = l2 = 0.0
        for layer in layers:
            f = layer.factors(t)
            l1 = l1 + f.u.abs().sum() + f.v.abs().sum()
            l2 = l2 + f.r.pow(2).sum() + f.s.pow(2).sum() + f.u.pow(2).sum() + f.v.pow(2).sum()
        return base + o.lambda_l1 * l1 + l2_factor * o.lambda_l2 * l2

    def before_step(self, model, ctx) -> None:
        if self.options.grad_multiplier != 1.0:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.options.grad_multiplier)

    # -- task end ------------------------------------------------------------------------------------------
    def end_task(self, task, ctx) -> None:
        t = task.index
        self.model.requires_grad_(False)
        pruned = self._prune(t) if (self.options.prune and t > 0) else 0
        self.record("pruned_entries", pruned)
        parts = self.growth_parts(t)
        self.record("growth", parts["total"])
        self.record("growth_lowrank", parts["lowrank"])
        self.record("growth_fixed", parts["fixed"])
        self.record("growth_official", official_growth(self.model, t, dense=False))
        self._metrics["bytes_per_task"] = [4 * task_parameter_count(self.model, k) for k in range(t + 1)]

    def relative_growth(self, t: int) -> float:
        """(base + all task-private numbers, per-task biases excluded, non-zero U'/V' only) / base - 1 (Sec. 4.4)."""
        base = task_parameter_count(self.model, 0)
        extra = sum(task_parameter_count(self.model, k, with_biases=False) for k in range(1, t + 1))
        return extra / base

    def growth_parts(self, t: int) -> dict[str, float]:
        """Growth after task t split into ``lowrank`` (non-zero U'/V' entries, the only prunable part) and ``fixed``
        (r, s, BN, heads), each relative to the base as in :meth:`relative_growth`; ``total`` is their sum."""
        base = task_parameter_count(self.model, 0)
        total = sum(task_parameter_count(self.model, k, with_biases=False) for k in range(1, t + 1))
        low = sum(int((f.u != 0).sum()) + int((f.v != 0).sum()) for layer in halrp_layers(self.model.backbone).values()
                  for k in range(1, t + 1) for f in [layer.factors(k)])
        return {"total": total / base, "lowrank": low / base, "fixed": (total - low) / base}

    def _factor_values(self, tasks: list[int], *, nonzero: bool = False) -> torch.Tensor:
        parts = [torch.cat([f.u.detach().abs().flatten(), f.v.detach().abs().flatten()])
                 for layer in halrp_layers(self.model.backbone).values() for k in tasks for f in [layer.factors(k)]]
        vals = torch.cat(parts).double().cpu()
        return vals[vals != 0] if nonzero else vals

    def _prune_rate(self, t: int) -> float | None:
        """The share of U'/V' entries to zero (None: within budget); see the ``prune_budget`` option.

        ``code`` transcribes the official ``l1_pruning`` with ``prune_boundAlltask``: inc = dense growth
        (:func:`official_growth`), no pruning if inc < 1 - q, else rate = 1 - (1 - q) / inc.
        """
        o = self.options
        budget = 1 - o.prune_q
        if o.prune_budget in ("code", "nonzero_count"):
            inc = (official_growth(self.model, t, dense=True) if o.prune_budget == "code"
                   else self.growth_parts(t)["total"])
            return None if inc < budget else 1 - budget / inc
        g = self.growth_parts(t)
        if g["total"] <= budget or g["lowrank"] == 0:
            return None
        return min(1.0, 1 - max(0.0, budget - g["fixed"]) / g["lowrank"])

    def _prune(self, t: int) -> int:
        """Budget pruning (Sec. 4.4, code's mixAR_AllLayer): if growth >= 1 - q, zero the smallest U'/V' entries."""
        o = self.options
        rate = self._prune_rate(t)
        if rate is None:
            return 0
        groups = [[k] for k in range(1, t + 1)] if o.prune_scope == "per_task" else [list(range(1, t + 1))]
        zeroed = 0
        exact = o.prune_budget == "total"  # percentile over the entries still non-zero, so the count is met
        with torch.no_grad():
            for tasks in groups:
                vals = self._factor_values(tasks, nonzero=exact).numpy()
                if not len(vals):
                    continue
                q = float(np.percentile(vals, 100 * rate)) if rate < 1 else float(vals.max())
                thr = max(o.prune_abs, q)
                for layer in halrp_layers(self.model.backbone).values():
                    for k in tasks:
                        f = layer.factors(k)
                        for p in (f.u, f.v):
                            mask = (p.abs() <= thr) & (p != 0)
                            zeroed += int(mask.sum())
                            p.masked_fill_(mask, 0.0)
        return zeroed

    def inference_model(self) -> nn.Module:
        return TaskRoutedModel(self.model)
