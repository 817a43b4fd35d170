"""Statistics methods on a frozen pretrained backbone: ``simplecil`` and ``ranpac``.

Neither trains the backbone (RanPAC optionally adapts it in the first task, its Phase 1) nor the model's
linear head: what predicts is a feature head of the engine's head suite (``engine.heads``), fed after every
task with the backbone's features of the task's training data. The method therefore owns its head
(``head_defaults``); a ``head.*`` key the user sets still wins, except the linear head, which these methods
never train (refused in the config).

- ``simplecil``: Zhou et al., "Revisiting Class-Incremental Learning with Pre-Trained Models:
  Generalizability and Adaptivity are All You Need" (IJCV 2024), SimpleCIL: the prototype of class c is the
  mean embedding of its training images under the frozen pretrained backbone, and a test image goes to the
  class of the most cosine-similar prototype (``models.heads.NCMHead``, ``head.ncm_metric: cosine``).
- ``ranpac``: McDonnell et al., "RanPAC: Random Projections and Pre-trained Models for Continual Learning"
  (NeurIPS 2023): the fixed random projection h = ReLU(f W_rand) and the ridge classifier
  W_o = (G + λI)⁻¹ Q of the accumulated Gram matrices (Eq. 4-5, ``models.heads.RanPACHead``, width
  ``head.ranpac_dim``). ``first_session_adapt: true`` is the paper's Phase 1: the backbone is adapted on the
  first task only (here with a LoRA of ``rank`` on ``targets`` and the linear head, folded into the backbone
  at the task's end; the paper uses AdaptFormer, SSF or VPT), then frozen for good.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from ..adapters import add_lora_component, fold_component, inject_lora
from .base import ContinualMethod, MethodOptions, register_method
from .seq_lora import LoRAMethodOptions

__all__ = ["COSINE_PROTOTYPES", "FrozenBackboneMethod", "SimpleCIL", "RanPAC", "RanPACOptions"]


# the head of the prototype methods (SimpleCIL, APER): cosine nearest class mean
COSINE_PROTOTYPES: dict[str, Any] = {"classifier": "ncm", "ncm_metric": "cosine"}


class FrozenBackboneMethod(ContinualMethod):
    """A method that trains nothing: backbone and linear head stay as built; a feature head predicts."""

    trains_linear_head: ClassVar[bool] = False

    def setup(self, model) -> None:
        super().setup(model)
        model.requires_grad_(False)

    def begin_task(self, task, ctx) -> None:
        super().begin_task(task, ctx)
        self.model.head.requires_grad_(False)  # the new task's block too

    def parameter_groups(self, model) -> list[dict]:
        return []


@register_method
class SimpleCIL(FrozenBackboneMethod):
    name = "simplecil"
    description = ("SimpleCIL (Zhou et al.): class prototypes (mean features) of the frozen pretrained "
                   "backbone, cosine classifier")
    head_defaults: ClassVar[dict[str, Any]] = COSINE_PROTOTYPES
    Options = MethodOptions


class RanPACOptions(LoRAMethodOptions):
    first_session_adapt: bool = Field(
        False, description="RanPAC's Phase 1: train a LoRA (rank, targets) and the linear head on the first "
        "task, fold it into the backbone, then keep the backbone frozen (the paper: AdaptFormer/SSF/VPT)")


@register_method
class RanPAC(FrozenBackboneMethod):
    name = "ranpac"
    description = ("RanPAC (McDonnell et al. 2023): random projection + ridge classifier on frozen backbone "
                   "features (first_session_adapt: the paper's first-task adaptation)")
    head_defaults: ClassVar[dict[str, Any]] = {"classifier": "ranpac"}
    Options = RanPACOptions

    def __init__(self, options, *, seed: int = 0) -> None:
        super().__init__(options, seed=seed)
        self._adapting = False

    def setup(self, model) -> None:
        super().setup(model)
        if self.options.first_session_adapt:
            inject_lora(model.backbone, self.options.targets, magnitudes=model.lora_magnitudes)

    def begin_task(self, task, ctx) -> None:
        super().begin_task(task, ctx)
        self._adapting = self.options.first_session_adapt and task.index == 0
        if self._adapting:
            self.model.head.requires_grad_(True)
            add_lora_component(self.model.backbone, "task0", self.options.rank, generator=ctx.generator,
                               scale=self.options.scale())

    def parameter_groups(self, model) -> list[dict]:
        return ContinualMethod.parameter_groups(self, model) if self._adapting else []

    def end_task(self, task, ctx) -> None:
        if self._adapting:
            fold_component(self.model.backbone, "task0")
            self.model.requires_grad_(False)
            self._adapting = False
