"""``magmax``: MagMax (Marczak et al., ECCV 2024), sequential fine-tuning plus a maximum-magnitude merge.

Training is plain sequential fine-tuning: task t starts from the weights ``theta_{t-1}`` reached at the end of
task t-1 (official code ``finetune_splitted.py --sequential-finetuning`` loads ``finetuned_{t-1}.pt``), never
from the merged model. After task t the task vector ``tau_t = theta_t - theta_0`` is taken against the
pretrained weights and merged (paper Sec. 4):

    tau_MagMax^p = tau_k^p,  k = argmax_{i<=t} |tau_i^p|;     theta_MagMax = theta_0 + lambda * tau_MagMax

and the row t of the accuracy matrix is measured on ``theta_MagMax`` over tasks 1..t (the official
``evaluate_merged_fts``: the merge of the first t task vectors after each t). The engine evaluates
:meth:`MagMax.inference_model`, a cached copy of the live model with the merged backbone; the live model
keeps ``theta_t`` for the next task.

Memory: the maximum-magnitude rule is associative (:func:`clmerge.merging.methods.magmax.max_magnitude_fold`), so
the method keeps one running ``tau_MagMax`` tensor per merged parameter (float32), plus ``theta_0``, instead
of every task vector: O(1) in the number of tasks and the same numbers (tested against the batch merge).
With ``track_sources`` an int16 tensor per parameter records which task each entry came from (-1: no task
changed it), for the shares recorded in ``metrics.json``. All of it is in ``state_tensors``, so a resumed
run continues exactly.

Which parameters: ``finetune: full`` (the paper) trains and merges every backbone parameter (the official
code merges every float entry of the image encoder); ``finetune: lora`` trains a rank-r LoRA per task on
``targets`` (as ``seq_lora``), folds it in at the task end, and merges the adapted weight matrices only. The
classifier head is not merged: the paper's head is CLIP's frozen zero-shot text head, clmerge's is the run's
incremental linear head (or the ``head:`` section's NCM / RanPAC), used as trained.
"""

from __future__ import annotations

import copy
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from ..adapters import add_lora_component, fold_component, inject_lora, lora_layers
from ..adapters.folded import FoldedCache
from ..merging.methods.magmax import max_magnitude_fold
from .base import ContinualMethod, grid_rate, register_method
from .seq_lora import LoRAMethodOptions

__all__ = ["MagMax", "MagMaxOptions"]

NO_TASK = -1  # source index of an entry no task vector has changed yet


class MagMaxOptions(LoRAMethodOptions):
    """MagMax options; each default is the paper's choice unless its description says otherwise."""

    scaling: float = Field(0.5, gt=0, description="lambda of theta_0 + lambda * tau_MagMax. 0.5: the "
                           "official merge scripts' value (merge_max_abs with 0.5), which the paper keeps "
                           "for every benchmark as MagMax is robust to it; select on validation")
    tie_break: Literal["last", "first"] = Field(
        "last", description="which task wins a tie in magnitude: last (official code, |tau_t| >= |running|) "
        "or first; the paper's argmax does not say")
    finetune: Literal["full", "lora"] = Field(
        "full", description="full: sequential full fine-tuning of the backbone, every backbone parameter "
        "merged (the paper); lora: a rank-r LoRA per task on `targets`, folded in at the task end, the "
        "adapted weights merged (rank, targets, lora_alpha apply)")
    track_sources: bool = Field(True, description="keep an int16 tensor of which task each merged entry came "
                                "from (half a model's float32 size) and record the per-task shares")


@register_method
class MagMax(ContinualMethod):
    name = "magmax"
    description = ("MagMax: sequential fine-tuning, evaluated as theta_0 + lambda * (per entry the task "
                   "vector of largest magnitude)")
    Options = MagMaxOptions
    optim_defaults, optim_source = grid_rate(3e-5, "the grid 1e-5..1e-3 includes the official code's AdamW 1e-5")

    def setup(self, model) -> None:
        super().setup(model)
        if self.options.finetune == "full":
            model.backbone.requires_grad_(True)
        else:
            model.backbone.requires_grad_(False)
            inject_lora(model.backbone, self.options.targets, magnitudes=model.lora_magnitudes)
        with torch.no_grad():
            params = self._merged_params()
            self.theta0 = {n: p.detach().clone() for n, p in params.items()}
            self.running = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}
            self.sources = ({n: torch.full(p.shape, NO_TASK, dtype=torch.int16, device=p.device)
                             for n, p in params.items()} if self.options.track_sources else {})
        self.n_merged = 0
        self._cache: tuple[tuple, nn.Module] | None = None

    def _merged_params(self) -> dict[str, nn.Parameter]:
        """The backbone parameters MagMax merges, by their backbone name (see the module docstring)."""
        backbone = self.model.backbone
        if self.options.finetune == "lora":
            return {f"{n}.base_layer.weight": layer.base_layer.weight
                    for n, layer in lora_layers(backbone).items()}
        return {n: p for n, p in backbone.named_parameters() if p.is_floating_point()}

    # -- training ------------------------------------------------------------------------------------------
    def begin_task(self, task, ctx) -> None:
        super().begin_task(task, ctx)
        if self.options.finetune == "lora":
            add_lora_component(self.model.backbone, f"task{task.index}", self.options.rank,
                               generator=ctx.generator, scale=self.options.scale())

    @torch.no_grad()
    def end_task(self, task, ctx) -> None:
        if self.options.finetune == "lora":
            fold_component(self.model.backbone, f"task{task.index}")  # theta_t: the folded weights
        t = task.index
        counts = {"new": 0, "total": 0}
        tau_sq = 0.0
        for name, p in self._merged_params().items():
            tau = p.detach().float() - self.theta0[name].float()  # tau_t = theta_t - theta_0
            tau_sq += float(tau.double().square().sum())
            self.running[name], taken = max_magnitude_fold(self.running[name], tau,
                                                           tie_break=self.options.tie_break)
            taken &= tau != 0  # a tie of zeros leaves the entry unchanged by any task
            if self.options.track_sources:
                self.sources[name].masked_fill_(taken, t)
            counts["new"] += int(taken.sum())
            counts["total"] += tau.numel()
        self.n_merged += 1
        self._cache = None
        info = {"task": t, "new_share": counts["new"] / max(counts["total"], 1), "tau_norm": tau_sq ** 0.5,
                "merged_tau_norm": self._running_norm()}
        if self.options.track_sources:
            info["source_shares"], info["unchanged_share"] = self.source_shares(t + 1)
        self.record("merge", info)
        ctx.log({"event": "magmax_merge", **info})

    def _running_norm(self) -> float:
        return sum(float(r.double().square().sum()) for r in self.running.values()) ** 0.5

    def source_shares(self, n_tasks: int) -> tuple[list[float], float]:
        """``([share of merged entries taken from task k, k < n_tasks], share no task changed)``."""
        total = sum(s.numel() for s in self.sources.values())
        counts = torch.zeros(n_tasks + 1, dtype=torch.int64)
        for s in self.sources.values():  # bin 0: NO_TASK, bin k + 1: task k
            counts += torch.bincount((s.reshape(-1).long() + 1).cpu(), minlength=n_tasks + 1)[: n_tasks + 1]
        shares = (counts.double() / max(total, 1)).tolist()
        return shares[1:], shares[0]

    # -- evaluation ----------------------------------------------------------------------------------------
    def merged_backbone_state(self) -> dict[str, torch.Tensor]:
        """``theta_0 + lambda * tau_MagMax`` of every merged parameter (in float32, cast to the parameter's
        dtype)."""
        lam = self.options.scaling
        return {n: (w.float() + lam * self.running[n]).to(w.dtype) for n, w in self.theta0.items()}

    def inference_model(self) -> nn.Module:
        """A frozen copy of the live model whose merged parameters hold ``theta_0 + lambda * tau_MagMax``
        (rebuilt when the live model or the merge changed)."""
        key = (FoldedCache.key(self.model), self.n_merged)
        if self._cache is None or self._cache[0] != key:
            self._cache = None  # the old copy is freed before the new one is made
            self._cache = (key, self._merged_copy())
        return self._cache[1]

    @torch.no_grad()
    def _merged_copy(self) -> nn.Module:
        out = copy.deepcopy(self.model)
        params = dict(out.backbone.named_parameters())
        for name, value in self.merged_backbone_state().items():
            params[name].copy_(value.to(params[name].device))
        for p in out.parameters():
            p.grad = None
        out.requires_grad_(False)
        return out.eval()

    # -- memory across tasks -------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"theta0/{n}": v for n, v in self.theta0.items()}
        out.update({f"running/{n}": v for n, v in self.running.items()})
        out.update({f"sources/{n}": v for n, v in self.sources.items()})
        return out

    def state_meta(self) -> dict:
        return {**super().state_meta(), "n_merged": self.n_merged}

    def load_state(self, tensors, meta) -> None:
        super().load_state(tensors, meta)
        stores = (("theta0/", self.theta0), ("running/", self.running), ("sources/", self.sources))
        for prefix, store in stores:
            for name in store:
                store[name] = tensors[prefix + name]
        self.n_merged = int(meta.get("n_merged", 0))
        self._cache = None
