"""``olora``: Wang et al., "Orthogonal Subspace Learning for Language Model Continual Learning" (EMNLP 2023
Findings), O-LoRA.

Each task t adds a new LoRA component (``lora_down`` A_t of shape (r, d_in), ``lora_up`` B_t zero-initialised)
on the adapted projections; the earlier tasks' components are frozen and kept. The official code
(``cmnfriend/O-LoRA``, its modified peft ``src/peft/tuners/lora.py``) keeps them concatenated as ``lora_A`` /
``lora_B`` (r_sum rows) beside the trainable ``loranew_A`` / ``loranew_B``, both added to the layer's output
with the same scale ``lora_alpha / r``. The training loss (``src/uie_trainer_lora.py``, ``training_step``) is

    L = CE + λ1 · Σ_layers Σ_ij |(A_old A_t^T)_ij| + λ2 · Σ_layers (‖A_t‖_F + ‖B_t‖_F)

with A_old the earlier tasks' down-projections of that layer stacked (r_sum, d_in): the first term pushes the
rows of A_t towards the orthogonal complement of the old rows (the orthogonality of the subspaces), the second
is the L2 term on the new LoRA (the Frobenius norms, not squared: ``torch.norm(param, p=2)``). The official
scripts (``scripts/order_*.sh``) use λ1 = 0.5, λ2 = 0, learning rate 1e-3 (AdamW, constant), one epoch per task;
``run_uie_lora.py`` builds the LoRA with r = 8 (``lora_dim``), ``lora_alpha`` 32, dropout 0.1, on peft's T5
default targets q and v.

Differences from the official code, each an option: ``fold`` (default false, as the code: the old components
stay as separate frozen adapters; true folds each into the base weights at its task's end, the same function,
with its A rows kept as method state for the loss); the library's LoRA has no dropout (the code's 0.1); the
head is the library's classifier head (O-LoRA generates labels with T5's decoder). With λ2 = 0 the L2 term is
not computed (its value is multiplied by zero; its gradient at a zero B is undefined in some torch versions).

peft's OSF (``OSFConfig``: Nayak et al., "Sculpting Subspaces", adaptive SVD) is a different rule: it fine-tunes
the full weights, splits each weight by SVD into high-rank directions kept frozen and low-rank ones that are
trained, and projects the updates away from the frozen ones; it has no per-task LoRA and no |A_old A_t^T| loss,
so it is not wrapped here.
"""

from __future__ import annotations

import torch
from pydantic import Field

from ..adapters import add_lora_component, fold_component, inject_lora, lora_layers
from .base import ContinualMethod, register_method
from .seq_lora import LoRAMethodOptions

__all__ = ["OLoRA", "OLoRAOptions", "orthogonal_loss", "l2_loss"]


class OLoRAOptions(LoRAMethodOptions):
    rank: int = Field(8, ge=1, description="LoRA rank of each task (official run_uie_lora.py lora_dim 8)")
    lora_alpha: float | None = Field(32.0, gt=0, description="LoRA scale numerator: scale = lora_alpha / rank "
                                     "(official LoraConfig lora_alpha 32; None: scale 1)")
    lambda_orth: float = Field(0.5, ge=0, description="λ1, weight of Σ|A_old A_t^T| (official scripts lamda_1 0.5)")
    lambda_l2: float = Field(0.0, ge=0, description="λ2, weight of Σ(‖A_t‖_F + ‖B_t‖_F) (official scripts "
                             "lamda_2 0)")
    fold: bool = Field(False, description="fold each task's LoRA into the base weights at its end (false: keep "
                       "it as a frozen component, as the official code's lora_A / lora_B)")


def orthogonal_loss(old_downs: list[torch.Tensor | None], new_downs: list[torch.Tensor]) -> torch.Tensor | float:
    """Σ over layers of Σ |A_old A_new^T| (A_old: (r_sum, d_in) or None for a layer without old rows)."""
    total: torch.Tensor | float = 0.0
    for old, new in zip(old_downs, new_downs):
        if old is not None and old.shape[0]:
            total = total + (old.to(new) @ new.t()).abs().sum()
    return total


def l2_loss(params: list[torch.Tensor]) -> torch.Tensor | float:
    """Σ of the Frobenius norms of the new LoRA's factors (``torch.norm(param, p=2)`` per parameter)."""
    total: torch.Tensor | float = 0.0
    for p in params:
        total = total + torch.linalg.vector_norm(p)
    return total


@register_method
class OLoRA(ContinualMethod):
    name = "olora"
    description = ("O-LoRA (Wang et al. 2023): a new LoRA per task, its A kept orthogonal to the old tasks' A "
                   "by the loss λ1 Σ|A_old A_t^T| (+ λ2 L2 on the new LoRA)")
    Options = OLoRAOptions
    optim_defaults = {"lr": 1e-3}
    optim_source = "official code (scripts/order_1.sh: learning_rate 1e-03, AdamW, constant)"

    def __init__(self, options, *, seed: int = 0) -> None:
        super().__init__(options, seed=seed)
        self.old_downs: dict[str, torch.Tensor] = {}  # layer -> the old tasks' A rows, stacked (official lora_A)
        self._current: str | None = None
        self._device_rows: dict[tuple, torch.Tensor] = {}

    def setup(self, model) -> None:
        super().setup(model)
        model.backbone.requires_grad_(False)
        inject_lora(model.backbone, self.options.targets, magnitudes=model.lora_magnitudes)

    def begin_task(self, task, ctx) -> None:
        super().begin_task(task, ctx)
        self._current = f"task{task.index}"
        add_lora_component(self.model.backbone, self._current, self.options.rank, generator=ctx.generator,
                           scale=self.options.scale())

    def _new_components(self):
        layers = lora_layers(self.model.backbone)
        return [(n, layer.components[self._current]) for n, layer in layers.items()
                if self._current in layer.components]

    def regularizer(self) -> torch.Tensor | float:
        """λ1 · orthogonality + λ2 · L2 of the current task's LoRA (0 before any task)."""
        o = self.options
        if self._current is None:
            return 0.0
        comps = self._new_components()
        reg: torch.Tensor | float = 0.0
        if o.lambda_orth > 0 and self.old_downs:
            old = [self._old_on(n, c.lora_down.device) for n, c in comps]
            reg = reg + o.lambda_orth * orthogonal_loss(old, [c.lora_down for _, c in comps])
        if o.lambda_l2 > 0:
            reg = reg + o.lambda_l2 * l2_loss([p for _, c in comps for p in (c.lora_down, c.lora_up)])
        return reg

    def _old_on(self, layer: str, device: torch.device) -> torch.Tensor | None:
        """The old A rows of ``layer`` on ``device`` (one copy per task, not one per step)."""
        rows = self.old_downs.get(layer)
        if rows is None:
            return None
        key = (layer, str(device))
        cached = self._device_rows.get(key)
        if cached is None:
            cached = self._device_rows[key] = rows.to(device)
        return cached

    def loss(self, model, x, y, ctx):
        return super().loss(model, x, y, ctx) + self.regularizer()

    def end_task(self, task, ctx) -> None:
        name = f"task{task.index}"
        for n, layer in lora_layers(self.model.backbone).items():
            if name not in layer.components:
                continue
            down = layer.components[name].lora_down.detach().float().cpu().clone()
            self.old_downs[n] = down if n not in self.old_downs else torch.cat([self.old_downs[n], down])
        if self.options.fold:
            fold_component(self.model.backbone, name)
        else:
            for layer in lora_layers(self.model.backbone).values():
                if name in layer.components:
                    layer.components[name].requires_grad_(False)
        self._current = None
        self._device_rows.clear()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"old_down/{n}": t.contiguous() for n, t in self.old_downs.items()}

    def load_state(self, tensors, meta) -> None:
        super().load_state(tensors, meta)
        self.old_downs = {k[len("old_down/"):]: v.float().cpu() for k, v in tensors.items()
                          if k.startswith("old_down/")}
        self._device_rows.clear()
