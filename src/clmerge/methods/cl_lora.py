"""``cl_lora``: He, Duan and Zhu, "CL-LoRA: Continual Low-Rank Adaptation for Rehearsal-Free Class-Incremental
Learning" (CVPR 2025), CL-LoRA.

Followed: the official code ``JiangpengHe/CL-LoRA`` at df4e74e (``models/cllora.py``, ``backbone/vit_cllora.py``,
``utils/inc_net.py`` ``OurNet``, ``exps/*.json``); LibContinual's ``core/model/cl_lora.py`` is the same rule.

- **Task-shared LoRA** on the first half of the blocks (``general_pos`` 0-5 of 12): one LoRA per adapted
  projection (``msa [1, 0, 1]``: query and value), trained in every task. Its down-projection is a random
  orthonormal basis (QR of a uniform matrix, ``Adapter_lora`` ``random_orth``) and stays frozen; only the
  up-projection (zero at the start) trains.
- **Task-specific LoRA** on the second half (``specfic_pos`` 6-11): a new LoRA per task (same init, both
  factors trained), kept frozen afterwards, each scaled by a learned **block weight**: a (3, n_blocks) matrix
  per task, one row per q/k/v projection, initialised uniform in [0.5, 1.5] (``block_weight``).
- **Loss of a batch** (``_init_train``): the cross-entropy of a cosine classifier with a learned scale over the
  current task's classes (``proxy_fc``, PILOT's ``CosineLinearFeature``), plus, from the second task on,
  ``1e-4 ·`` the mean over earlier tasks of ``|cos(vec(W_old), vec(W_t))|`` of the block weights
  (``compute_orthogonality_loss``); and a **separate optimizer step** on the distillation loss
  ``5 · KD_T=2(proxy(s(x)), proxy(s_old(x)))`` (``_KD_loss``: ``-Σ softmax(t/T) · log_softmax(s/T) / B``, no T²),
  where s(x) is the CLS token after the shared blocks alone and the final norm, with the current shared LoRA,
  and s_old(x) the same with the shared LoRA as it was at the end of the previous task (the teacher's logits
  are not detached: the proxy head gets gradient through both). Before that step the gradient of each shared
  up-projection is rescaled per output row by the teacher's row norms, normalised to mean 1.
- **Inference** (``OurNet.forward(test=True)`` → ``forward_diagonal``): task i's subspace is the backbone with the
  (current) shared LoRA, task i's specific LoRA and block weight; a class of task i is scored by the cosine
  of its own subspace's feature with its prototype there, the mean training feature computed at the end of
  its task (``replace_fc``). The off-diagonal prototypes the code also computes are never read.

Differences from the official code, each an option or stated:

- ``kd_step``: ``separate`` (default) makes the official two updates per batch, the distillation step first;
  the cross-entropy's gradient is taken at the parameters *before* that step, where the code's forward pass
  puts it. (On the CPU with torch 2.13 the code's own order, ``loss.backward()`` after ``optimizer.step()``,
  stops with "modified by an inplace operation": the cross-entropy's graph holds the proxy head's weights.
  Why it runs in the authors' environment, torch 2.0.1 on CUDA, is not settled here.) ``joint`` is one update
  on the sum, the rescaling applied to the distillation gradient alone.
- The optimizer: the official SGD (momentum 0.9, 0.03, cosine, 30 epochs) is not the protocol of this
  library's grid (Adam, rates selected on validation); ``optim_defaults`` say which rate is used.
- The backbone: an HF ViT (``embeddings``, ``layers``, ``layernorm``); the shared blocks are the first half of
  its layers (``shared_blocks``). Text backbones are refused.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from ..adapters import inject_lora, lora_layers
from ..adapters.lora import LoRAComponent, LoRALinear
from ..config import ConfigError
from .base import ContinualMethod, MethodOptions, grid_rate, register_method
from .ease import EaseClassifier, subspace_weights
from .first_session import CosineClassifier

__all__ = ["CLLoRA", "CLLoRAOptions", "kd_loss", "block_weight_orthogonality", "row_norm_weights",
           "orthonormal_down"]

SHARED = "shared"
_ROWS = {"q_proj": 0, "query": 0, "k_proj": 1, "key": 1, "v_proj": 2, "value": 2}


class CLLoRAOptions(MethodOptions):
    rank: int = Field(8, ge=1, description="LoRA rank (official exps/cifar.json ffn_num 8; inr.json 10)")
    targets: list[str] = Field(["query", "value"], min_length=1, description="adapted attention projections "
                               "(official msa [1, 0, 1]: q and v)")
    shared_blocks: int | None = Field(None, ge=0, description="leading blocks with the task-shared LoRA; the "
                                      "rest get task-specific ones (None: half the layers, rounded down, official "
                                      "general_pos 0-5 of 12; 0: no shared LoRA and no distillation)")
    kd_weight: float = Field(5.0, ge=0, description="weight of the distillation loss (official kd_ratio 5)")
    kd_temperature: float = Field(2.0, gt=0, description="distillation temperature (official Temperature 2)")
    kd_step: Literal["separate", "joint"] = Field("separate", description="separate: its own optimizer step "
                                                  "before the cross-entropy's (the official code); joint: one "
                                                  "step on the sum")
    grad_reweight: bool = Field(True, description="rescale the shared up-projections' distillation gradient "
                                "per row by the teacher's row norms (official code)")
    block_weight: bool = Field(True, description="learned per-task block weights on the specific LoRAs "
                               "(official use_block_weight true)")
    orth_weight: float = Field(1e-4, ge=0, description="weight of the block weights' orthogonality loss "
                               "(official 0.0001)")
    down_init: Literal["orthogonal", "lora"] = Field("orthogonal", description="down-projection init: a random "
                                                     "orthonormal basis (official random_orth) or Kaiming-uniform")


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """``-Σ softmax(teacher/T) · log_softmax(student/T) / B`` (official ``_KD_loss``; no T² factor)."""
    log_p = torch.log_softmax(student / temperature, dim=1)
    q = torch.softmax(teacher / temperature, dim=1)
    return -(q * log_p).sum() / student.shape[0]


def block_weight_orthogonality(old: list[torch.Tensor], current: torch.Tensor, eps: float = 1e-8):
    """Mean over ``old`` of ``|<w_old/(‖w_old‖+ε), w/(‖w‖+ε)>|`` on the flattened matrices (official
    ``compute_orthogonality_loss``); 0 without old ones."""
    if not old:
        return current.sum() * 0.0
    cur = current.flatten() / (current.flatten().norm() + eps)
    total = sum((o.flatten() / (o.flatten().norm() + eps) * cur).sum().abs() for o in old)
    return total / len(old)


def row_norm_weights(up: torch.Tensor) -> torch.Tensor | None:
    """Per-row factors ``n · ‖u_i‖ / Σ_j ‖u_j‖`` of an up-projection (out, r); None when every row is zero (the
    official division would give NaN)."""
    norms = up.float().norm(dim=1)
    total = norms.sum()
    if not torch.isfinite(total) or total <= 0:
        return None
    return norms.numel() * norms / total


def orthonormal_down(d_in: int, rank: int, generator: torch.Generator | None) -> torch.Tensor:
    """(rank, d_in): Q^T of the QR factorisation of a uniform (d_in, rank) matrix (official ``random_orth``)."""
    q, _ = torch.linalg.qr(torch.rand(d_in, rank, generator=generator))
    return q.T.contiguous()


def _block_of(name: str) -> int:
    m = re.search(r"(?:^|\.)layers?\.(\d+)\.", name)
    if m is None:
        raise ConfigError(f"method cl_lora: cannot tell the block of LoRA layer {name!r} (expected '...layers.N...')")
    return int(m.group(1))


def _row_of(name: str) -> int:
    row = _ROWS.get(name.rsplit(".", 1)[-1])
    if row is None:
        raise ConfigError(f"method cl_lora: LoRA layer {name!r} is not an attention query/key/value projection; "
                          "method.targets takes query, key, value")
    return row


def _vit_parts(backbone: nn.Module) -> tuple[nn.Module, nn.Module, nn.ModuleList, nn.Module]:
    inner = getattr(backbone, "inner", None)
    layers = getattr(inner, "layers", None)
    if layers is None and hasattr(inner, "encoder"):
        layers = getattr(inner.encoder, "layer", None)
    parts = (getattr(inner, "embeddings", None), layers, getattr(inner, "layernorm", None))
    if inner is None or any(p is None for p in parts) or not hasattr(backbone, "preprocess"):
        raise ConfigError("method cl_lora needs an HF ViT backbone (embeddings, layers, final layernorm); "
                          f"{type(inner if inner is not None else backbone).__name__} is not one")
    return (inner,) + parts  # type: ignore[return-value]


@contextmanager
def active_components(layers: dict[str, LoRALinear], active: dict[str, dict[str, LoRAComponent]]):
    """Within the block, layer ``n`` applies only the components ``active[n]`` (none where absent)."""
    saved = {n: layer.components for n, layer in layers.items()}
    try:
        for n, layer in layers.items():
            layer.components = nn.ModuleDict(active.get(n, {}))
        yield
    finally:
        for n, layer in layers.items():
            layer.components = saved[n]


class CLLoRAClassifier(EaseClassifier):
    """Task i's classes scored on subspace i only (official ``forward_diagonal``), EASE's classifier with
    identity subspace weights; a subspace is the backbone with the shared LoRA and task i's."""

    def __init__(self, method: "CLLoRA", protos, class_task, fallback) -> None:
        n = len(method.block_weights)
        super().__init__(method.model.backbone, [f"task{i}" for i in range(n)], protos, class_task,
                         subspace_weights(n, alpha=0.0), fallback)
        self._method = [method]  # not a submodule

    def features(self, x: torch.Tensor) -> torch.Tensor:
        m = self._method[0]
        out = []
        for i in range(len(self.subspaces)):
            with m.subspace(i, m.block_weights[i]):
                out.append(self.backbone(x))
        return torch.stack(out, dim=1)


@register_method
class CLLoRA(ContinualMethod):
    name = "cl_lora"
    description = ("CL-LoRA (He et al., CVPR 2025): a task-shared LoRA kept by distillation with row-reweighted "
                   "gradients in the first blocks, task-specific LoRAs with learned block weights in the last, "
                   "diagonal prototype classifier")
    Options = CLLoRAOptions
    optim_defaults, optim_source = grid_rate(9e-4, "Adam, split_mnist5k seed 0: validation CIL 42.25 at 9e-4, "
                                             "41.75 at 4e-4, 35.75 at 2e-3, 23.75 at 5e-3; the official SGD 0.03 "
                                             "with momentum does not carry over")

    def __init__(self, options, *, seed: int = 0) -> None:
        super().__init__(options, seed=seed)
        self.block_weights: list[torch.Tensor] = []  # one (3, n_specific) per finished task
        self.protos = torch.zeros(0, 0, 0)  # (C, S, d): only the diagonal blocks are filled
        self.ranges: list[tuple[int, int]] = []
        self.current_bw: nn.Parameter | None = None
        self.proxy: CosineClassifier | None = None
        self.teacher: dict[str, LoRAComponent] = {}
        self._task: int | None = None
        self._inference: nn.Module | None = None

    # -- structure ---------------------------------------------------------------------------------------
    def setup(self, model) -> None:
        super().setup(model)
        _, _, vit_layers, _ = _vit_parts(model.backbone)
        model.backbone.requires_grad_(False)
        inject_lora(model.backbone, self.options.targets, magnitudes=model.lora_magnitudes)
        self.layers = lora_layers(model.backbone)
        n_layers = len(vit_layers)
        k = self.options.shared_blocks if self.options.shared_blocks is not None else n_layers // 2
        if not 0 <= k < n_layers:
            raise ConfigError(f"method.shared_blocks: {k} leaves no task-specific block in a {n_layers}-layer "
                              f"backbone (0 to {n_layers - 1})")
        self.n_shared = k
        self.shared_names = [n for n in self.layers if _block_of(n) < k]
        self.specific_names = [n for n in self.layers if _block_of(n) >= k]
        self.spec_blocks = sorted({_block_of(n) for n in self.specific_names})
        for n in self.layers:
            _row_of(n)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + 7919)
        for n in self.shared_names:
            self._add(self.layers[n], SHARED, gen)
        self._inference = model

    def _add(self, layer: LoRALinear, name: str, gen: torch.Generator) -> LoRAComponent:
        o = self.options
        init = "zeros" if o.down_init == "orthogonal" else "lora"
        comp = layer.add_component(name, o.rank, init=init, scale=1.0, generator=gen)
        if o.down_init == "orthogonal":
            with torch.no_grad():
                comp.lora_down.copy_(orthonormal_down(layer.in_features, o.rank, gen))
        return comp

    def begin_task(self, task, ctx) -> None:
        if task.offset < (self.ranges[-1][1] if self.ranges else 0):
            raise ValueError(f"scenario.kind: cl_lora needs new classes in every task (class- or "
                             f"task-incremental); task {task.index} reuses outputs from {task.offset}")
        super().begin_task(task, ctx)
        t, o, dev = task.index, self.options, ctx.device
        self._task = t
        self.model.requires_grad_(False)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + task.index)
        name = f"task{t}"
        for n in self.specific_names:
            layer = self.layers[n]
            comp = layer.components[name] if name in layer.components else self._add(layer, name, gen)
            comp.requires_grad_(True)
        for n in self.shared_names:  # the shared down-projection stays frozen (official get_new_adapter_msa)
            self.layers[n].components[SHARED].lora_up.requires_grad_(True)
        self.teacher = {}
        if t > 0 and self.shared_names:  # the shared LoRA as it ends the previous task (official old_adapter_list[t - 1])
            for n in self.shared_names:
                src = self.layers[n].components[SHARED]
                copy = LoRAComponent(src.lora_down.shape[1], src.lora_up.shape[0], src.rank, init="zeros",
                                     scale=src.scale).to(src.lora_up.device)
                copy.load_state_dict(src.state_dict())
                self.teacher[n] = copy.requires_grad_(False)
        bw = torch.empty(3, len(self.spec_blocks)).uniform_(0.5, 1.5, generator=gen)
        self.current_bw = nn.Parameter(bw.to(dev), requires_grad=o.block_weight)
        self.proxy = CosineClassifier(self.model.backbone.feature_dim, task.n_classes, generator=gen).to(dev)

    def parameter_groups(self, model) -> list[dict]:
        body = [p for p in model.backbone.parameters() if p.requires_grad]
        if self.current_bw is not None and self.current_bw.requires_grad:
            body.append(self.current_bw)
        head = list(self.proxy.parameters()) if self.proxy is not None else []
        return [{"params": body, "name": "body"}] + ([{"params": head, "name": "head"}] if head else [])

    @contextmanager
    def subspace(self, task: int, bw: torch.Tensor | None):
        """The backbone as task ``task``'s subspace: the shared LoRA and that task's, scaled by ``bw``."""
        name = f"task{task}"
        active = {n: {SHARED: self.layers[n].components[SHARED]} for n in self.shared_names}
        comps = []
        for n in self.specific_names:
            comp = self.layers[n].components[name]
            if bw is not None and self.options.block_weight:
                comp.multiplier = bw[_row_of(n), self.spec_blocks.index(_block_of(n))]
            comps.append(comp)
            active[n] = {name: comp}
        try:
            with active_components(self.layers, active):
                yield
        finally:
            for comp in comps:
                comp.multiplier = 1.0

    def _shared_cls(self, x: torch.Tensor, components: dict[str, LoRAComponent]) -> torch.Tensor:
        """CLS token after the shared blocks alone and the final norm (official ``forward_general_cls``)."""
        bb = self.model.backbone
        inner, emb, vit_layers, norm = _vit_parts(bb)
        pixels = bb.preprocess(x)
        weight = inner.embeddings.patch_embeddings.projection.weight if hasattr(inner.embeddings,
                                                                                  "patch_embeddings") else None
        h = emb(pixels.to(weight.dtype) if weight is not None else pixels)
        with active_components(self.layers, {n: {SHARED: components[n]} for n in self.shared_names}):
            for layer in vit_layers[: self.n_shared]:
                h = layer(h, None)
        return norm(h)[:, 0]

    # -- training ----------------------------------------------------------------------------------------
    def loss(self, model, x, y, ctx) -> torch.Tensor:
        task = ctx.task
        with self.subspace(task.index, self.current_bw):
            feats = model.forward_features(x)
        loss = F.cross_entropy(self.proxy(feats), y - task.offset)
        if task.index > 0 and self.options.block_weight and self.options.orth_weight > 0:
            old = [w.to(self.current_bw) for w in self.block_weights]
            loss = loss + self.options.orth_weight * block_weight_orthogonality(old, self.current_bw)
        if self.options.kd_step == "joint" and self.teacher and self.options.kd_weight > 0:
            loss = loss + self._joint_kd(x)
        return loss

    def _kd(self, x: torch.Tensor) -> torch.Tensor:
        o = self.options
        current = {n: self.layers[n].components[SHARED] for n in self.shared_names}
        student = self.proxy(self._shared_cls(x, current))
        teacher = self.proxy(self._shared_cls(x, self.teacher))
        return o.kd_weight * kd_loss(student, teacher, o.kd_temperature)

    def _joint_kd(self, x: torch.Tensor) -> torch.Tensor:
        """The distillation loss for a joint step; with ``grad_reweight`` plus a term of value 0 whose gradient
        on each shared up-projection is ``(w - 1) · g`` (g: the distillation gradient there, w: the row factors),
        so that the step's distillation gradient there is ``w · g`` and every other gradient is unchanged."""
        kd = self._kd(x)
        if not self.options.grad_reweight:
            return kd
        ups = [self.layers[n].components[SHARED].lora_up for n in self.shared_names]
        grads = torch.autograd.grad(kd, ups, retain_graph=True, allow_unused=True)
        extra = kd.new_zeros(())
        for n, up, g in zip(self.shared_names, ups, grads):
            w = row_norm_weights(self.teacher[n].lora_up)
            if g is not None and w is not None:
                extra = extra + ((w.to(g)[:, None] - 1) * g).detach().mul(up).sum()
        return kd + (extra - extra.detach())

    def first_step_loss(self, model, x, y, ctx) -> torch.Tensor | None:
        if self.options.kd_step != "separate" or not self.teacher or self.options.kd_weight == 0:
            return None
        return self._kd(x)

    def before_first_step(self, model, ctx) -> None:
        if self.options.grad_reweight:
            for n in self.shared_names:
                up = self.layers[n].components[SHARED].lora_up
                w = row_norm_weights(self.teacher[n].lora_up)
                if up.grad is not None and w is not None:
                    up.grad.mul_(w.to(up.grad)[:, None])

    # -- after a task ------------------------------------------------------------------------------------
    def end_task(self, task, ctx) -> None:
        self.model.requires_grad_(False)
        bw = self.current_bw.detach().float().cpu().clone()
        self.block_weights.append(bw)
        self.ranges.append(task.class_range)
        lo, hi = task.class_range
        means = self._class_means(task, ctx, len(self.block_weights) - 1)
        n_sub, d = len(self.block_weights), means.shape[1]
        protos = torch.zeros(hi, n_sub, d)
        if self.protos.numel():
            protos[: self.protos.shape[0], : self.protos.shape[1]] = self.protos
        protos[lo:hi, n_sub - 1] = means
        self.protos = protos
        self.current_bw, self.proxy, self.teacher, self._task = None, None, {}, None
        self._build_inference()

    @torch.no_grad()
    def _class_means(self, task, ctx, index: int) -> torch.Tensor:
        bb, (lo, hi) = self.model.backbone, task.class_range
        was = bb.training
        bb.eval()
        sums, counts = None, torch.zeros(hi - lo, dtype=torch.float64)
        with self.subspace(index, self.block_weights[index].to(ctx.device)):
            for x, y in task.train.batches(ctx.eval_batch_size):
                f = bb(x.to(ctx.device)).double().cpu()
                sums = torch.zeros(hi - lo, f.shape[1], dtype=torch.float64) if sums is None else sums
                sums.index_add_(0, y.cpu() - lo, f)
                counts.index_add_(0, y.cpu() - lo, torch.ones(len(y), dtype=torch.float64))
        bb.train(was)
        return (sums / counts.clamp_min(1)[:, None]).float()

    def _build_inference(self) -> None:
        class_task = torch.cat([torch.full((hi - lo,), k) for k, (lo, hi) in enumerate(self.ranges)])
        dev = next(self.model.backbone.parameters()).device
        self.block_weights = [w.to(dev) for w in self.block_weights]
        self._inference = CLLoRAClassifier(self, self.protos, class_task, self.model)

    def inference_model(self) -> nn.Module:
        return self._inference

    def state_tensors(self) -> dict[str, torch.Tensor]:
        if not self.ranges:
            return {}
        out = {"protos": self.protos.clone()}
        out.update({f"block_weight/{i}": w.detach().cpu().clone() for i, w in enumerate(self.block_weights)})
        return out

    def state_meta(self) -> dict:
        return {"ranges": [list(r) for r in self.ranges]}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self.ranges = [(int(lo), int(hi)) for lo, hi in meta.get("ranges", [])]
        if self.ranges:
            self.protos = tensors["protos"].float().cpu()
            self.block_weights = [tensors[f"block_weight/{i}"].float() for i in range(len(self.ranges))]
            self._build_inference()

