"""LoRA-P&M (Qiu et al. 2025, "Train with Perturbation, Infer after Merging", NeurIPS 2025).

Per task t (Algorithm 1):
1. a new LoRA component on key and value of every block (both factors trained, earlier tasks folded);
2. training with task-vector perturbation: the LoRA branch is scaled by (1 + eps~), eps~ drawn per
   mini-batch from {-eps, 0, +eps} with probabilities (p-, p0, p+), p+ = p- = (1 - p0) / 2 (Eq. 15). The loss
   is differentiated through the scale. Its expectation is the regularised loss of Eq. 14 with
   lambda = eps^2 (1 - p0) / 2 (Eq. 16);
3. after training, the diagonal empirical Fisher (Eq. 9-10) of the adapted weight matrices W_k, W_v at the
   trained weights, from per-sample gradients over the task's training set (formed from each layer's inputs
   and output gradients, or with ``torch.func``: option ``fisher_method``);
4. the closed-form coefficient of Eq. 8,
       alpha_t = - sum_i (theta^_{t-1} - theta*_i)^T F_i Delta_t / sum_i Delta_t^T F_i Delta_t,
   kept with running sums S_F = sum_i F_i and S_Fu = sum_i F_i * u_i (u_i = theta*_i - theta_0), so memory
   does not grow with the number of tasks; the per-task form is an option (tested equal);
5. merge W <- W + alpha_t * U_t D_t (the LoRA is folded, so inference costs the plain backbone).

Ablations (Table 4): ``perturbation: none`` (LoRA-M), ``gaussian`` (noise of the same Frobenius norm as
eps * Delta W_t), ``exact`` (the three-pass Eq. 14 loss).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from ..adapters import add_lora_component, inject_lora, lora_layers
from ..models.losses import classification_loss
from ..params import diagonal_fisher
from ..params.fisher import eager_attention, resolve_fisher_method  # noqa: F401  (eager_attention: exported)
from .base import ContinualMethod, grid_rate, register_method
from .seq_lora import LoRAMethodOptions
from ..utils.precision import full_precision
from ..utils.progress import phase

__all__ = ["PerturbAndMerge", "PMOptions", "sample_perturbation", "closed_form_alpha", "closed_form_alpha_stored",
           "eager_attention"]


class PMOptions(LoRAMethodOptions):
    targets: list[str] = Field(default_factory=lambda: ["key", "value"],
                               description="LoRA sites: key and value projections (paper, following InfLoRA)")
    perturbation: Literal["task_vector", "none", "gaussian", "exact"] = Field(
        "task_vector", description="task_vector: Eq. 15 sampled scale (paper); none: merge only (LoRA-M); "
        "gaussian: noise of equal Frobenius norm; exact: three forward passes of Eq. 14")
    eps: float = Field(0.5, gt=0, le=1, description="perturbation size epsilon (paper: 0.5)")
    p0: float = Field(1 / 3, ge=0, le=1, description="probability of no perturbation (paper: 1/3); "
                      "p+ = p- = (1 - p0) / 2")
    alpha_clip: bool = Field(True, description="clip alpha to [0, 1] (the convex-combination constraint under "
                             "Eq. 3; the paper never says; the raw value is always logged)")
    alpha_store: Literal["running_sums", "per_task"] = Field(
        "running_sums", description="running sums S_F, S_Fu (constant memory) or every task's Fisher and optimum")
    fisher_samples: int | None = Field(None, ge=1, description="training samples for the Fisher (None: the whole "
                                       "training set, as Eq. 10)")
    fisher_batch: int = Field(32, ge=1, description="batch size of the vectorised per-sample gradients")
    fisher_method: Literal["auto", "hooks", "func"] = Field(
        "auto", description="per-sample gradients for the Fisher (equal to float rounding): hooks = from each "
        "Linear's inputs and output gradients, one forward/backward per batch; func = torch.func vmap over grad; "
        "auto = hooks (the K/V weights are Linear weights)")
    fisher_eager_attention: bool = Field(True, description="switch HF attention to 'eager' during a 'func' Fisher "
                                         "pass (sdpa falls back to a slow path under vmap)")


def sample_perturbation(eps: float, p0: float, generator: torch.Generator | None = None) -> float:
    """Draw eps~ in {-eps, 0, +eps} with probabilities ((1-p0)/2, p0, (1-p0)/2) (Eq. 15)."""
    u = float(torch.rand((), generator=generator))
    p_side = (1.0 - p0) / 2.0
    return -eps if u < p_side else (eps if u < 2 * p_side else 0.0)


@full_precision
def closed_form_alpha(delta: dict[str, torch.Tensor], sum_f: dict[str, torch.Tensor],
                      sum_fu: dict[str, torch.Tensor], merged: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Eq. 8 from running sums; returns (numerator, denominator) with alpha = -num / den (float64).

    With M = theta^_{t-1} - theta_0 and sums over tasks i <= t (task t included):
    num = sum_k Delta[k] (S_F[k] M[k] - S_Fu[k]),  den = sum_k S_F[k] Delta[k]^2.
    """
    num = sum(float((delta[n].double() * (sum_f[n].double() * merged[n].double() - sum_fu[n].double())).sum())
              for n in delta)
    den = sum(float((sum_f[n].double() * delta[n].double().pow(2)).sum()) for n in delta)
    return num, den


@full_precision
def closed_form_alpha_stored(delta: dict[str, torch.Tensor], fishers: list[dict[str, torch.Tensor]],
                             optima: list[dict[str, torch.Tensor]], merged: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Eq. 8 literally, from every task's Fisher F_i and optimum u_i = theta*_i - theta_0; (num, den)."""
    num = den = 0.0
    for f_i, u_i in zip(fishers, optima):
        for n in delta:
            d, f = delta[n].double(), f_i[n].double()
            num += float((f * (merged[n].double() - u_i[n].double()) * d).sum())
            den += float((f * d * d).sum())
    return num, den


@register_method
class PerturbAndMerge(ContinualMethod):
    name = "pm"
    description = "LoRA-P&M: train with task-vector perturbation, merge with the closed-form Fisher alpha (Eq. 8)"
    Options = PMOptions
    optim_defaults, optim_source = grid_rate(5e-3)

    def setup(self, model) -> None:
        super().setup(model)
        model.backbone.requires_grad_(False)
        inject_lora(model.backbone, self.options.targets, magnitudes=model.lora_magnitudes)
        self.sum_f: dict[str, torch.Tensor] = {}
        self.sum_fu: dict[str, torch.Tensor] = {}
        self.merged: dict[str, torch.Tensor] = {}
        self.fishers: list[dict[str, torch.Tensor]] = []
        self.optima: list[dict[str, torch.Tensor]] = []

    def begin_task(self, task, ctx) -> None:
        super().begin_task(task, ctx)
        self.current = f"task{task.index}"
        add_lora_component(self.model.backbone, self.current, self.options.rank, generator=ctx.generator,
                           scale=self.options.scale())

    # -- training: perturbation (Eq. 13-16) --------------------------------------------------------------
    def _components(self):
        return [layer.components[self.current] for layer in lora_layers(self.model.backbone).values()
                if self.current in layer.components]

    @contextlib.contextmanager
    def _scaled(self, factor: float) -> Iterator[None]:
        comps = self._components()
        for c in comps:
            c.multiplier = factor
        try:
            yield
        finally:
            for c in comps:
                c.multiplier = 1.0

    def _ce(self, model, x, y, ctx) -> torch.Tensor:
        return classification_loss(model(x), y, ctx.task, ctx.head_loss)

    def loss(self, model, x, y, ctx) -> torch.Tensor:
        o = self.options
        if o.perturbation == "exact":  # Eq. 14 = p0 L(theta) + p+ L(theta + eps dtheta) + p- L(theta - eps dtheta)
            side = (1.0 - o.p0) / 2.0
            total = o.p0 * self._ce(model, x, y, ctx)
            for e in (o.eps, -o.eps):
                with self._scaled(1.0 + e):
                    total = total + side * self._ce(model, x, y, ctx)
            return total
        if o.perturbation == "none":
            return self._ce(model, x, y, ctx)
        e = sample_perturbation(o.eps, o.p0, ctx.generator)
        if e == 0.0:
            return self._ce(model, x, y, ctx)
        if o.perturbation == "task_vector":  # theta^_{t-1} + (1 + eps~) LoRA_t (Alg. 1 line 9)
            with self._scaled(1.0 + e):
                return self._ce(model, x, y, ctx)
        with self._gaussian_noise(abs(e), ctx.generator):
            return self._ce(model, x, y, ctx)

    @contextlib.contextmanager
    def _gaussian_noise(self, eps: float, generator: torch.Generator) -> Iterator[None]:
        """Add x N^T to each adapted layer, N Gaussian with ||N||_F = eps ||Delta W_t||_F (Table 4 ablation)."""
        handles = []
        for layer in lora_layers(self.model.backbone).values():
            if self.current not in layer.components:
                continue
            with torch.no_grad():
                size = eps * float(layer.delta_weight(self.current).norm())
                g = torch.randn(layer.out_features, layer.in_features, generator=generator)
                noise = (g * (size / max(float(g.norm()), 1e-12))).to(layer.base_layer.weight)
            handles.append(layer.register_forward_hook(lambda m, inp, out, n=noise: out + F.linear(inp[0], n.to(out.dtype))))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    # -- after the task: Fisher, alpha (Eq. 8), merge ------------------------------------------------------
    @full_precision
    def _fisher(self, task, ctx) -> dict[str, torch.Tensor]:
        o = self.options
        layers = lora_layers(self.model.backbone)
        names = [f"backbone.{n}.base_layer.weight" for n in layers]  # dL/dW_base = dL/dW_eff (linear in W)
        lo, hi = task.class_range
        local = ctx.head_loss == "local"
        batches = task.train.batches(o.fisher_batch, shuffle=False)
        batches = ((x.to(ctx.device), (y - lo if local else y).to(ctx.device)) for x, y in batches)
        logits_fn = (lambda m, x: m(x)[:, lo:hi]) if local else (lambda m, x: m(x)[:, :hi])
        method = resolve_fisher_method(self.model, names, o.fisher_method)
        eager = o.fisher_eager_attention and method == "func"
        guard = eager_attention(self.model) if eager else contextlib.nullcontext()
        n = -(-min(len(task.train), o.fisher_samples or len(task.train)) // o.fisher_batch)
        with guard, phase(batches, f"pm: Fisher of task {task.index + 1}", total=n) as batches:
            fisher = diagonal_fisher(self.model, names, batches, max_samples=o.fisher_samples, logits_fn=logits_fn,
                                     method=method)
        return {n[len("backbone."):-len(".base_layer.weight")]: f for n, f in fisher.items()}

    def end_task(self, task, ctx) -> None:
        o = self.options
        layers = lora_layers(self.model.backbone)
        t0 = time.time()
        fisher = self._fisher(task, ctx)
        fisher_s = time.time() - t0
        with torch.no_grad():
            delta = {n: layers[n].delta_weight(self.current).double().cpu() for n in layers}
        merged = {n: self.merged.get(n, torch.zeros_like(d)) for n, d in delta.items()}
        optimum = {n: merged[n] + delta[n] for n in delta}  # u_t = theta*_t - theta_0
        if o.alpha_store == "per_task":
            self.fishers.append({n: f.double().cpu() for n, f in fisher.items()})
            self.optima.append(optimum)
            num, den = closed_form_alpha_stored(delta, self.fishers, self.optima, merged)
        else:
            for n in delta:
                f = fisher[n].double().cpu()
                self.sum_f[n] = self.sum_f[n] + f if n in self.sum_f else f
                self.sum_fu[n] = self.sum_fu[n] + f * optimum[n] if n in self.sum_fu else f * optimum[n]
            num, den = closed_form_alpha(delta, self.sum_f, self.sum_fu, merged)
        raw = -num / den if den > 0 else 1.0
        alpha = min(1.0, max(0.0, raw)) if o.alpha_clip else raw
        for n, layer in layers.items():
            layer.components[self.current].multiplier = alpha
            layer.fold(self.current)
            self.merged[n] = merged[n] + alpha * delta[n]
        # tr(F_t): Eq. 8 weighs each task by its Fisher scale, so one large trace drives later alphas toward 0
        trace = float(sum(f.double().sum() for f in fisher.values()))
        info = {"task": task.index, "alpha": alpha, "alpha_raw": raw, "clipped": alpha != raw,
                "numerator": num, "denominator": den, "fisher_trace": trace, "fisher_seconds": round(fisher_s, 3)}
        self.record("alpha", alpha)
        self.record("alpha_raw", raw)
        self.record("fisher_trace", trace)
        ctx.log({"event": "pm_merge", **info})

    # -- checkpointed state --------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"merged/{n}": v for n, v in self.merged.items()}
        out.update({f"sum_f/{n}": v for n, v in self.sum_f.items()})
        out.update({f"sum_fu/{n}": v for n, v in self.sum_fu.items()})
        for i, (f_i, u_i) in enumerate(zip(self.fishers, self.optima)):
            out.update({f"fisher{i}/{n}": v for n, v in f_i.items()})
            out.update({f"optimum{i}/{n}": v for n, v in u_i.items()})
        return out

    def state_meta(self) -> dict:
        return {**super().state_meta(), "stored_tasks": len(self.fishers)}

    def load_state(self, tensors, meta) -> None:
        super().load_state(tensors, meta)

        def pick(prefix: str) -> dict[str, torch.Tensor]:
            return {k[len(prefix) + 1:]: v.cpu() for k, v in tensors.items() if k.startswith(prefix + "/")}

        self.merged, self.sum_f, self.sum_fu = pick("merged"), pick("sum_f"), pick("sum_fu")
        n = int(meta.get("stored_tasks", 0))
        self.fishers = [pick(f"fisher{i}") for i in range(n)]
        self.optima = [pick(f"optimum{i}") for i in range(n)]
