"""InfLoRA (Liang & Li, CVPR 2024): interference-free LoRA, the baseline whose protocol LoRA-P&M follows.

Per task t, on key and value of every block (official code ``liangyanshuo/InfLoRA``, anchors section 5):
1. before training, the input covariance C = E[x x^T] of each adapted layer (mean over all tokens of the
   task's training set) is projected away from the old tasks' input subspace kept by DualGPM:
   ``remove`` mode (basis B of the old space): C <- C - B B^T C; ``retain`` mode (basis R of the free space):
   C <- R R^T C. The down-projection (InfLoRA's A, clmerge's ``lora_down``) is set to the top-r left singular
   vectors of C, divided by sqrt(3), and frozen;
2. only the up-projection (InfLoRA's B, clmerge's ``lora_up``, zero-initialised) and the head are trained;
3. after training, the covariance is measured again and the DualGPM bases are updated with the threshold
   lamb + (lame - lamb) t / T; a ``remove`` basis wider than d/2 is replaced by its complement (``retain``).
Heads: one block per task, concatenated at test time; the ``local`` head loss trains only the current block.

Note: the official code stores the first task's basis as a ``retain`` basis when it is wider than d/2 (an
``assert`` then fails at the summary); here the first task always starts in ``remove`` mode and is converted
by the same d/2 rule, which is what the summary step intends. As in the code, the SVD criteria are applied to
the covariance matrix itself (its singular values squared).
"""

from __future__ import annotations

import math

import torch
from pydantic import Field

from ..adapters import add_lora_component, fold_component, inject_lora, lora_layers
from .base import ContinualMethod, grid_rate, register_method
from .seq_lora import LoRAMethodOptions
from ..utils.precision import full_precision
from ..utils.progress import phase

__all__ = ["InfLoRA", "InfLoRAOptions", "update_dual_gpm", "project_covariance", "input_covariances"]


class InfLoRAOptions(LoRAMethodOptions):
    targets: list[str] = Field(default_factory=lambda: ["key", "value"], description="k and v (official code)")
    lamb: float = Field(0.95, gt=0, le=1, description="DualGPM threshold at task 0 (code: 0.95 CIFAR, 0.98 ImageNet-R)")
    lame: float = Field(1.0, gt=0, le=1, description="DualGPM threshold reached at the last task (code: 1.0)")
    a_scale: float = Field(1 / math.sqrt(3), gt=0, description="scale of the designed down-projection (code: 1/sqrt 3)")
    covariance_samples: int | None = Field(None, ge=1, description="training images for the covariance (None: all)")
    fold: bool = Field(True, description="fold each task's LoRA into the base weights after the task "
                       "(same function; LibContinual's InfLoRA_opt)")


@full_precision
@torch.no_grad()
def input_covariances(model: torch.nn.Module, layers: dict, data, *, batch_size: int, device,
                      max_samples: int | None = None) -> dict[str, torch.Tensor]:
    """E[x x^T] over all tokens of the inputs of each layer in ``layers`` (float64, on CPU)."""
    sums = {n: None for n in layers}
    counts = dict.fromkeys(layers, 0)

    def hook(name):
        def fn(module, inp):
            x = inp[0].detach().double().reshape(-1, inp[0].shape[-1])  # (tokens, d)
            s = (x.t() @ x).cpu()
            sums[name] = s if sums[name] is None else sums[name] + s
            counts[name] += x.shape[0]
        return fn

    handles = [layer.register_forward_pre_hook(hook(n)) for n, layer in layers.items()]
    was_training, seen = model.training, 0
    model.eval()
    try:
        for x, _ in phase(data.batches(batch_size, shuffle=False), "inflora: input covariances",
                          total=data.num_batches(batch_size)):
            if max_samples is not None:
                x = x[: max_samples - seen]
            if len(x) == 0:
                break
            model(x.to(device))
            seen += len(x)
            if max_samples is not None and seen >= max_samples:
                break
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return {n: s / max(counts[n], 1) for n, s in sums.items()}


def project_covariance(cov: torch.Tensor, basis: torch.Tensor | None, kind: str | None) -> torch.Tensor:
    """Remove the old tasks' subspace from C (``remove``: C - B B^T C) or keep the free one (``retain``: R R^T C)."""
    if basis is None:
        return cov
    proj = basis @ basis.t()
    return cov - proj @ cov if kind == "remove" else proj @ cov


def _first_basis(act: torch.Tensor, threshold: float) -> torch.Tensor:
    u, s, _ = torch.linalg.svd(act, full_matrices=False)
    ratio = s.pow(2) / s.pow(2).sum()
    r = int((torch.cumsum(ratio, 0) < threshold).sum())
    return u[:, : max(r, 1)]


def _grow_remove(act: torch.Tensor, basis: torch.Tensor, threshold: float) -> torch.Tensor:
    total = torch.linalg.svdvals(act).pow(2).sum()
    u, s, _ = torch.linalg.svd(act - basis @ basis.t() @ act, full_matrices=False)
    ratio = s.pow(2) / total
    acc, r = float((total - s.pow(2).sum()) / total), 0
    while r < len(ratio) and acc < threshold:
        acc += float(ratio[r])
        r += 1
    return torch.cat([basis, u[:, :r]], 1)[:, : act.shape[0]] if r else basis


def _shrink_retain(act: torch.Tensor, basis: torch.Tensor, threshold: float) -> torch.Tensor:
    total = torch.linalg.svdvals(act).pow(2).sum()
    u, s, _ = torch.linalg.svd(basis @ basis.t() @ act, full_matrices=False)
    ratio = s.pow(2) / total
    acc, r = float(s.pow(2).sum() / total), 0
    while r < len(ratio) and acc >= 1 - threshold:
        acc -= float(ratio[r])
        r += 1
    if r == 0:
        return basis
    ur = u[:, :r]
    left, _, _ = torch.linalg.svd(basis - ur @ ur.t() @ basis, full_matrices=True)
    return left[:, : basis.shape[1] - r]


@full_precision
def update_dual_gpm(act: torch.Tensor, basis: torch.Tensor | None, kind: str | None,
                    threshold: float) -> tuple[torch.Tensor, str]:
    """One DualGPM update of one layer from its covariance ``act``; returns (basis, kind)."""
    act = act.double()
    if basis is None:
        basis, kind = _first_basis(act, threshold), "remove"
    elif kind == "remove":
        basis = _grow_remove(act, basis, threshold)
    else:
        basis = _shrink_retain(act, basis, threshold)
    d = act.shape[0]
    if kind == "remove" and basis.shape[1] > d / 2:  # keep the smaller of the two bases
        full, _, _ = torch.linalg.svd(basis, full_matrices=True)
        basis, kind = full[:, basis.shape[1]:], "retain"
    return basis, kind


@register_method
class InfLoRA(ContinualMethod):
    name = "inflora"
    description = "InfLoRA: per-task LoRA with the down-projection designed from inputs outside old tasks' subspace"
    Options = InfLoRAOptions
    optim_defaults, optim_source = grid_rate(5e-3)

    def setup(self, model) -> None:
        super().setup(model)
        model.backbone.requires_grad_(False)
        inject_lora(model.backbone, self.options.targets, magnitudes=model.lora_magnitudes)
        self.bases: dict[str, torch.Tensor] = {}
        self.kinds: dict[str, str] = {}

    def _covariances(self, task, ctx) -> dict[str, torch.Tensor]:
        return input_covariances(self.model, lora_layers(self.model.backbone), task.train,
                                 batch_size=ctx.eval_batch_size, device=ctx.device,
                                 max_samples=self.options.covariance_samples)

    def begin_task(self, task, ctx) -> None:
        super().begin_task(task, ctx)
        o = self.options
        self.model.to(ctx.device)
        covs = self._covariances(task, ctx)
        name = f"task{task.index}"
        comps = add_lora_component(self.model.backbone, name, o.rank, generator=ctx.generator, scale=o.scale())
        for (layer_name, cov), comp in zip(covs.items(), comps):
            cov = project_covariance(cov, self.bases.get(layer_name), self.kinds.get(layer_name))
            u, _, _ = torch.linalg.svd(cov, full_matrices=False)
            with torch.no_grad():
                comp.lora_down.copy_((u[:, : o.rank].t() * o.a_scale).to(comp.lora_down))
                comp.lora_up.zero_()
            comp.lora_down.requires_grad_(False)

    def end_task(self, task, ctx) -> None:
        o = self.options
        n_tasks = ctx.n_tasks or len(ctx.seen_tasks)
        threshold = o.lamb + (o.lame - o.lamb) * task.index / n_tasks
        covs = self._covariances(task, ctx)
        for n, cov in covs.items():
            self.bases[n], self.kinds[n] = update_dual_gpm(cov, self.bases.get(n), self.kinds.get(n), threshold)
        dims = {n: [int(b.shape[1]), self.kinds[n]] for n, b in self.bases.items()}
        self.record("gpm_dims", dims)
        ctx.log({"event": "inflora_gpm", "task": task.index, "threshold": threshold, "dims": dims})
        name = f"task{task.index}"
        if o.fold:
            fold_component(self.model.backbone, name)
        else:
            for layer in lora_layers(self.model.backbone).values():
                layer.components[name].requires_grad_(False)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"basis/{n}": b.contiguous() for n, b in self.bases.items()}

    def state_meta(self) -> dict:
        return {**super().state_meta(), "kinds": dict(self.kinds)}

    def load_state(self, tensors, meta) -> None:
        super().load_state(tensors, meta)
        self.bases = {k[len("basis/"):]: v.cpu().double() for k, v in tensors.items() if k.startswith("basis/")}
        self.kinds = dict(meta.get("kinds", {}))
