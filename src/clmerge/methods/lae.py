"""``lae``: Gao et al., "A Unified Continual Learning Framework with General Parameter-Efficient Tuning"
(ICCV 2023), LAE (Learning-Accumulation-Ensemble).

One parameter-efficient module (PET) on the first blocks of a frozen backbone is trained on every task (the
*online* PET); an exponential moving average of it is the *offline* PET. The official code (``gqk/LAE``,
``main.py``) and LAMDA-PILOT's port (``models/lae.py``, ``utils/inc_net.py`` ``LAE``) do:

- **learning**: cross-entropy over the current task's classes only (``output[:, num_old_classes:]``: the
  library's ``head.loss: local``); the classifier head is shared by both PETs;
- **calibration**: in every task after the first, the PET is frozen for the first ``num_freeze_epochs``
  epochs (3) and only the head trains (``pre_train_epoch``);
- **accumulation**: after every optimizer step, offline = d · offline + (1 - d) · online, d = ``ema_decay``
  0.9999 (timm ``ModelEmaV2.update`` in ``post_train_step``). The official code creates the offline PET at the
  start of the second task as a copy of the online one (``setup_model``: ``ModelEmaV2(self.pets)``), PILOT at
  the start (``ema_from``);
- **ensemble**: at inference, the class probabilities of the online and of the offline model, and per class
  the larger of the two (``eval_epoch``: ``torch.stack(output_emas, -1).max(-1)``). The inference model
  returns the log of that maximum (same prediction). ``ensemble: energy`` takes instead, per image, the logits
  of the model of lower free energy -logsumexp(logits) (the paper's energy view of the same choice);
  ``online`` / ``offline`` evaluate one of them.

PETs (``pet``; the official ``MyModuleConf`` default ``Adapter``, on blocks 0-4 ``adapt_blocks``):
``adapter`` is the library's bottleneck adapter (``adapters.bottleneck``) with ``bottleneck`` 5 (LAE
``down_sample`` 5) and no dropout; ``lora`` is a rank-5 LoRA on the key and value projections of the blocks
(LAE ``KVLoRA``); ``prefix`` is LAE's ``Prefix`` (PILOT's default; official ``config/vit_prefix.yaml``): per
block ``prefix_length`` 10 key and 10 value tokens (uniform in [0, 0.01)) times learned scales starting at 1,
prepended to the projected keys and values, with the compensated attention: after the softmax the prefix
tokens' weights are divided by their sum (``Prefix.compensate``; :class:`LAEPrefix`, HF ViT backbones).
Differences from the official PETs: the adapter runs parallel to the block's MLP (LAE's is parallel to the
attention) with ReLU (LAE: GELU) and a fixed output scale ``adapter_scale`` (LAE: a learned scale starting at
1); the LoRA's scale is fixed at 1 (LAE: a learned scale starting at 1). The calibration epochs
run as a separate fit before the task's ``train.epochs`` (the official 5 epochs with 3 frozen are
``train.epochs=2`` here), with their own optimizer (the official one optimizer for all epochs, reinitialised
per task as PILOT ``reinit_optimizer``). Official training: Adam, lr 0.0028125 (PILOT exps/lae.json),
batch 128, 5 epochs, constant rate.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn
from torch.func import functional_call

from ..adapters import inject_lora, lora_layers
from ..adapters.bottleneck import attach_adapters
from ..adapters.prompt import PromptInput, PromptMechanism
from .base import ContinualMethod, MethodOptions, register_method

__all__ = ["LAE", "LAEOptions", "LAEEnsemble", "LAEPrefix", "compensated_prefix_attention", "ema_update",
           "ensemble_logits"]


class LAEOptions(MethodOptions):
    pet: Literal["adapter", "lora", "prefix"] = Field(
        "adapter", description="the PET: adapter (official default), a LoRA on key/value (LAE KVLoRA), or "
        "key/value prefixes with LAE's compensated attention (LAE Prefix; PILOT's default)")
    adapt_blocks: list[int] = Field(default_factory=lambda: [0, 1, 2, 3, 4],
                                    description="blocks that carry the PET (official adapt_blocks 0-4)")
    bottleneck: int = Field(5, ge=1, description="adapter bottleneck width (LAE down_sample 5)")
    adapter_scale: float = Field(1.0, gt=0, description="adapter output scale (LAE: learned, starts at 1)")
    rank: int = Field(5, ge=1, description="LoRA rank (LAE LinearLoRA rank 5)")
    prefix_length: int = Field(10, ge=1, description="prefix tokens per block for keys and for values (LAE "
                               "length 10)")
    ema_decay: float = Field(0.9999, ge=0, lt=1, description="offline PET = d·offline + (1-d)·online per step "
                             "(official 0.9999)")
    num_freeze_epochs: int = Field(3, ge=0, description="calibration epochs of a task after the first: head only, "
                                   "PET frozen (official 3); run before train.epochs")
    freeze_first_task: bool = Field(False, description="calibrate in the first task too (PILOT: true; official "
                                    "code: false)")
    ema_from: Literal["second_task", "first_task"] = Field(
        "second_task", description="when the offline PET starts: a copy of the online one at the second task "
        "(official code) or at the start (PILOT)")
    ensemble: Literal["max_prob", "energy", "online", "offline"] = Field(
        "max_prob", description="inference: max of the two models' class probabilities (official), the lower-"
        "energy model's logits per image, or one model")


def ema_update(ema: dict[str, torch.Tensor], online: dict[str, torch.Tensor], decay: float) -> None:
    """``ema <- decay · ema + (1 - decay) · online`` in place (timm ``ModelEmaV2._update``)."""
    with torch.no_grad():
        for k, e in ema.items():
            e.copy_(e * decay + (1.0 - decay) * online[k].detach())


def ensemble_logits(on: torch.Tensor, off: torch.Tensor, kind: str) -> torch.Tensor:
    """The ensemble's scores: log max(softmax(on), softmax(off)) per class, or the lower-energy model's logits."""
    if kind == "max_prob":
        return torch.log(torch.stack([on.softmax(-1), off.softmax(-1)], dim=-1).max(dim=-1)[0])
    if kind == "energy":
        pick_on = (-torch.logsumexp(on, -1)) <= (-torch.logsumexp(off, -1))
        return torch.where(pick_on[:, None], on, off)
    return on if kind == "online" else off


class LAEEnsemble(nn.Module):
    """The model with its online PET and with the offline PET swapped in (``functional_call``), ensembled."""

    def __init__(self, model: nn.Module, method: LAE) -> None:
        super().__init__()
        self.model = model
        object.__setattr__(self, "_method", method)  # not a submodule: no second copy in a state dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self._method
        kind = m.options.ensemble
        if not m.ema or kind == "online":
            return self.model(x)
        device = next(self.model.parameters()).device
        offline = {k: v.to(device) for k, v in m.ema.items()}
        off = functional_call(self.model, offline, (x,))
        if kind == "offline":
            return off
        return ensemble_logits(self.model(x), off, kind)


LAE_PREFIX_ATTENTION = "clmerge_lae_prefix"


def compensated_prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prefix_key: torch.Tensor,
                                 prefix_value: torch.Tensor, *, scaling: float, dropout: float = 0.0,
                                 training: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over ``[prefix; tokens]`` with LAE's compensation: after the softmax (and dropout) the weights
    of the L prefix tokens are divided by their sum (LAE ``Prefix.compensate``). All (B, H, *, d); returns the
    output (B, H, T, d) and the weights."""
    keys, values = torch.cat([prefix_key, key], dim=2), torch.cat([prefix_value, value], dim=2)
    weights = torch.softmax(torch.matmul(query, keys.transpose(-2, -1)) * scaling, dim=-1, dtype=torch.float32)
    weights = nn.functional.dropout(weights.to(query.dtype), p=dropout, training=training)
    n = prefix_key.shape[2]
    lamb = weights[..., :n].sum(dim=-1, keepdim=True)
    weights = torch.cat([weights[..., :n] / lamb.clamp(min=1e-12), weights[..., n:]], dim=-1)
    return torch.matmul(weights, values), weights


def _heads(p: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    b, h, _, d = like.shape
    return p.to(like.dtype).reshape(b, -1, h, d).transpose(1, 2)


def _lae_prefix_attention(module: nn.Module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The HF attention function of a block carrying LAE's prefix (registered as ``clmerge_lae_prefix``)."""
    mechanism, layer = module._clmerge_prompt
    prefix = mechanism.prefix_for(layer)
    if attention_mask is not None:
        raise ValueError("method.pet=prefix: LAE's compensated prefix attention supports unmasked (vision) "
                         "attention only")
    scaling = query.size(-1) ** -0.5 if scaling is None else scaling
    if prefix is None:
        empty = key[:, :, :0]
        out, w = compensated_prefix_attention(query, key, value, empty, empty, scaling=scaling, dropout=dropout,
                                              training=module.training)
    else:
        out, w = compensated_prefix_attention(query, key, value, _heads(prefix[0], key), _heads(prefix[1], value),
                                              scaling=scaling, dropout=dropout, training=module.training)
    return out.transpose(1, 2).contiguous(), w


def _register_lae_attention() -> None:
    from transformers.modeling_utils import AttentionInterface

    if LAE_PREFIX_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(LAE_PREFIX_ATTENTION, _lae_prefix_attention)


class LAEPrefix(nn.Module):
    """LAE's ``Prefix`` PET on the blocks ``layers`` of an HF ViT backbone: per block, L key and L value tokens
    (``Prompt``: uniform in [0, 0.01)) times a learned scale starting at 1 (``Scaler(None)``), prepended to the
    block's projected keys and values; the attention is compensated (:func:`compensated_prefix_attention`)."""

    def __init__(self, backbone: nn.Module, layers: list[int], length: int, *,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        dim = backbone.inner.config.hidden_size
        self.layers = list(layers)
        self.key = nn.Parameter(torch.rand(len(layers), length, dim, generator=generator) * 0.01)
        self.value = nn.Parameter(torch.rand(len(layers), length, dim, generator=generator) * 0.01)
        self.key_scale = nn.Parameter(torch.ones(len(layers)))
        self.value_scale = nn.Parameter(torch.ones(len(layers)))
        mechanism = PromptMechanism(backbone, prefix_layers=self.layers)
        mechanism.provider = lambda x: self.prompt_input(len(x))
        _register_lae_attention()
        for i in self.layers:
            mechanism.layout.attentions[i].config._attn_implementation_internal = LAE_PREFIX_ATTENTION
        object.__setattr__(self, "mechanism", mechanism)

    def prompt_input(self, batch: int) -> PromptInput:
        return PromptInput(prefixes={layer: ((self.key[i] * self.key_scale[i]).expand(batch, -1, -1),
                                             (self.value[i] * self.value_scale[i]).expand(batch, -1, -1))
                                     for i, layer in enumerate(self.layers)})


def _block_index(name: str) -> int | None:
    hit = re.search(r"\.(\d+)\.", f".{name}.")
    return int(hit.group(1)) if hit else None


@register_method
class LAE(ContinualMethod):
    name = "lae"
    description = ("LAE (Gao et al., ICCV 2023): one PET (adapter|lora|prefix) trained on every task, its EMA as an "
                   "offline PET, max-probability ensemble of the two at inference")
    Options = LAEOptions
    head_defaults: ClassVar[dict[str, Any]] = {"loss": "local"}
    optim_defaults: ClassVar[dict[str, Any]] = {"lr": 0.0028125}
    optim_source = "official code (PILOT exps/lae.json: init_lr 0.0028125, Adam, constant)"

    def __init__(self, options, *, seed: int = 0) -> None:
        super().__init__(options, seed=seed)
        self.ema: dict[str, torch.Tensor] = {}
        self.pet_names: list[str] = []
        self._calibrating = False

    def setup(self, model) -> None:
        super().setup(model)
        o = self.options
        model.backbone.requires_grad_(False)
        before = {n for n, _ in model.named_parameters()}
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + 11)
        if o.pet == "adapter":
            try:
                attach_adapters(model.backbone, bottleneck=o.bottleneck, scale=o.adapter_scale,
                                layers=o.adapt_blocks, name="lae", dropout=0.0, generator=gen)
            except (ValueError, IndexError) as exc:
                raise ValueError(f"method.adapt_blocks={o.adapt_blocks}: {exc}") from exc
        elif o.pet == "prefix":
            if type(getattr(model.backbone, "inner", None)).__name__ != "ViTModel":
                raise ValueError("method.pet=prefix: LAE's prefix needs an HF ViT backbone (vit-tiny-fmnist, vit-b16, "
                                 "hf-vit)")
            try:
                model.backbone.add_module("lae_prefix", LAEPrefix(model.backbone, o.adapt_blocks, o.prefix_length,
                                                                  generator=gen))
            except ValueError as exc:
                raise ValueError(f"method.adapt_blocks={o.adapt_blocks}: {exc}") from exc
        else:
            inject_lora(model.backbone, ["key", "value"], magnitudes=model.lora_magnitudes)
            layers = {n: layer for n, layer in lora_layers(model.backbone).items()
                      if _block_index(n) in set(o.adapt_blocks)}
            found = {_block_index(n) for n in layers}
            missing = sorted(set(o.adapt_blocks) - found)
            if missing:
                raise ValueError(f"method.adapt_blocks={o.adapt_blocks}: block(s) {missing} do not exist (the "
                                 f"backbone has blocks {sorted({_block_index(n) for n in lora_layers(model.backbone)})})")
            for layer in layers.values():
                layer.add_component("lae", o.rank, generator=gen)
        self.pet_names = [n for n, _ in model.named_parameters() if n not in before]
        params = dict(model.named_parameters())
        for n in self.pet_names:
            params[n].requires_grad_(True)
        if o.ema_from == "first_task":
            self.ema = self._online_copy()

    def _online(self) -> dict[str, torch.Tensor]:
        params = dict(self.model.named_parameters())
        return {n: params[n] for n in self.pet_names}

    def _online_copy(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self._online().items()}

    def _pet_params(self) -> list[nn.Parameter]:
        return list(self._online().values())

    def begin_task(self, task, ctx) -> None:
        super().begin_task(task, ctx)  # the head covers the task first: calibration trains it
        o = self.options
        if not self.ema and task.index > 0:  # official: ModelEmaV2(self.pets) at the second task's setup
            self.ema = self._online_copy()
        calibrate = o.num_freeze_epochs > 0 and (task.index > 0 or o.freeze_first_task)
        if calibrate and ctx.fit is not None:
            self.model.to(ctx.device)
            self._calibrating = True
            try:
                head = [p for p in self.model.head.parameters() if p.requires_grad]
                ctx.fit(model=self.model, data=task.train, groups=[{"params": head, "name": "head"}],
                        loss_fn=lambda m, x, y: self.loss(m, x, y, ctx), epochs=o.num_freeze_epochs,
                        after_step=lambda m: self.after_step(m, ctx), desc=f"lae calibration task {task.index}")
            finally:
                self._calibrating = False

    def after_step(self, model, ctx) -> None:
        if not self.ema:
            return
        online = self._online()
        for k, e in list(self.ema.items()):
            if e.device != online[k].device:
                self.ema[k] = e.to(online[k].device)
        ema_update(self.ema, online, self.options.ema_decay)

    def inference_model(self) -> nn.Module:
        return LAEEnsemble(self.model, self)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"ema/{n}": t.detach().cpu().clone() for n, t in self.ema.items()}

    def load_state(self, tensors, meta) -> None:
        super().load_state(tensors, meta)
        self.ema = {k[len("ema/"):]: v.clone() for k, v in tensors.items() if k.startswith("ema/")}
