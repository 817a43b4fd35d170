"""Merge-based baselines of LoRA-P&M's Table 3 on the sequential LoRA pipeline: ``lora_avg``, ``lora_dare``,
``coma``, ``cofima``.

Setting (P&M, Qiu et al. 2025, Sec. 4.3 and Table 3, whose rows are "LoRA w/ <merge>": every merge is applied
on top of the sequential LoRA pipeline): for task t a new rank-r LoRA on the key and value projections of every
block (the P&M sites) is trained like ``seq_lora`` (no perturbation) from the inference model of the
previous task, giving ``theta*_t = theta^_{t-1} + A_t B_t`` (Eq. 2). Instead of being folded with weight 1,
it is merged into the running model by the baseline's rule, restricted (like P&M's alpha) to the adapted
weight matrices; the per-task heads are not merged. The merges are computed by :mod:`clmerge.merging`.

- ``lora_avg`` (model averaging; the paper does not give its weights, alpha_t = 1/t is the uniform reading):
  ``theta^_t = ((t-1) theta^_{t-1} + theta*_t) / t``, the running uniform average of the task models
  (``merging.weight_average``); ``weighting: pair`` is the alternative fixed 1/2.
- ``lora_dare`` (Yu et al. 2024): drop each entry of the task vector ``tau_t = theta*_t - theta^_{t-1}`` with
  probability p, rescale the rest by 1/(1-p), and merge it with the model-averaging weight:
  ``theta^_t = theta^_{t-1} + c_t DARE_p(tau_t)``, ``c_t = 1/t`` unless ``scaling`` is set
  (``merging.dare`` with ``combine="task_arithmetic"``). P&M gives no drop rate: p = 0.5 [choice].
- ``coma`` (Marouf et al., ECCV 2024, "Weighted ensemble models are strong continual learners"):
  ``theta^_t = (1 - a) theta^_{t-1} + a theta*_t`` for t >= 2 with a fixed ``a`` (official code
  ``IemProg/CoFiMA``, ``interpolate_weights``, ``wt_alpha = 0.4`` in its CIFAR-100 and ImageNet-R configs);
  task 1 is not merged (the code merges from the second task on).
- ``cofima`` (same paper): the per-parameter Fisher-weighted version (official code, ``interpolate_weights``
  with ``fisher=True``),
  ``theta^_t = ((1-a) F_{t-1} theta^_{t-1} + a F_t theta*_t) / ((1-a) F_{t-1} + a F_t)``, with ``F_t`` the
  diagonal empirical Fisher at ``theta*_t`` on task t's training set and ``F_{t-1}`` the previous task's
  (the code's ``fisher_mat[-2:]``); ``merging.fisher_merging`` with weights (1-a, a). The Fisher is the mean of
  per-sample squared gradients (as P&M's, ``params.diagonal_fisher``); the official code squares mini-batch
  mean gradients of the full-logit loss and clips the Fisher at ``1e-4`` (``fisher_max`` reproduces the clip).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Literal

import torch
from pydantic import Field

from .. import merging
from ..adapters import lora_layers
from ..params import diagonal_fisher
from .base import grid_rate, register_method
from .seq_lora import LoRAMethodOptions, SeqLoRA
from ..utils.progress import phase

__all__ = ["MergeBaselineOptions", "LoRAAverage", "LoRADare", "CoMA", "CoFiMA", "average_step", "dare_step",
           "coma_step", "cofima_step"]

Weights = dict[str, torch.Tensor]


# -- the merge rules on weight dicts (float64 results) ---------------------------------------------------------
def average_step(prev: Weights, star: Weights, t: int, weighting: str = "running_mean") -> Weights:
    """Model averaging: ``((t-1) prev + star) / t`` (t is 1-based), or ``(prev + star) / 2`` with ``pair``."""
    w = [t - 1.0, 1.0] if weighting == "running_mean" else ([0.0, 1.0] if t == 1 else [1.0, 1.0])
    return merging.weight_average(experts=[prev, star], weights=w)


def dare_step(prev: Weights, star: Weights, scaling: float, drop_rate: float, seed: int) -> Weights:
    """``prev + scaling * m * (star - prev) / (1 - p)``, ``m ~ Bernoulli(1 - p)`` per entry (DARE Eq. 1-2)."""
    return merging.dare(base=prev, experts=[star], drop_rate=drop_rate, rescale=True, seed=seed,
                        combine="task_arithmetic", scaling=scaling)


def coma_step(prev: Weights, star: Weights, alpha: float) -> Weights:
    """CoMA: ``(1 - alpha) prev + alpha star``."""
    return merging.weight_average(experts=[prev, star], weights=[1.0 - alpha, alpha])


def cofima_step(prev: Weights, star: Weights, f_prev: Weights, f_star: Weights, alpha: float,
                min_fisher: float) -> Weights:
    """CoFiMA: ``((1-a) F_p prev + a F_s star) / ((1-a) F_p + a F_s)`` per entry (``min_fisher`` added to F)."""
    return merging.fisher_merging(experts=[prev, star], fishers=[f_prev, f_star], weights=[1.0 - alpha, alpha],
                                  min_fisher=min_fisher)


# -- options ----------------------------------------------------------------------------------------------------
class MergeBaselineOptions(LoRAMethodOptions):
    targets: list[str] = Field(default_factory=lambda: ["key", "value"],
                               description="LoRA sites: key and value (the P&M pipeline the baselines share)")


class AverageOptions(MergeBaselineOptions):
    weighting: Literal["running_mean", "pair"] = Field(
        "running_mean", description="running_mean: alpha_t = 1/t, the uniform average of all task models "
        "(the paper does not give the weights); pair: alpha_t = 1/2")


class DareOptions(MergeBaselineOptions):
    drop_rate: float = Field(0.5, ge=0, lt=1, description="DARE drop probability p (not given by P&M; choice)")
    scaling: float | None = Field(None, gt=0, description="merge weight of the rescaled task vector (None: 1/t, "
                                  "the model-averaging weight)")


class CoMAOptions(MergeBaselineOptions):
    alpha: float = Field(0.4, ge=0, le=1, description="weight of the new task model (official CoFiMA code "
                         "wt_alpha = 0.4 for CIFAR-100 and ImageNet-R)")


class CoFiMAOptions(CoMAOptions):
    min_fisher: float = Field(1e-12, ge=0, description="floor added to every Fisher entry (avoids 0/0)")
    fisher_max: float | None = Field(None, gt=0, description="clip the Fisher at this value (official code: "
                                     "1e-4 on batch-gradient Fishers; None: no clip, as the paper)")
    fisher_samples: int | None = Field(None, ge=1, description="training samples for the Fisher (None: all)")
    fisher_batch: int = Field(32, ge=1, description="batch size of the vectorised per-sample gradients")


# -- the shared pipeline ----------------------------------------------------------------------------------------
class _LoRAMergeBaseline(SeqLoRA, ABC):
    """Sequential LoRA (setup and per-task components as ``seq_lora``) whose task model is merged into the
    running model at the task end instead of being folded in plainly."""
    optim_defaults, optim_source = grid_rate(5e-3)

    @abstractmethod
    def merge(self, prev: Weights, star: Weights, task, ctx) -> tuple[Weights, dict]:
        """Return the merged adapted weights and what to log. ``prev`` = theta^_{t-1}, ``star`` = theta*_t."""

    @torch.no_grad()
    def end_task(self, task, ctx) -> None:
        layers = lora_layers(self.model.backbone)
        prev = {n: layer.base_layer.weight.detach().float().cpu() for n, layer in layers.items()}
        star = {n: layer.merged_weight().detach().float().cpu() for n, layer in layers.items()}
        with torch.enable_grad():
            merged, info = self.merge(prev, star, task, ctx)
        for n, layer in layers.items():
            w = layer.base_layer.weight
            w.copy_(merged[n].to(device=w.device, dtype=w.dtype))
            del layer.components[f"task{task.index}"]
        info = {"task": task.index, **info}
        self.record("merge", info)
        ctx.log({"event": f"{self.name}_merge", **info})


def _seq_index(task) -> int:
    return task.index + 1  # the 1-based position t of the task in the sequence


@register_method
class LoRAAverage(_LoRAMergeBaseline):
    name = "lora_avg"
    description = "LoRA + model averaging (P&M Table 3): theta^_t = ((t-1) theta^_{t-1} + theta*_t) / t"
    Options = AverageOptions

    def merge(self, prev, star, task, ctx):
        t = _seq_index(task)
        coef = 1.0 / t if self.options.weighting == "running_mean" else (1.0 if t == 1 else 0.5)
        return average_step(prev, star, t, self.options.weighting), {"coefficient": coef}


@register_method
class LoRADare(_LoRAMergeBaseline):
    name = "lora_dare"
    description = "LoRA + DARE (P&M Table 3): drop-and-rescale the task vector, merge it with weight 1/t"
    Options = DareOptions

    def merge(self, prev, star, task, ctx):
        o, t = self.options, _seq_index(task)
        c = o.scaling if o.scaling is not None else 1.0 / t
        seed = self.seed * 1_000 + task.index
        return dare_step(prev, star, c, o.drop_rate, seed), {"coefficient": c, "drop_rate": o.drop_rate}


@register_method
class CoMA(_LoRAMergeBaseline):
    name = "coma"
    description = "LoRA + CoMA (P&M Table 3): theta^_t = (1-a) theta^_{t-1} + a theta*_t, fixed a"
    Options = CoMAOptions

    def merge(self, prev, star, task, ctx):
        if task.index == 0:
            return star, {"coefficient": 1.0}
        return coma_step(prev, star, self.options.alpha), {"coefficient": self.options.alpha}


@register_method
class CoFiMA(_LoRAMergeBaseline):
    name = "cofima"
    description = "LoRA + CoFiMA (P&M Table 3): Fisher-weighted average of consecutive task models"
    Options = CoFiMAOptions

    def setup(self, model) -> None:
        super().setup(model)
        self.prev_fisher: Weights = {}

    def _fisher(self, task, ctx) -> Weights:
        """Diagonal empirical Fisher at theta*_t of the adapted weights (per-sample squares, task t's train set)."""
        o = self.options
        layers = lora_layers(self.model.backbone)
        names = [f"backbone.{n}.base_layer.weight" for n in layers]  # dL/dW_base = dL/dW_eff (W is linear)
        lo, hi = task.class_range
        local = ctx.head_loss == "local"
        batches = phase(((x.to(ctx.device), (y - lo if local else y).to(ctx.device))
                         for x, y in task.train.batches(o.fisher_batch, shuffle=False)),
                        f"{self.name}: Fisher of task {task.index + 1}", total=task.train.num_batches(o.fisher_batch))
        logits_fn = (lambda m, x: m(x)[:, lo:hi]) if local else (lambda m, x: m(x)[:, :hi])
        fisher = diagonal_fisher(self.model, names, batches, max_samples=o.fisher_samples, logits_fn=logits_fn)
        out = {n[len("backbone."):-len(".base_layer.weight")]: f.float().cpu() for n, f in fisher.items()}
        if o.fisher_max is not None:
            out = {n: f.clamp(max=o.fisher_max) for n, f in out.items()}
        return out

    def merge(self, prev, star, task, ctx):
        o = self.options
        fisher = self._fisher(task, ctx)
        if task.index == 0 or not self.prev_fisher:
            merged, info = star, {"coefficient": 1.0}
        else:
            merged = cofima_step(prev, star, self.prev_fisher, fisher, o.alpha, o.min_fisher)
            self.last_fishers = (self.prev_fisher, fisher)
            info = {"coefficient": o.alpha}
        self.prev_fisher = fisher
        info["fisher_mean"] = float(sum(f.double().sum() for f in fisher.values())
                                    / sum(f.numel() for f in fisher.values()))
        return merged, info

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"prev_fisher/{n}": f for n, f in self.prev_fisher.items()}

    def load_state(self, tensors, meta) -> None:
        super().load_state(tensors, meta)
        self.prev_fisher = {k[len("prev_fisher/"):]: v.cpu() for k, v in tensors.items()
                            if k.startswith("prev_fisher/")}
