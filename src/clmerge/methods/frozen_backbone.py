"""Statistics methods on a frozen backbone: ``simplecil``, ``ranpac`` and ``ranpac_rp``.

None trains the backbone after the first task (RanPAC adapts it in the first task, its Phase 1) nor the
model's linear head: what predicts is a feature head of the engine's head suite (``engine.heads``), fed after
every task with the backbone's features of the task's training data. The method therefore owns its head
(``head_defaults``); a ``head.*`` key the user sets still wins, except the linear head, which these methods
never train (refused in the config).

- ``simplecil``: Zhou et al., "Revisiting Class-Incremental Learning with Pre-Trained Models:
  Generalizability and Adaptivity are All You Need" (IJCV 2024), SimpleCIL: the prototype of class c is the
  mean embedding of its training images under the frozen pretrained backbone, and a test image goes to the
  class of the most cosine-similar prototype (``models.heads.NCMHead``, ``head.ncm_metric: cosine``).
- ``ranpac``: McDonnell et al., "RanPAC: Random Projections and Pre-trained Models for Continual Learning"
  (NeurIPS 2023): Phase 1, first-session adaptation (``first_session_adapt``, on by default as in the official
  code and LAMDA-PILOT models/ranpac.py ``_train``: a parameter-efficient module, ``variant`` adapter (PILOT
  exps/ranpac.json ``pretrained_vit_b16_224_adapter``), ssf, vpt_deep or vpt_shallow, or a LoRA of ``rank`` on
  ``targets`` folded in at the task's end, trained on the first task with PILOT's cosine head with a learned
  scale, ``adapt_head``), then the backbone is frozen for good; Phase 2: the fixed random projection
  h = ReLU(f W_rand) and the ridge classifier W_o = (G + λI)⁻¹ Q of the accumulated Gram matrices (Eq. 4-5,
  ``models.heads.RanPACHead``, width ``head.ranpac_dim``, 10,000 as the official ``M``).
- ``ranpac_rp``: Phase 2 alone on the pretrained backbone (the paper's "random projection only" ablation, the
  official code's ``ranpac`` without first-session training).
- :class:`FirstSessionMethod`: the first-session adaptation shared with ``aper`` / ``aper_finetune``
  (``methods.first_session``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from ..adapters import add_lora_component, fold_component, inject_lora
from .base import ContinualMethod, MethodOptions, grid_rate, register_method
from .first_session import FirstSessionHead, PETLOptions, attach_petl
from .seq_lora import LoRAMethodOptions

__all__ = ["COSINE_PROTOTYPES", "FirstSessionMethod", "FrozenBackboneMethod", "SimpleCIL", "RanPAC",
           "RanPACOptions", "RanPACRP"]


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


class FirstSessionMethod(FrozenBackboneMethod):
    """Adapts in the first task only (``_start_first_session`` makes its parameters trainable, the
    first-session head of ``adapt_head`` trains with them), then is frozen; a feature head predicts."""

    def __init__(self, options, *, seed: int = 0) -> None:
        super().__init__(options, seed=seed)
        self._adapting = False
        self._head = FirstSessionHead(options.adapt_head, seed)
        self._inference: nn.Module | None = None

    def _adapts(self) -> bool:
        return True

    def _start_first_session(self, task, ctx) -> None:
        raise NotImplementedError

    def _finish_first_session(self) -> None:
        """Before the model is frozen at the first task's end (e.g. fold a LoRA)."""

    def begin_task(self, task, ctx) -> None:
        super().begin_task(task, ctx)
        self._adapting = task.index == 0 and self._adapts()
        if self._adapting:
            self._start_first_session(task, ctx)
            self._head.start(self.model, task, self.model.backbone.feature_dim)

    def parameter_groups(self, model) -> list[dict]:
        if not self._adapting:
            return []
        head_ids = {id(p) for p in model.head.parameters()}
        body = [p for p in model.parameters() if p.requires_grad and id(p) not in head_ids]
        return self._head.groups(body, model)

    def loss(self, model, x, y, ctx):
        if self._adapting and self._head.kind == "cosine":
            return self._head.loss(model, x, y)
        return super().loss(model, x, y, ctx)

    def end_task(self, task, ctx) -> None:
        if self._adapting:
            self._finish_first_session()
            self.model.requires_grad_(False)
            self._head.stop()
            self._adapting = False

    def inference_model(self) -> nn.Module:
        return self.model if self._inference is None else self._inference


class RanPACOptions(PETLOptions, LoRAMethodOptions):
    first_session_adapt: bool = Field(
        True, description="RanPAC's Phase 1 (the official code's default): train the first-session module "
        "(variant) and the first-session head (adapt_head) on the first task, then keep the backbone frozen; "
        "false is the paper's 'random projection only' (the method ranpac_rp)")
    variant: Literal["adapter", "ssf", "vpt_deep", "vpt_shallow", "lora"] = Field(
        "adapter", description="first-session module: AdaptFormer adapter (PILOT exps/ranpac.json), SSF, "
        "VPT-deep, VPT-shallow (the paper's three), or a LoRA of rank on targets folded into the backbone "
        "(not the paper's)")


# Phase 2 of RanPAC: the random-projection ridge head (engine head suite, ``head.ranpac_dim``)
RANPAC_HEAD: dict[str, Any] = {"classifier": "ranpac", "ranpac_dim": 10000}  # the official M (exps/ranpac.json)


@register_method
class RanPAC(FirstSessionMethod):
    name = "ranpac"
    description = ("RanPAC (McDonnell et al. 2023): adapt on task 1 (adapter|ssf|vpt|lora, cosine head), "
                   "freeze; random projection + ridge classifier on the features")
    head_defaults: ClassVar[dict[str, Any]] = RANPAC_HEAD
    Options = RanPACOptions
    optim_defaults, optim_source = grid_rate(1e-2, "aper's choice: the same first-session adapter and cosine head "
                                             "from the same seed")

    def _adapts(self) -> bool:
        return self.options.first_session_adapt

    def setup(self, model) -> None:
        super().setup(model)
        self._tuned = None
        if not self._adapts():
            return
        if self.options.variant == "lora":
            inject_lora(model.backbone, self.options.targets, magnitudes=model.lora_magnitudes)
        else:
            self._tuned = attach_petl(model.backbone, self.options, name="ranpac",
                                      generator=torch.Generator().manual_seed(self.seed))
            self._tuned.requires_grad_(False)

    def _start_first_session(self, task, ctx) -> None:
        if self._tuned is not None:
            self._tuned.requires_grad_(True)
        else:
            add_lora_component(self.model.backbone, "task0", self.options.rank, generator=ctx.generator,
                               scale=self.options.scale())

    def _finish_first_session(self) -> None:
        if self._tuned is None:
            fold_component(self.model.backbone, "task0")


@register_method
class RanPACRP(FrozenBackboneMethod):
    name = "ranpac_rp"
    description = ("RanPAC's 'random projection only' (McDonnell et al. 2023): random projection + ridge "
                   "classifier on the frozen pretrained backbone's features, no first-session adaptation")
    head_defaults: ClassVar[dict[str, Any]] = RANPAC_HEAD
    Options = MethodOptions
