"""HALRP's perturbed layers: ``W_t = R_t W_base S_t + B_t`` per task (HALRP, Li et al., TKDE 2024, Eq. 2 and Eq. 7).

Task 0 is the base layer itself (its weight and bias). Every later task t owns, per layer:
- ``r`` (J,) and ``s`` (I,): the diagonal row / column scalings;
- ``u`` (J, k) and ``v`` (k, I): the low-rank residual B_t = U'V' with sqrt(Sigma) absorbed (as the official code does);
- ``bias`` (J,): a private copy of the layer bias (official code; the paper is silent).
For a convolution B_t is one (J, I) matrix added at every kernel position (Eq. 7), so the effective kernel is
``r_j W_base[j, i, h, w] s_i + B[j, i]``. :meth:`HALRPLayer.task_weight` is the only formula; the forward pass,
the tests and any export use it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...adapters.wrappers import register_wrapper

__all__ = ["TaskFactors", "HALRPLayer", "HALRPLinear", "HALRPConv2d", "halrp_layers", "wrap_halrp_layers"]


class TaskFactors(nn.Module):
    """One task's private parameters of one layer (r, s, U', V', bias)."""

    def __init__(self, out_features: int, in_features: int, rank: int, bias: bool) -> None:
        super().__init__()
        self.r = nn.Parameter(torch.ones(out_features))
        self.s = nn.Parameter(torch.ones(in_features))
        self.u = nn.Parameter(torch.zeros(out_features, rank))
        self.v = nn.Parameter(torch.zeros(rank, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    @property
    def rank(self) -> int:
        return self.u.shape[1]

    def low_rank(self) -> torch.Tensor:
        return self.u @ self.v  # (J, I)


class HALRPLayer(nn.Module):
    """Shared logic of the perturbed Linear / Conv2d (``base_layer`` frozen after task 0)."""

    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.tasks = nn.ModuleDict()  # str(t) -> TaskFactors, t >= 1
        self.active_task = 0

    @property
    def weight(self) -> torch.Tensor:
        """The base weight (read by callers that ask a layer for its dtype, as Hugging Face's ViT does)."""
        return self.base_layer.weight

    @property
    def matrix_shape(self) -> tuple[int, int]:
        w = self.base_layer.weight
        return int(w.shape[0]), int(w.shape[1])

    @property
    def kernel_positions(self) -> int:
        """d_h * d_w for convolutions, 1 for linear layers (the official code's score factor c_l; the paper does not state one)."""
        w = self.base_layer.weight
        return int(w[0, 0].numel())

    def add_task(self, task: int, rank: int) -> TaskFactors:
        if task < 1 or str(task) in self.tasks:
            raise ValueError(f"HALRP layer: task {task} is the base or already has factors")
        j, i = self.matrix_shape
        w = self.base_layer.weight
        f = TaskFactors(j, i, rank, self.base_layer.bias is not None).to(device=w.device, dtype=w.dtype)
        self.tasks[str(task)] = f
        return f

    def factors(self, task: int) -> TaskFactors:
        if str(task) not in self.tasks:
            raise RuntimeError(f"HALRP layer has no factors for task {task} (have {list(self.tasks)})")
        return self.tasks[str(task)]

    def task_weight(self, task: int) -> torch.Tensor:
        """W_t = R_t W_base S_t + B_t (Eq. 2; Eq. 7 broadcasts B over the kernel positions)."""
        w = self.base_layer.weight
        if task == 0:
            return w
        f = self.factors(task)
        extra = [1] * (w.dim() - 2)
        scaled = f.r.view(-1, 1, *extra) * w * f.s.view(1, -1, *extra)
        low = f.low_rank()  # (J, I), formed once per call
        return scaled + low.view(*low.shape, *extra)

    def task_bias(self, task: int) -> torch.Tensor | None:
        return self.base_layer.bias if task == 0 else self.factors(task).bias

    def get_structure(self) -> dict:
        return {"ranks": {k: f.rank for k, f in self.tasks.items()}}

    def set_structure(self, structure: dict) -> None:
        for key, rank in structure.get("ranks", {}).items():
            if key not in self.tasks:
                self.add_task(int(key), int(rank))


class HALRPLinear(HALRPLayer):
    """y = r * (W_base (s * x)) + U'(V' x) + b_t, computed through the effective weight W_t."""

    def __init__(self, base_layer: nn.Linear) -> None:
        if not isinstance(base_layer, nn.Linear):
            raise TypeError(f"HALRPLinear wraps nn.Linear, got {type(base_layer).__name__}")
        super().__init__(base_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.active_task
        return F.linear(x, self.task_weight(t), self.task_bias(t))


class HALRPConv2d(HALRPLayer):
    """Convolution with kernel r_j W_base[j, i] s_i + B[j, i] (B broadcast over the d x d positions, Eq. 7)."""

    def __init__(self, base_layer: nn.Conv2d) -> None:
        if not isinstance(base_layer, nn.Conv2d) or base_layer.groups != 1:
            raise TypeError("HALRPConv2d wraps an nn.Conv2d with groups=1")
        super().__init__(base_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.active_task
        return self.base_layer._conv_forward(x, self.task_weight(t), self.task_bias(t))


register_wrapper(HALRPLinear, HALRPLinear)
register_wrapper(HALRPConv2d, HALRPConv2d)


def wrap_halrp_layers(module: nn.Module) -> list[str]:
    """Replace every ``nn.Linear`` / ``nn.Conv2d`` inside ``module`` by its HALRP wrapper; return the names."""
    targets = [n for n, m in module.named_modules() if type(m) in (nn.Linear, nn.Conv2d) and n]
    targets = [n for n in targets if not n.endswith("base_layer")]
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        layer = getattr(parent, child)
        setattr(parent, child, HALRPLinear(layer) if isinstance(layer, nn.Linear) else HALRPConv2d(layer))
    return targets


def halrp_layers(module: nn.Module) -> dict[str, HALRPLayer]:
    return {n: m for n, m in module.named_modules() if isinstance(m, HALRPLayer)}
