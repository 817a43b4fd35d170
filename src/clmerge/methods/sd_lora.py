"""SD-LoRA (Wu et al., ICLR 2025): decoupled magnitudes and frozen normalised directions, plus RR and KD.

Per adapted projection (query and value of every block), after task t (Eq. 4):

    W = W_0 + sum_{k<=t} alpha_k * U_k D_k / ||U_k D_k||_F

- one scalar magnitude ``alpha_k`` per task, shared by every layer and projection (``model.lora_magnitudes``
  key ``task{k}``); all magnitudes are trained on every task;
- the directions of earlier tasks are frozen; the new factors (U_t, D_t) are trained;
- the norm is computed from r x r Gram matrices (``adapters.lora.gram_frobenius_norm``), never from U D.

Naming: clmerge's ``lora_up`` U (out x r) is the paper's A, ``lora_down`` D (r x in) the paper's B.

Every place where the paper and the official code (WuYichen-97/SD-Lora-CL, ``models/sdlora.py``) differ is an
option; see the option descriptions. ``sd_lora_rr`` adds the rank schedule of Eq. 6 and
``sd_lora_kd`` the least-squares absorption of Eq. 7-8 (Algorithm 1, lines 10-12).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from ..adapters import add_lora_component, inject_lora, lora_layers, set_lora_compute
from ..adapters.folded import FoldedCache
from ..adapters.lora import LoRALinear
from .base import ContinualMethod, grid_rate, register_method
from .seq_lora import LoRAMethodOptions
from ..utils.precision import full_precision

__all__ = ["SDLoRA", "SDLoRARR", "SDLoRAKD", "SDLoRAOptions", "SDLoRARROptions", "SDLoRAKDOptions",
           "direction_gram", "least_squares_fit"]

Variant = Literal["sd_lora", "fixed_first_direction", "no_rescale", "single_component"]


class SDLoRAOptions(LoRAMethodOptions):
    """SD-LoRA options; each default is the paper's choice unless the description says why not."""

    magnitude_init: float = Field(1.0, description="initial value of each magnitude alpha_k. Paper: 1 ('all "
                                  "initialized to ones'); official code: 0.8 (``wrapped_param_prev``)")
    magnitude_reinit: bool = Field(False, description="reset every old magnitude to magnitude_init at each task "
                                   "start. Paper: False (learned magnitudes carry over); code: True (re-created "
                                   "at 0.8 every task)")
    norm: Literal["fro", "factor"] = Field("fro", description="direction normaliser. Paper: 'fro' = ||U D||_F "
                                           "(Eq. 3); code: 'factor' = ||U||_F ||D||_F")
    normalize_current: bool = Field(False, description="normalise the current direction while it is trained. "
                                    "Eq. 4 does, but it is 0/0 at LoRA's zero init, so the default follows the "
                                    "code: unnormalised while trained, normalised once frozen. "
                                    "True uses a small random init of both factors (Theorem 1's assumption)")
    init_std: float = Field(1e-3, gt=0, description="std of the small init used when normalize_current")
    variant: Variant = Field("sd_lora", description="Table 4 rows: sd_lora (Eq. 4); fixed_first_direction "
                             "(W_0 + alpha A_1B_1-bar, only alpha trained after task 1); no_rescale (old "
                             "directions at a frozen magnitude, only the current alpha trained); single_component "
                             "(one decoupled alpha, A, B trained on every task)")
    no_rescale_magnitude: Literal["one", "learned"] = Field(
        "one", description="no_rescale: old components keep magnitude 1 (Table 4 formula) or their "
        "learned value frozen")
    lora_compute: Literal["auto", "dense", "lowrank"] = Field(
        "auto", description="how each layer applies Eq. 4 while training (same outputs and gradients up to float "
        "rounding): lowrank = one U_k (D_k x) path per component (the original path); dense = W_0 + sum_k c_k "
        "U_k D_k formed from the stacked factors each step, one matmul per layer, magnitudes still trained; auto = "
        "dense when its FLOP estimate is lower (adapters.lora.dense_is_cheaper), e.g. with several components")
    fold_inference: bool = Field(True, description="evaluate a cached copy with every component folded into the "
                                 "base weights (plain-backbone inference cost; outputs equal to 1e-5)")


def _mag_key(t: int) -> str:
    return f"task{t}"


@register_method
class SDLoRA(ContinualMethod):
    name = "sd_lora"
    description = "SD-LoRA: per-task LoRA directions (frozen once learned) with shared learnable magnitudes (Eq. 4)"
    Options = SDLoRAOptions
    optim_defaults, optim_source = grid_rate(5e-3, "sd_lora_rr and sd_lora_kd use it too")

    def setup(self, model) -> None:
        super().setup(model)
        model.backbone.requires_grad_(False)
        inject_lora(model.backbone, self.options.targets, magnitudes=model.lora_magnitudes)
        set_lora_compute(model.backbone, self.options.lora_compute)
        self._folded = FoldedCache()

    def inference_model(self) -> nn.Module:
        """The model with W = W_0 + sum_k alpha_k A_k B_k / ||A_k B_k||_F folded in (Eq. 4), cached."""
        return self._folded.get(self.model) if self.options.fold_inference else self.model

    # -- structure --------------------------------------------------------------------------------------
    def rank_for_task(self, t: int) -> int:
        return self.options.rank

    def _layers(self) -> dict[str, LoRALinear]:
        return lora_layers(self.model.backbone)

    def _component_names(self) -> list[str]:
        layers = list(self._layers().values())
        return list(layers[0].components) if layers else []

    def _freeze_components(self, names: list[str]) -> None:
        """Old directions: frozen and normalised from now on (as the official code does)."""
        for layer in self._layers().values():
            for n in names:
                layer.components[n].requires_grad_(False)
                layer.components[n].normalize = self.options.norm

    def _new_magnitude(self, t: int) -> None:
        ref = next(self.model.backbone.parameters())
        self.model.lora_magnitudes[_mag_key(t)] = nn.Parameter(
            torch.tensor(float(self.options.magnitude_init), device=ref.device))

    def _add_direction(self, t: int, ctx) -> None:
        o = self.options
        init = "small" if o.normalize_current else "lora"
        add_lora_component(self.model.backbone, f"task{t}", self.rank_for_task(t), generator=ctx.generator,
                           scale=o.scale(), magnitude=_mag_key(t), init=init, init_std=o.init_std,
                           normalize=o.norm if o.normalize_current else "none")

    def begin_task(self, task, ctx) -> None:
        super().begin_task(task, ctx)
        o, t, mags = self.options, task.index, self.model.lora_magnitudes
        set_lora_compute(self.model.backbone, o.lora_compute)  # also after a checkpoint rebuild
        old = self._component_names()
        if o.magnitude_reinit:
            with torch.no_grad():
                for p in mags.values():
                    p.fill_(o.magnitude_init)
        if t > 0 and o.variant in ("fixed_first_direction", "single_component"):
            if o.variant == "fixed_first_direction":
                self._freeze_components(old)
            else:  # the one component stays trainable, now as a normalised direction
                for layer in self._layers().values():
                    for n in old:
                        layer.components[n].normalize = o.norm
            return
        self._freeze_components(old)
        for key, p in mags.items():
            p.requires_grad_(o.variant != "no_rescale")
            if o.variant == "no_rescale" and o.no_rescale_magnitude == "one":
                with torch.no_grad():
                    p.fill_(1.0)
        self._new_magnitude(t)
        self._add_direction(t, ctx)

    def end_task(self, task, ctx) -> None:
        mags = {k: float(v.detach()) for k, v in self.model.lora_magnitudes.items()}
        self.record("magnitudes", mags)
        ctx.log({"event": "sd_lora_magnitudes", "task": task.index, "magnitudes": mags})


# ----------------------------------------------------------------------------------------------------------
class SDLoRARROptions(SDLoRAOptions):
    """Rank reduction (Eq. 6, Alg. 1 lines 2-3): r_t = rank if t < mu, rank_mu if mu <= t < nu, else rank_nu."""

    mu: int = Field(4, ge=1, description="first task (1-based, paper) with rank rank_mu")
    nu: int = Field(8, ge=1, description="first task (1-based, paper) with rank rank_nu")
    rank_mu: int = Field(8, ge=1, description="r_mu (paper: 8)")
    rank_nu: int = Field(6, ge=1, description="r_nu (paper: 6)")
    rr_indexing: Literal["paper", "code"] = Field(
        "paper", description="paper: 1-based tasks 1..mu-1 get r_1 (Eq. 6); code: the official (commented) "
        "schedule compares the 0-based task index with mu, so tasks 1..mu get r_1 (off by one)")

    @model_validator(mode="after")
    def _check(self) -> "SDLoRARROptions":
        if not self.mu < self.nu:
            raise ValueError(f"sd_lora_rr: need mu < nu, got mu={self.mu}, nu={self.nu}")
        if not self.rank >= self.rank_mu >= self.rank_nu:
            raise ValueError(f"sd_lora_rr: need rank >= rank_mu >= rank_nu, got {self.rank}, {self.rank_mu}, "
                             f"{self.rank_nu}")
        return self


@register_method
class SDLoRARR(SDLoRA):
    name = "sd_lora_rr"
    description = "SD-LoRA-RR: SD-LoRA with ranks reduced in steps for later tasks (Eq. 6)"
    Options = SDLoRARROptions

    def rank_for_task(self, t: int) -> int:
        o = self.options
        k = t + 1 if o.rr_indexing == "paper" else t
        return o.rank if k < o.mu else (o.rank_mu if k < o.nu else o.rank_nu)


# ----------------------------------------------------------------------------------------------------------
@full_precision
def direction_gram(layers: list[LoRALinear], names: list[str], norm: str) -> torch.Tensor:
    """Gram matrix of the stacked normalised directions: G[j, k] = sum_layers <d_j, d_k>_F (float64).

    Each per-layer direction is U D / norm (``norm`` 'fro' or 'factor'); the products are formed from r x r
    blocks, ``<U_j D_j, U_k D_k>_F = sum((U_j^T U_k) * (D_j D_k^T))``, never from U D itself. Stacking over
    layers gives one scalar per task, as the magnitudes are shared (Sec. 4.1: one set of
    magnitudes for all projections), while Eq. 7 is written for one matrix.
    """
    n = len(names)
    gram = torch.zeros(n, n, dtype=torch.float64)
    for layer in layers:
        ups = [layer.components[m].lora_up.detach().double().cpu() for m in names]
        downs = [layer.components[m].lora_down.detach().double().cpu() for m in names]
        if norm == "fro":
            norms = [torch.sqrt(((u.t() @ u) * (d @ d.t())).sum().clamp_min(0)) for u, d in zip(ups, downs)]
        else:
            norms = [u.norm() * d.norm() for u, d in zip(ups, downs)]
        for j in range(n):
            for k in range(j, n):
                v = ((ups[j].t() @ ups[k]) * (downs[j] @ downs[k].t())).sum() / (norms[j] * norms[k] + 1e-300)
                gram[j, k] += v
                if j != k:
                    gram[k, j] += v
    return gram


@full_precision
def least_squares_fit(gram: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Eq. 7: fit the last direction on the earlier ones from their Gram matrix.

    Returns (coefficients Delta alpha_k, unsquared residual ||d_t - sum_k Delta alpha_k d_k||_F), in float64.
    """
    g_old, b, g_tt = gram[:-1, :-1], gram[:-1, -1], gram[-1, -1]
    coef = torch.linalg.pinv(g_old, hermitian=True) @ b
    res2 = g_tt - 2 * coef @ b + coef @ g_old @ coef
    return coef, float(torch.sqrt(res2.clamp_min(0.0)))


class SDLoRAKDOptions(SDLoRAOptions):
    tau: float = Field(9e-4, ge=0, description="absorb the new direction when the fit residual <= tau (paper 9e-4)")
    kd_relative: bool = Field(False, description="compare residual / ||d_t|| with tau instead of the unsquared "
                              "residual of unit per-layer directions stacked over layers (Alg. 1 line 11)")
    kd_merge: Literal["paper", "function_preserving"] = Field(
        "paper", description="paper: alpha_k += Delta alpha_k (Eq. 8, Alg. 1 l.12); function_preserving: "
        "alpha_k += alpha_t * Delta alpha_k (the fit is to the unit direction)")


@register_method
class SDLoRAKD(SDLoRA):
    name = "sd_lora_kd"
    description = "SD-LoRA-KD: absorb a new direction that the old ones fit within tau (Eq. 7-8)"
    Options = SDLoRAKDOptions

    def end_task(self, task, ctx) -> None:
        self._distill(task, ctx)
        super().end_task(task, ctx)

    def _distill(self, task, ctx) -> None:
        o, t = self.options, task.index
        new = f"task{t}"
        names = self._component_names()
        if new not in names or len(names) < 2:
            self.record("kd", {"task": t, "residual": None, "absorbed": False})
            ctx.log({"event": "sd_lora_kd", "task": t, "residual": None, "absorbed": False})
            return
        old = [n for n in names if n != new]
        gram = direction_gram(list(self._layers().values()), old + [new], o.norm)
        coef, res = least_squares_fit(gram)
        score = res / max(float(gram[-1, -1].sqrt()), 1e-300) if o.kd_relative else res
        absorbed = score <= o.tau
        if absorbed:
            self._absorb(old, new, coef)
        info = {"task": t, "residual": res, "score": score, "absorbed": absorbed,
                "coefficients": {n: float(c) for n, c in zip(old, coef)}}
        self.record("kd", info)
        ctx.log({"event": "sd_lora_kd", **info})

    @torch.no_grad()
    def _absorb(self, old: list[str], new: str, coef: torch.Tensor) -> None:
        mags = self.model.lora_magnitudes
        keys = {n: self._layers_first().components[n].magnitude for n in old + [new]}
        a_t = float(mags[keys[new]].detach()) if self.options.kd_merge == "function_preserving" else 1.0
        for n, c in zip(old, coef):
            mags[keys[n]].add_(a_t * float(c))
        for layer in self._layers().values():
            del layer.components[new]
        del mags[keys[new]]

    def _layers_first(self) -> LoRALinear:
        return next(iter(self._layers().values()))
