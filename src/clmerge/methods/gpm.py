"""``gpm``: Gradient Projection Memory (Saha, Garg, Roy, ICLR 2021), a baseline of HALRP (Li et al., TKDE 2024, Sec. 5.1).

After each task, every conv/linear layer's input representation R_l (linear: inputs as columns; conv: the
unfolded d x d patches) is collected on a few training samples. Its new directions, beyond the span of the
stored basis M_l, are added until the basis covers a fraction ``threshold`` of the representation's energy
(sum of squared singular values). While training later tasks, each weight gradient is projected onto the
orthogonal complement of the stored input space: G <- G - G M_l M_l^T (Eq. 8 of GPM), so the layer's response
to earlier tasks' inputs does not change. As in GPM, 1-D parameters (biases, BatchNorm) train on the first
task only, and BatchNorm layers use their stored statistics (eval mode) on later tasks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from .base import ContinualMethod, MethodOptions, register_method
from ..utils.precision import full_precision

__all__ = ["GPM", "GPMOptions", "extend_basis"]

_BN = (nn.BatchNorm1d, nn.BatchNorm2d)


class GPMOptions(MethodOptions):
    threshold: float = Field(0.97, gt=0, le=1, description="energy fraction kept in the memory after task 0")
    threshold_step: float = Field(0.003, ge=0, description="added to the threshold after every task (GPM's schedule)")
    samples: int = Field(125, ge=1, description="training samples used to build the representation matrices")
    max_columns: int = Field(4096, ge=1, description="cap on representation columns per layer (random subset)")


@full_precision
def extend_basis(rep: torch.Tensor, basis: torch.Tensor | None, threshold: float) -> torch.Tensor:
    """GPM memory update: add the fewest new directions of ``rep`` (d, n) so the energy criterion holds.

    Args:
        rep: representation matrix, one column per input (float64 recommended).
        basis: current orthonormal basis (d, m) or None.
        threshold: fraction of ||rep||_F^2 the memory must capture.

    Returns:
        The new basis (d, m'), m' >= m, columns orthonormal.
    """
    rep = rep.double()
    total = rep.pow(2).sum()
    if basis is None:
        u, s, _ = torch.linalg.svd(rep, full_matrices=False)
        frac = torch.cumsum(s**2, 0) / total.clamp_min(1e-300)
        k = int((frac < threshold).sum()) + 1
        return u[:, : min(k, len(s))]
    residual = rep - basis @ (basis.T @ rep)
    u, s, _ = torch.linalg.svd(residual, full_matrices=False)
    captured = (total - residual.pow(2).sum()) / total.clamp_min(1e-300)
    k = 0
    for v in (s**2 / total.clamp_min(1e-300)).tolist():
        if captured >= threshold:
            break
        captured += v
        k += 1
    out = torch.cat([basis, u[:, :k]], dim=1) if k else basis
    return out[:, : out.shape[0]]


def _layers(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.backbone.named_modules() if type(m) in (nn.Linear, nn.Conv2d)}


@register_method
class GPM(ContinualMethod):
    name = "gpm"
    description = "gradient projection memory: project weight gradients orthogonally to earlier tasks' input spaces"
    Options = GPMOptions
    # not in the evidence grid: selected on validation like it (split_mnist5k's protocol, val_fraction 0.1,
    # seed 0) from 3e-5, 1e-4, 3e-4, 1e-3 (docs/threads.md, "Learning rates"); the paper's SGD rates are for
    # networks trained from scratch
    optim_defaults = {"lr": 1e-4}
    optim_source = ("validation grid (docs/threads.md#learning-rates: 3e-5..1e-3 on split_mnist5k's validation "
                    "hold-out)")

    def setup(self, model) -> None:
        super().setup(model)
        model.backbone.requires_grad_(True)
        self.bases: dict[str, torch.Tensor] = {}

    def begin_task(self, task, ctx) -> None:
        super().begin_task(task, ctx)
        if task.index > 0:  # 1-D parameters (biases, BN) learn on the first task only
            for p in self.model.backbone.parameters():
                if p.dim() == 1:
                    p.requires_grad_(False)

    def loss(self, model, x, y, ctx) -> torch.Tensor:
        if ctx.task.index > 0:  # keep the first task's BN statistics
            for m in model.backbone.modules():
                if isinstance(m, _BN):
                    m.eval()
        return super().loss(model, x, y, ctx)

    def before_step(self, model, ctx) -> None:
        if not self.bases:
            return
        for name, layer in _layers(model).items():
            m = self.bases.get(name)
            g = layer.weight.grad
            if m is None or g is None:
                continue
            flat = g.reshape(g.shape[0], -1)  # (J, I d d)
            mm = m.to(flat.dtype)
            flat.sub_((flat @ mm) @ mm.T)

    @full_precision
    @torch.no_grad()
    def _representations(self, task, ctx) -> dict[str, torch.Tensor]:
        o = self.options
        layers = _layers(self.model)
        inputs: dict[str, torch.Tensor] = {}
        hooks = [layer.register_forward_hook(lambda mod, inp, out, n=name: inputs.__setitem__(n, inp[0].detach()))
                 for name, layer in layers.items()]
        x, _ = next(task.train.batches(o.samples, shuffle=True, generator=ctx.generator))
        was = self.model.training
        self.model.eval()
        try:
            self.model(x.to(ctx.device))
        finally:
            for h in hooks:
                h.remove()
            self.model.train(was)
        reps = {}
        for name, layer in layers.items():
            a = inputs[name]
            if isinstance(layer, nn.Conv2d):
                cols = F.unfold(a, layer.kernel_size, dilation=layer.dilation, padding=layer.padding,
                                stride=layer.stride)
                rep = cols.permute(1, 0, 2).reshape(cols.shape[1], -1)  # (I d d, B L)
            else:
                rep = a.reshape(-1, a.shape[-1]).T  # (I, B)
            if rep.shape[1] > o.max_columns:
                keep = torch.randperm(rep.shape[1], generator=ctx.generator)[: o.max_columns]
                rep = rep[:, keep.to(rep.device)]
            reps[name] = rep.double()
        return reps

    def end_task(self, task, ctx) -> None:
        threshold = min(1.0, self.options.threshold + self.options.threshold_step * task.index)
        for name, rep in self._representations(task, ctx).items():
            self.bases[name] = extend_basis(rep, self.bases.get(name), threshold)
        self.record("basis_dims", {n: int(b.shape[1]) for n, b in self.bases.items()})
        self.record("memory_bytes", sum(4 * b.numel() for b in self.bases.values()))  # stored as float32

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"basis/{n}": b for n, b in self.bases.items()}

    def load_state(self, tensors, meta) -> None:
        super().load_state(tensors, meta)
        self.bases = {k[len("basis/"):]: v for k, v in tensors.items() if k.startswith("basis/")}
