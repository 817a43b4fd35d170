"""Inference copies with every LoRA component folded in: a model that costs what the plain backbone costs.

SD-LoRA keeps its components unfolded while training (old magnitudes stay trainable, Eq. 4), but at test time
``W = W_0 + sum_k alpha_k A_k B_k / ||A_k B_k||_F`` is a fixed matrix. :func:`folded_copy` deep-copies the
model, folds every component into its base weight (in fp32, :meth:`LoRALinear.fold`) and puts the plain
``nn.Linear`` back in place of each :class:`LoRALinear`. :class:`FoldedCache` rebuilds the copy only when a
parameter of the live model has changed (tracked by the tensors' in-place version counters).
"""

from __future__ import annotations

import copy

from torch import nn

from .lora import LoRALinear, lora_layers

__all__ = ["folded_copy", "FoldedCache"]


def folded_copy(model: nn.Module) -> nn.Module:
    """A frozen, eval-mode copy of ``model`` with all LoRA components folded and the wrappers removed."""
    out = copy.deepcopy(model)
    for name, layer in lora_layers(out).items():
        for comp in list(layer.components):
            layer.fold(comp)
        parent_name, _, child = name.rpartition(".")
        parent = out.get_submodule(parent_name) if parent_name else out
        setattr(parent, child, layer.base_layer)
    if isinstance(getattr(out, "lora_magnitudes", None), nn.ParameterDict):
        out.lora_magnitudes = nn.ParameterDict()  # folded into the weights; nothing refers to them any more
    out.requires_grad_(False)
    return out.eval()


class FoldedCache:
    """Holds the folded copy of a live model; rebuilt when the model's parameters or structure change."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._model: nn.Module | None = None

    @staticmethod
    def key(model: nn.Module) -> tuple:
        """Identity, shape and in-place version of every parameter (an optimizer step bumps the version)."""
        return tuple((n, id(p), tuple(p.shape), p._version) for n, p in model.named_parameters())

    def get(self, model: nn.Module) -> nn.Module:
        k = self.key(model)
        if self._model is None or k != self._key:
            self._model, self._key = folded_copy(model), k
        return self._model

    def clear(self) -> None:
        self._key, self._model = None, None


def has_lora(model: nn.Module) -> bool:
    """Whether any :class:`LoRALinear` is left in ``model``."""
    return any(isinstance(m, LoRALinear) for m in model.modules())
