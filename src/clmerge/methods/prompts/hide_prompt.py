"""HiDe-Prompt (Wang et al., NeurIPS 2023): within-task prediction, task-identity inference, task-adaptive prediction.

The class-incremental objective is decomposed hierarchically (paper Sec. 3):
P(x ∈ X_{i,j} | D) = P(x ∈ X_{i,j} | x ∈ X_i, D) · P(x ∈ X_i | D), i.e. within-task prediction (WTP) times
task-identity inference (TII), with task-adaptive prediction (TAP) fitting the output layer over all seen classes.

- **WTP**: one prefix prompt per task (layers 0-4, :class:`~.hide_parts.HiDePromptPool`) trained with the task's
  class labels (the engine's loss with the local head) plus ``contrast_weight`` x the contrastive regulariser
  against the prototypes of the old classes' prompted features (:func:`~.hide_parts.contrastive_regulariser`).
- **TII**: after each task, a classifier on the frozen backbone's [CLS] features (no prompt; the "uninstructed"
  representations) over all seen classes (:class:`~.hide_parts.TaskIdentityHead`): trained on the current task's
  features, then (from the second task) realigned on pseudo-features drawn from N(mu_c, Sigma_c) of every seen
  class. The task of its top class picks the prompt at test time.
- **TAP**: the per-class statistics of the prompted ("instructed") features, each class under its own task's
  prompt; from the second task the model's linear head is realigned on pseudo-features of every seen class.

Both realignments are SLCA-style classifier alignment, :func:`clmerge.models.heads.align_linear_head` (plain
logits, no mean decay); both statistics are :class:`clmerge.models.heads.ClassFeatureStats`.
At test time: TII picks the task per sample, the prompted forward pass with that task's prompt and the TAP head
predict. Every option where the paper and the official code (thu-ml/HiDe-Prompt) differ is named; docs/prompts.md.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from ...models.losses import classification_loss
from ...models.heads import ClassFeatureStats, align_linear_head
from ..base import grid_rate, register_method
from .hide_parts import HiDePromptPool, MultiCentroidStats, TaskIdentityHead, contrastive_regulariser
from .methods import PromptMethod, PromptMethodOptions

__all__ = ["HiDePrompt", "HiDePromptOptions"]

# the official ImageNet-R script's learning rates after its linear scaling lr x batch 24 / 256
_TII_LR, _CA_LR = 0.0005 * 24 / 256, 0.005 * 24 / 256


class HiDePromptOptions(PromptMethodOptions):
    pool_size: int = Field(10, ge=1, description="prompts, one per task; must be >= the number of tasks (code "
                           "size 10 for 10 tasks)")
    length: int = Field(20, ge=1, description="L, key and value prefix tokens each, per layer (code length 20 on "
                        "ImageNet-R)")
    layers: list[int] = Field(default_factory=lambda: [0, 1, 2, 3, 4], description="prefix layers (code "
                              "e_prompt_layer_idx 0-4)")
    contrast_weight: float = Field(0.01, ge=0, description="lambda of WTP's contrastive regulariser (code reg: "
                                   "0.01 default, 0.5 in the ImageNet-R script)")
    contrast_temperature: float = Field(0.8, gt=0, description="tau of the contrastive regulariser (code 0.8)")
    contrast_rows: Literal["all", "batch"] = Field(
        "all", description="rows of [prototypes; batch] whose cross-entropy is averaged: all (code orth_loss) or "
        "the batch's only (the paper's L_CR sums over the current task's representations)")
    prompt_momentum: float = Field(0.0, ge=0, le=1, description="code only (prompt_momentum, 0.01 in the "
                                   "ImageNet-R script): task t trains and keeps (1-m) e_t + m mean(e_<t); paper: 0")
    init_from_previous: bool = Field(True, description="prompt t starts as the trained prompt t-1 (code "
                                     "shared_prompt_pool=True); false: its own U(-1, 1) init")
    stats: Literal["full", "diag", "lowrank", "multi_centroid"] = Field(
        "full", description="class statistics of both representations: mean + full covariance (paper; code "
        "'covariance'), diagonal (code 'variance'), low-rank + diagonal (memory), or k-means centroids with "
        "per-centroid variances (code default 'multi-centroid'; its centroids are also the prototypes)")
    stats_rank: int = Field(16, ge=1, description="eigenpairs kept for stats=lowrank")
    n_centroids: int = Field(10, ge=1, description="clusters per class for stats=multi_centroid (code 10)")
    tii_hidden: int = Field(2, ge=0, description="TII's residual MLP width multiplier (code "
                            "original_model_mlp_structure=[2]); 0: a linear classifier")
    tii_epochs: int = Field(20, ge=1, description="TII training epochs on the current task's features (code 20)")
    tii_lr: float = Field(_TII_LR, gt=0, description="TII's Adam lr (code 0.0005 x 24/256)")
    tii_batch_size: int = Field(24, ge=1, description="TII's batch size (code 24)")
    tii_grad_clip: float | None = Field(1.0, gt=0, description="TII gradient-norm clip (code clip_grad 1.0)")
    tii_align_epochs: int = Field(30, ge=0, description="TII realignment epochs on pseudo-features (code "
                                  "crct_epochs 30)")
    tii_align_lr: float = Field(_CA_LR, gt=0, description="TII realignment SGD lr (code ca_lr 0.005 x 24/256)")
    tii_align_samples: int = Field(24, ge=1, description="pseudo-features per class and epoch for TII (code "
                                   "batch_size 24)")
    tap_epochs: int = Field(30, ge=0, description="TAP realignment epochs (code crct_epochs 30)")
    tap_lr: float = Field(_CA_LR, gt=0, description="TAP SGD lr (code ca_lr 0.005 x 24/256)")
    tap_samples: int = Field(120, ge=1, description="pseudo-features per class and epoch for TAP (code "
                             "batch_size x 5)")
    align_weight_decay: float = Field(0.0, ge=0, description="weight decay of both realignments (code: its "
                                      "parameter group's weight_decay, 0.0, overrides the SGD's 5e-4)")


@register_method
class HiDePrompt(PromptMethod):
    name = "hide_prompt"
    description = ("HiDe-Prompt: a prompt per task (prefix-tuning) chosen by task-identity inference on the frozen "
                   "[CLS] feature, contrastive regulariser, head realigned on replayed class statistics")
    Options = HiDePromptOptions
    optim_defaults, optim_source = grid_rate(1e-2)

    def build_pool(self, dim, generator) -> HiDePromptPool:
        o = self.options
        return HiDePromptPool(dim, pool_size=o.pool_size, length=o.length, layers=o.layers,
                              momentum=o.prompt_momentum, init_from_previous=o.init_from_previous,
                              generator=generator)

    def setup(self, model) -> None:
        super().setup(model)
        o, dim = self.options, model.backbone.feature_dim
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + 7717)
        self.tii = TaskIdentityHead(dim, o.tii_hidden, gen)
        self.tii_stats = self._new_stats(dim, 0)  # uninstructed (frozen [CLS])
        self.tap_stats = self._new_stats(dim, 1)  # instructed (each class under its task's prompt)
        self.ranges: list[tuple[int, int]] = []
        self._prototypes: torch.Tensor | None = None
        self.pool.chooser = self.infer_task

    def _new_stats(self, dim: int, which: int) -> ClassFeatureStats | MultiCentroidStats:
        o = self.options
        if o.stats == "multi_centroid":
            return MultiCentroidStats(dim, o.n_centroids, seed=self.seed * 2 + which)
        return ClassFeatureStats(dim, cov=o.stats, rank=o.stats_rank)

    def _generator(self, task: int, stream: int) -> torch.Generator:
        """A private RNG per (seed, task, phase): TII and TAP draws never touch the training RNG."""
        return torch.Generator().manual_seed((self.seed * 1_000_003 + task * 7919 + 15_485_863 * (stream + 1))
                                             % (2**63 - 1))

    # -- hooks ---------------------------------------------------------------------------------------------
    def begin_task(self, task, ctx) -> None:
        if self.ranges[: task.index] and task.offset < self.ranges[task.index - 1][1]:
            raise ValueError("method.name: hide_prompt infers the task from its classes, so it needs tasks with "
                             f"disjoint classes (class-incremental); task {task.index} reuses outputs from "
                             f"{task.offset}")
        super().begin_task(task, ctx)
        if len(self.ranges) == task.index:
            self.ranges.append(task.class_range)
        self.tii.classes.ensure_classes(task.offset + task.n_classes, generator=self._generator(task.index, 0))
        self._prototypes = self._old_prototypes()

    def _old_prototypes(self) -> torch.Tensor:
        """The old classes' prototypes of the contrastive regulariser: class means of the prompted features, or
        every centroid with multi-centroid statistics (code) (P, D)."""
        st = self.tap_stats
        rows = [st.centroids(c) if isinstance(st, MultiCentroidStats) else st.mean(c)[None] for c in st.classes]
        return torch.cat(rows).float() if rows else torch.zeros(0, self.model.backbone.feature_dim)

    def loss(self, model, x, y, ctx) -> torch.Tensor:
        pool = self.pool
        pool._count(torch.eye(pool.n_choices, dtype=torch.float64)[int(pool.task)] * x.shape[0])
        with self.mechanism.using(pool.task_prompt(x.shape[0])):  # WTP: the true task's prompt, no query pass
            feats = model.forward_features(x)
        loss = classification_loss(model.forward_head(feats), y, ctx.task, ctx.head_loss)
        if self.options.contrast_weight and len(feats):  # an empty data-parallel share adds nothing
            self._prototypes = self._prototypes.to(feats.device)  # moved once per task
            loss = loss + self.options.contrast_weight * contrastive_regulariser(
                feats.float(), self._prototypes, self.options.contrast_temperature, self.options.contrast_rows)
        return loss

    def end_task(self, task, ctx) -> None:
        self.pool.fold_momentum()
        tii_losses = self._fit_tii(task, ctx)
        tii_align = self._realign(self.tii, self.tii_stats, task, ctx, stream=1, epochs=self.options.tii_align_epochs,
                                  lr=self.options.tii_align_lr, samples=self.options.tii_align_samples)
        self.tap_stats.update(*self._prompted_features(task, ctx))
        tap = self._realign(self.model.head, self.tap_stats, task, ctx, stream=2, epochs=self.options.tap_epochs,
                            lr=self.options.tap_lr, samples=self.options.tap_samples)
        self.record("hide", {"task": task.index, "tii_losses": tii_losses, "tii_align_losses": tii_align,
                             "tap_losses": tap})
        super().end_task(task, ctx)  # prompt_selection: TII's histogram and task-id accuracy on seen test data

    # -- TII ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def infer_task(self, q: torch.Tensor) -> torch.Tensor:
        """TII: the task of the seen class that the identity head scores highest (B,)."""
        self.tii.to(q.device).eval()
        top = self.tii(q.float()).argmax(dim=1)
        bounds = torch.tensor([hi for _, hi in self.ranges], device=q.device)
        return torch.bucketize(top, bounds, right=True)  # class c lies in task i iff lo_i <= c < hi_i

    @torch.no_grad()
    def _query_features(self, task, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        feats, labels = [], []
        for x, y in task.train.batches(ctx.eval_batch_size):
            feats.append(self.mechanism.query(x.to(ctx.device)).float().cpu())
            labels.append(y)
        return torch.cat(feats), torch.cat(labels)

    def _fit_tii(self, task, ctx) -> list[float]:
        """Train the identity head on the current task's frozen features, cross-entropy over the task's classes
        (code: the train mask), Adam; then store the classes' statistics of those features."""
        o, (lo, hi) = self.options, task.class_range
        feats, labels = self._query_features(task, ctx)
        self.tii_stats.update(feats, labels)
        tii = self.tii.to(ctx.device).train()
        opt = torch.optim.Adam(tii.parameters(), lr=o.tii_lr)
        gen, losses = self._generator(task.index, 3), []
        for _ in range(o.tii_epochs):
            order, total = torch.randperm(len(feats), generator=gen), 0.0
            for i in range(0, len(feats), o.tii_batch_size):
                idx = order[i:i + o.tii_batch_size]
                logits = tii(feats[idx].to(ctx.device))[:, lo:hi]
                loss = F.cross_entropy(logits, labels[idx].to(ctx.device) - lo)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if o.tii_grad_clip:
                    torch.nn.utils.clip_grad_norm_(tii.parameters(), o.tii_grad_clip)
                opt.step()
                total += float(loss.detach()) * len(idx)
            losses.append(round(total / len(feats), 5))
        tii.eval()
        return losses

    # -- TAP ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _prompted_features(self, task, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """The task's training features under its own prompt (eval mode)."""
        model, was = self.model, self.model.training
        model.eval()
        feats, labels = [], []
        for x, y in task.train.batches(ctx.eval_batch_size):
            with self.mechanism.using(self.pool.prompts_for(torch.full((len(x),), task.index, device=ctx.device))):
                feats.append(model.forward_features(x.to(ctx.device)).float().cpu())
            labels.append(y)
        model.train(was)
        return torch.cat(feats), torch.cat(labels)

    def _realign(self, head, stats, task, ctx, *, stream: int, epochs: int, lr: float, samples: int) -> list[float]:
        """Classifier alignment on pseudo-features of every seen class (from the second task, as the code)."""
        if task.index == 0 or epochs == 0:
            return []
        losses = align_linear_head(head, stats, list(self.ranges[: task.index + 1]), epochs=epochs, lr=lr,
                                   samples_per_class=samples, weight_decay=self.options.align_weight_decay,
                                   logit_norm=None, mean_decay=False, generator=self._generator(task.index, stream))
        return [round(v, 5) for v in losses]

    # -- memory across tasks -------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"tii.{k}": v.detach().cpu().clone() for k, v in self.tii.state_dict().items()}
        for name, stats in (("tii_stats", self.tii_stats), ("tap_stats", self.tap_stats)):
            out.update({f"{name}.{k}": v for k, v in stats.state()[0].items()})
        return out

    def state_meta(self) -> dict:
        return {**super().state_meta(), "ranges": [list(r) for r in self.ranges],
                "tii_structure": self.tii.classes.get_structure(),
                "tii_stats": self.tii_stats.state()[1], "tap_stats": self.tap_stats.state()[1]}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        super().load_state(tensors, meta)

        def part(prefix: str) -> dict[str, torch.Tensor]:
            return {k[len(prefix):]: v.cpu() for k, v in tensors.items() if k.startswith(prefix)}

        self.ranges = [tuple(r) for r in meta["ranges"]]
        self.tii.classes.set_structure(meta["tii_structure"])
        self.tii.load_state_dict(part("tii."), strict=True)
        self.tii_stats.load(part("tii_stats."), meta["tii_stats"])
        self.tap_stats.load(part("tap_stats."), meta["tap_stats"])
