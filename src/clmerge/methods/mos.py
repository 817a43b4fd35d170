"""``mos``: Sun et al., "MOS: Model Surgery for Pre-Trained Model-Based Class-Incremental Learning" (AAAI 2025).

Read beside the official code (LAMDA-PILOT ``models/mos.py``, ``backbone/vit_mos.py``, ``exps/mos*.json``);
every place where this implementation differs from it is an option (docs/mos.md lists them).

- **Per-task adapters.** Task t trains its own set of AdaptFormer bottleneck adapters (``adapters.bottleneck``,
  one per transformer block, width ``bottleneck``, scale ``adapter_scale``) and the linear head; the backbone
  stays frozen. The loss is the cross-entropy over the task's own logits (``head.loss: local``; the official
  code masks the old classes' logits with -inf, the same thing) plus ``orth_reg`` times the official code's
  orthogonality term (:func:`orthogonality_loss`).
- **Adapter merging.** Each parameter θ_t of task t's adapter (down and up weights and biases, every block)
  is pulled towards the mean of the earlier tasks' adapters as they stood when their training ended
  (:func:`merged_adapter`)

      θ_t ← (1 − α) θ_t + α · (1/t) Σ_{k<t} θ_k,

  α = ``merge_momentum`` (official: ``reweight_adapter`` with ``adapter_momentum`` 0.1). When, is
  ``merge_schedule``. ``official`` (default), as the official code runs it: ``reweight_adapter`` rewrites every
  block's adapter in place and is called once per block in every forward pass that uses adapter k ≥ 1
  (``forward_features``), and once more after each optimizer step (``adapter_merge``): L + 1 times per step
  (13 on ViT-B), the forward of block i seeing i + 1 of them. The same in-place rule runs on the stored
  adapters whenever they are used at evaluation, so a stored adapter k ≥ 1 converges to the mean of the earlier
  ones within a few test batches, and on the trained adapter while the class statistics are computed (the
  drifted copy is the next task's start; the stored one is the copy taken before). ``per_step`` (the rule
  before): ``merges_per_step`` times after each optimizer step, stored adapters left alone.
- **Classifier alignment.** After each task, the mean and covariance (+ ``cov_eps`` I) of every new class's
  features under its own task's adapter are kept; from the second task on the linear head is retrained on
  Gaussian pseudo-features of all seen classes (official ``classifer_align``: SGD, momentum 0.9, cosine lr).
- **Self-refined adapter retrieval** (:meth:`MOS.predict`). A cosine prototype classifier (class means of the
  ``orig_branch`` features, PILOT's ``CosineLinear``) predicts a class; its task's adapter is tried; the linear
  head's prediction under that adapter names a task; repeat until the task stays the same, at most
  ``retrieval_iters`` adapters per image.
- **Ensemble.** The prediction is argmax of softmax(z_adapted) + softmax(b · z_proto), b the number of tasks
  seen (official ``_eval_cnn`` with ``ensemble``); the model outputs the log of that sum, so accuracy,
  task-aware accuracy and the argmax are those of the ensemble.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from ..adapters.bottleneck import adapter_bank, adapter_sets, attach_adapters, only_adapters
from ..models.losses import classification_loss
from .base import ContinualMethod, MethodOptions, grid_rate, register_method

__all__ = ["MOS", "MOSOptions", "merged_adapter", "orthogonality_loss", "refine_retrieval", "ensemble_scores"]


class MOSOptions(MethodOptions):
    bottleneck: int = Field(16, ge=1, description="adapter width r (official exps/mos*.json: ffn_num 16)")
    adapter_scale: float = Field(0.1, gt=0, description="adapter output scale s (official: 0.1)")
    adapter_dropout: float = Field(0.1, ge=0, lt=1, description="dropout on the adapter's bottleneck (official: 0.1)")
    merge_momentum: float = Field(0.1, ge=0, le=1, description="alpha of the adapter merge theta_t <- (1-alpha) "
                                  "theta_t + alpha mean_{k<t} theta_k (official adapter_momentum 0.1); 0: no merging")
    merge_schedule: Literal["official", "per_step"] = Field(
        "official", description="official: the merge in place once per adapter-carrying block in every forward "
        "pass with adapter k >= 1 (training, class statistics and the stored adapters at evaluation) plus once "
        "after each optimizer step, as the official code (vit_mos.py forward_features, mos.py _init_train); "
        "per_step: merges_per_step times after each optimizer step only, stored adapters untouched")
    merges_per_step: int = Field(1, ge=1, description="merge_schedule=per_step: times the merge is applied after "
                                 "each optimizer step (13 gives the official count per step, all after the step)")
    adapter_init: Literal["previous", "fresh"] = Field(
        "previous", description="a task's new adapter starts from the previous task's trained one (official: one "
        "cur_adapter is trained on and copied at each task's end) or fresh (up-projection zero)")
    orth_reg: float = Field(0.1, ge=0, description="weight of the official code's orthogonality loss (reg 0.1): "
                            "cross-entropy of the similarities of [old class means; batch features] against "
                            "the identity")
    orth_temperature: float = Field(0.8, gt=0, description="orthogonality loss: similarity temperature (0.8)")
    head_lr_scale: float = Field(0.1, gt=0, le=1, description="the linear head's lr as a fraction of the run's "
                                 "(official: adapters init_lr, head init_lr * 0.1)")
    align: bool = Field(True, description="classifier alignment of the linear head from the second task on")
    align_epochs: int = Field(30, ge=1, description="alignment epochs (official crct_epochs 30)")
    align_lr: float = Field(0.005, gt=0, description="alignment SGD lr, cosine to 0 (official ca_lr 0.005)")
    align_weight_decay: float = Field(5e-4, ge=0, description="alignment SGD weight decay (official 5e-4)")
    align_samples: int | None = Field(None, ge=1, description="pseudo-features per class and epoch (official: "
                                      "5 x train.batch_size when null)")
    cov_eps: float = Field(1e-4, ge=0, description="added to the class covariances' diagonal (official 1e-4)")
    retrieval_iters: int = Field(4, ge=1, description="self-refined retrieval: at most this many adapters tried per "
                                 "image (official MAX_ITER 4); 1 keeps the prototype classifier's choice")
    ensemble: bool = Field(True, description="add the prototype branch's softmax to the adapted branch's "
                           "(official ensemble: true)")
    orig_branch: Literal["first_adapter", "pretrained"] = Field(
        "first_adapter", description="features of the prototype classifier: the backbone with the first task's "
        "adapter (official forward_orig, adapter_id=0) or the frozen pretrained backbone alone")

    @model_validator(mode="after")
    def _merges_per_step_needs_per_step(self) -> "MOSOptions":
        if self.merge_schedule == "official" and self.merges_per_step != 1:
            raise ValueError("method.merges_per_step applies to merge_schedule=per_step only (the official schedule "
                             "counts its merges by block calls)")
        return self


# -- the formulas, on plain tensors -----------------------------------------------------------------------------
def merged_adapter(current: torch.Tensor, previous: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """(1 − α) θ_t + α · mean(θ_0..θ_{t−1}): the paper's adapter merge for one parameter (``current`` without
    earlier adapters is returned as it is)."""
    if not previous or alpha == 0:
        return current
    return (1 - alpha) * current + alpha * torch.stack(previous).mean(0)


def orthogonality_loss(features: torch.Tensor, means: torch.Tensor, temperature: float) -> torch.Tensor:
    """The official code's ``orth_loss``: M = [old class means; features], CE(M Mᵀ / τ, identity)."""
    m = torch.cat([means.to(features.dtype), features]) if len(means) else features
    sim = m @ m.T / temperature
    return F.cross_entropy(sim, torch.arange(len(m), device=m.device))


def refine_retrieval(start_task: torch.Tensor, task_logits, task_of: torch.Tensor, iters: int) -> torch.Tensor:
    """Self-refined retrieval: from ``start_task`` (per image), take the logits under that task's adapter
    (``task_logits(tasks) -> logits``), move to the task of their argmax, stop when it no longer changes or after
    ``iters`` adapters; returns the last logits (an image that has settled keeps its logits)."""
    task = start_task
    logits = task_logits(task)
    for _ in range(iters - 1):
        nxt = task_of[logits.argmax(-1)]
        if bool((nxt == task).all()):
            break
        task = nxt
        logits = task_logits(task)
    return logits


def ensemble_scores(adapted: torch.Tensor, proto: torch.Tensor, n_tasks: int) -> torch.Tensor:
    """softmax(adapted) + softmax(n_tasks · proto): the official ensemble (prototype logits at temperature
    1 / n_tasks)."""
    return adapted.softmax(-1) + (proto * n_tasks).softmax(-1)


def _task_name(t: int) -> str:
    return f"task{t}"


def _named_parameters(backbone: nn.Module, t: int) -> dict[str, nn.Parameter]:
    """Task ``t``'s adapter parameters by name (``<block>.down.weight``, ...)."""
    s = adapter_sets(backbone)[_task_name(t)]
    return dict(s.bank.sets[s.name].named_parameters())


class MOSEnsemble(nn.Module):
    """The inference model: the method's :meth:`MOS.predict` over its classifier (eval/train flags propagate)."""

    def __init__(self, method: "MOS") -> None:
        super().__init__()
        self.model = method.model
        object.__setattr__(self, "method", method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.predict(x)


@register_method
class MOS(ContinualMethod):
    name = "mos"
    description = ("MOS (Sun et al. 2025): per-task adapters merged with the earlier ones, self-refined adapter "
                   "retrieval, prototype + adapted ensemble")
    Options = MOSOptions
    optim_defaults, optim_source = grid_rate(9e-4, "Adam, merge_schedule official: validation CIL 61.50 at 9e-4 "
                                                   "against 60.25, 60.00, 56.75 at 4e-4, 2e-3, 5e-3 (5e-3 under "
                                                   "per_step); the paper's SGD rates do not carry over")

    def __init__(self, options, *, seed: int = 0) -> None:
        super().__init__(options, seed=seed)
        self._means = torch.empty(0)
        self._covs = torch.empty(0)
        self._protos = torch.empty(0)
        self._task_of = torch.empty(0, dtype=torch.long)
        self._task = -1
        self._anchors: list[dict[str, torch.Tensor]] = []  # adapter k as its training ended (CPU)
        self._targets: dict[int, dict[str, torch.Tensor]] = {}  # mean of anchors[:k], on the adapters' device
        self._carry: dict[str, torch.Tensor] | None = None  # official: the drifted adapter the next task starts from

    def setup(self, model) -> None:
        model.requires_grad_(False)
        adapter_bank(model.backbone)  # a resumed run rebuilds the task sets into it

    # -- training ---------------------------------------------------------------------------------------------
    def begin_task(self, task, ctx) -> None:
        o, bb = self.options, self.model.backbone
        self._task = task.index
        new = attach_adapters(bb, bottleneck=o.bottleneck, scale=o.adapter_scale, dropout=o.adapter_dropout,
                              name=_task_name(task.index), generator=ctx.generator)
        if o.adapter_init == "previous" and task.index > 0:
            with torch.no_grad():
                if self._carry is not None:
                    for name, p in dict(new.bank.sets[new.name].named_parameters()).items():
                        p.copy_(self._carry[name])
                else:
                    for p, q in zip(new.parameters(), adapter_sets(bb)[_task_name(task.index - 1)].parameters()):
                        p.copy_(q)
        for name, s in adapter_sets(bb).items():
            s.enabled = name == new.name
        self.model.requires_grad_(False)
        new.requires_grad_(True)
        self.model.head.requires_grad_(True)

    def parameter_groups(self, model) -> list[dict]:
        adapters = list(adapter_sets(model.backbone)[_task_name(self._task)].parameters())
        head = [p for p in model.head.parameters() if p.requires_grad]
        return [{"params": adapters, "name": "body"},
                {"params": head, "name": "head", "lr_scale": self.options.head_lr_scale}]

    # -- adapter merging -----------------------------------------------------------------------------------------
    def _target(self, k: int) -> dict[str, torch.Tensor] | None:
        """Mean of the stored adapters 0..k-1 (None for k = 0 or before they exist), on the adapters' device."""
        if k < 1 or len(self._anchors) < k or self.options.merge_momentum == 0:
            return None
        if k not in self._targets:
            device = next(adapter_sets(self.model.backbone)[_task_name(k)].parameters()).device
            self._targets[k] = {n: torch.stack([a[n] for a in self._anchors[:k]]).mean(0).to(device)
                                for n in self._anchors[0]}
        return self._targets[k]

    @torch.no_grad()
    def _merge(self, k: int) -> None:
        """One application of the merge to every parameter of adapter k, in place (values only, as the official
        ``.data`` assignment: autograd does not see it)."""
        target = self._target(k)
        if target is None:
            return
        alpha = self.options.merge_momentum
        for name, p in _named_parameters(self.model.backbone, k).items():
            p.data.copy_((1 - alpha) * p.data + alpha * target[name])

    def _ensure_hooks(self) -> None:
        """official: a forward pre-hook on every block's adapter of every set merges the whole set (the official
        ``forward_features`` calls ``reweight_adapter`` before each block). Hooked lazily, so that sets rebuilt
        by a resume get theirs."""
        if self.options.merge_schedule != "official":
            return
        for name, s in adapter_sets(self.model.backbone).items():
            k = int(name[len("task"):])
            for m in s.modules():
                if not getattr(m, "_mos_merge_hook", False):
                    m.register_forward_pre_hook(lambda module, args, k=k: self._merge(k))
                    m._mos_merge_hook = True

    def loss(self, model, x, y, ctx) -> torch.Tensor:
        self._ensure_hooks()
        feats = model.backbone(x)
        loss = classification_loss(model.head(feats), y, ctx.task, ctx.head_loss)
        if self.options.orth_reg > 0:
            means = self._means.to(feats.device)
            loss = loss + self.options.orth_reg * orthogonality_loss(feats, means, self.options.orth_temperature)
        return loss

    @torch.no_grad()
    def after_step(self, model, ctx) -> None:
        if self._task < 1 or self.options.merge_momentum == 0:
            return
        if self.options.merge_schedule == "official":  # adapter_merge(): once after optimizer.step()
            self._merge(self._task)
            return
        current = _named_parameters(model.backbone, self._task)
        previous = [_named_parameters(model.backbone, k) for k in range(self._task)]  # never moved in this mode
        for name, p in current.items():
            old = [prev[name] for prev in previous]
            for _ in range(self.options.merges_per_step):
                p.copy_(merged_adapter(p, old, self.options.merge_momentum))

    def end_task(self, task, ctx) -> None:
        t = task.index
        adapter_sets(self.model.backbone)[_task_name(t)].requires_grad_(False)
        self.model.head.requires_grad_(False)
        stored = {n: p.detach().clone() for n, p in _named_parameters(self.model.backbone, t).items()}
        self._anchors.append({n: v.cpu() for n, v in stored.items()})  # adapter_update(): the stored copy
        was = self.model.training
        self.model.eval()
        feats, labels = self._features(task, ctx, [_task_name(t)])  # official: merges the trained adapter as it goes
        self._add_class_statistics(feats, labels, task)
        if self.options.merge_schedule == "official":
            with torch.no_grad():
                live = _named_parameters(self.model.backbone, t)
                self._carry = {n: p.detach().cpu().clone() for n, p in live.items()}  # cur_adapter, drifted
                for n, p in live.items():
                    p.copy_(stored[n])  # adapter_list[t]
        feats, labels = self._features(task, ctx, self._orig_sets())
        self._add_prototypes(feats, labels, task)
        self._task_of = torch.cat([self._task_of, torch.full((task.n_classes,), task.index, dtype=torch.long)])
        self.model.train(was)
        if self.options.align and task.index > 0:
            self._align_head(ctx)

    # -- statistics ---------------------------------------------------------------------------------------------
    def _orig_sets(self) -> list[str]:
        return [_task_name(0)] if self.options.orig_branch == "first_adapter" else []

    @torch.no_grad()
    def _features(self, task, ctx, sets: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Backbone features (fp32, CPU) of the task's training data with only the adapter ``sets`` on."""
        out, ys = [], []
        self._ensure_hooks()
        with only_adapters(self.model.backbone, sets):
            for x, y in task.train.batches(ctx.eval_batch_size):
                out.append(self.model.backbone(x.to(ctx.device)).float().cpu())
                ys.append(y)
        return torch.cat(out), torch.cat(ys)

    def _add_class_statistics(self, feats: torch.Tensor, labels: torch.Tensor, task) -> None:
        lo, hi = task.class_range
        means, covs = [], []
        eye = torch.eye(feats.shape[1])
        for c in range(lo, hi):
            f = feats[labels == c]
            means.append(f.mean(0))
            cov = torch.cov(f.T) if len(f) > 1 else torch.zeros_like(eye)
            covs.append(cov + self.options.cov_eps * eye)
        self._means = torch.cat([self._means.reshape(-1, feats.shape[1]), torch.stack(means)])
        self._covs = torch.cat([self._covs.reshape(-1, *eye.shape), torch.stack(covs)])

    def _add_prototypes(self, feats: torch.Tensor, labels: torch.Tensor, task) -> None:
        lo, hi = task.class_range
        protos = torch.stack([feats[labels == c].mean(0) for c in range(lo, hi)])
        self._protos = torch.cat([self._protos.reshape(-1, feats.shape[1]), protos])

    # -- classifier alignment --------------------------------------------------------------------------------
    def _pseudo_features(self, chol_t: torch.Tensor, per_class: int,
                         gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``per_class`` draws from N(mean_c, cov_c) of every seen class: mean_c + z L_cᵀ, z ~ N(0, I), given
        the transposed Cholesky factors ``chol_t`` (float32, as the official sampler draws)."""
        z = torch.randn(len(self._means), per_class, self._means.shape[1], generator=gen)
        x = self._means[:, None, :] + z @ chol_t
        y = torch.arange(len(self._means)).repeat_interleave(per_class)
        return x.reshape(-1, x.shape[-1]), y

    @torch.enable_grad()
    def _align_head(self, ctx) -> None:
        """The official ``classifer_align``: per epoch, fresh pseudo-features of all seen classes, shuffled, in
        as many batches of ``per_class`` as there are classes; SGD on the linear head over the seen logits."""
        o, head = self.options, self.model.head
        head.requires_grad_(True)
        params = [p for p in head.parameters()]
        opt = torch.optim.SGD(params, lr=o.align_lr, momentum=0.9, weight_decay=o.align_weight_decay)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=o.align_epochs)
        per_class, n = o.align_samples or 5 * ctx.batch_size, len(self._means)
        chol_t = torch.linalg.cholesky(self._covs.double()).transpose(1, 2).float()  # once per alignment
        for _ in range(o.align_epochs):
            x, y = self._pseudo_features(chol_t, per_class, ctx.generator)
            perm = torch.randperm(len(y), generator=ctx.generator)
            x, y = x[perm].to(ctx.device), y[perm].to(ctx.device)
            for i in range(n):
                sl = slice(i * per_class, (i + 1) * per_class)
                loss = F.cross_entropy(head(x[sl])[:, :n], y[sl])
                opt.zero_grad()
                loss.backward()
                opt.step()
            sched.step()
        head.requires_grad_(False)

    # -- inference ------------------------------------------------------------------------------------------
    def inference_model(self) -> nn.Module:
        return MOSEnsemble(self)

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Log of the ensemble scores (or the refined adapted logits with ``ensemble: false``), seen classes."""
        bb, head, n = self.model.backbone, self.model.head, len(self._task_of)
        if n == 0:  # before the first task ends: the plain model
            return self.model(x)
        task_of, n_tasks = self._task_of.to(x.device), int(self._task_of.max()) + 1
        self._ensure_hooks()
        with only_adapters(bb, self._orig_sets()):
            proto = F.normalize(bb(x).float(), dim=-1) @ F.normalize(self._protos.to(x.device), dim=-1).T
        feats = []
        for k in range(n_tasks):
            with only_adapters(bb, [_task_name(k)]):
                feats.append(bb(x))
        feats = torch.stack(feats, 1)
        rows = torch.arange(len(x), device=x.device)
        adapted = refine_retrieval(task_of[proto.argmax(-1)], lambda t: head(feats[rows, t])[:, :n].float(),
                                   task_of, self.options.retrieval_iters)
        if not self.options.ensemble:
            return adapted
        return ensemble_scores(adapted, proto, n_tasks).log()

    # -- memory across tasks ----------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {"mos/means": self._means, "mos/covs": self._covs, "mos/protos": self._protos,
               "mos/task_of": self._task_of}
        for k, anchor in enumerate(self._anchors):
            out.update({f"mos/anchor{k}/{n}": v for n, v in anchor.items()})
        if self._carry is not None:
            out.update({f"mos/carry/{n}": v for n, v in self._carry.items()})
        return out

    def load_state(self, tensors, meta) -> None:
        super().load_state(tensors, meta)
        self._means, self._covs = tensors["mos/means"], tensors["mos/covs"]
        self._protos, self._task_of = tensors["mos/protos"], tensors["mos/task_of"].long()
        n_tasks = int(self._task_of.max()) + 1 if len(self._task_of) else 0
        self._anchors = [{n[len(f"mos/anchor{k}/"):]: v for n, v in tensors.items() if n.startswith(f"mos/anchor{k}/")}
                         for k in range(n_tasks)]
        if any(not a for a in self._anchors):
            raise ValueError("mos checkpoint: the stored adapters' end-of-training values (mos/anchor<k>/...) are "
                             "missing; this checkpoint was written by an older clmerge and cannot resume")
        carry = {n[len("mos/carry/"):]: v for n, v in tensors.items() if n.startswith("mos/carry/")}
        self._carry = carry or None
        self._targets = {}
