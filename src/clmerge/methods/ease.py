"""``ease``: Zhou et al., "Expandable Subspace Ensemble for Pre-Trained Model-Based Class-Incremental Learning"
(CVPR 2024), EASE.

- **Expandable subspaces.** Task t trains a new set of AdaptFormer adapters (``adapters.bottleneck``, named
  ``task{t}``) and a linear head block over its own classes (``head.loss: local``, PILOT's proxy classifier);
  earlier sets stay frozen. Subspace k is the backbone's feature with set k alone enabled, φ_k(x) ∈ R^d; the
  image's feature is their concatenation [φ_0(x); …; φ_t(x)].
- **Prototypes.** At the end of task t the prototype P[c, k] of each new class c is its mean training feature
  in every subspace k ≤ t. An old class (task i < t) has no data in a later subspace j; its prototype there
  is completed from the classes that have prototypes in both (semantic-guided prototype complement):

      Sim[a, b] = softmax_b( cos(P[a, i], P[b, i]) / τ )        (a: class of task i; b: a class of tasks j..t)
      P[a, j]   = Σ_b Sim[a, b] · P[b, j]

  (:func:`prototype_complement`). PILOT's ``solve_sim_reset`` (``recalc_sim: true``, the default) redoes this
  after every task for every pair i < j ≤ t with the classes of tasks j..t; ``recalc_sim: false`` is PILOT's
  ``solve_similarity``: only the newest subspace, from the current task's classes. PILOT uses τ = 1 and every
  co-occurring class (no top-k); ``sim_temperature`` is this library's option (default 1, as PILOT).
- **Subspace reweighting.** The logit of class c of task i is
  ``Σ_k w[i, k] · cos(φ_k(x), P[c, k])`` with w = 1 on the class's own subspace k = i and α / t on the others
  (PILOT ``EaseCosineLinear.forward_reweight``, ``alpha`` 0.1, t the 0-based index of the current task);
  ``reweight: false`` takes the cosine of the whole concatenated vectors instead. ``use_init_ptm`` adds the
  pretrained backbone as a subspace with weight β (PILOT ``use_init_ptm`` false, ``beta`` 0).

PILOT's exps/ease.json: SGD (momentum 0.9), ``init_lr`` 0.025, 20 epochs per task, cosine schedule, weight decay
5e-4, batch size 48, adapter bottleneck 64 (``ffn_num``), scale 0.1, dropout 0.1: in this library
``optim.name=sgd optim.lr=0.025 train.epochs=20 optim.schedule=cosine optim.weight_decay=5e-4
train.batch_size=48`` (the config's values are used). Difference: the proxy head is the library's linear
block, not PILOT's cosine classifier with a learned scale; it does not predict in either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from ..adapters.bottleneck import adapter_bank, adapter_sets, attach_adapters, only_adapters
from .base import ContinualMethod, MethodOptions, grid_rate, register_method
from ..utils.progress import phase

__all__ = ["EASE", "EASEOptions", "EaseClassifier", "prototype_complement", "subspace_weights"]

PTM = "pretrained"


class EASEOptions(MethodOptions):
    bottleneck: int = Field(64, ge=1, description="adapter bottleneck width r (PILOT ffn_num 64 at ViT-B)")
    adapter_scale: float = Field(0.1, gt=0, description="adapter output scale s (PILOT ffn_adapter_scalar 0.1)")
    adapter_dropout: float = Field(0.1, ge=0, lt=1, description="dropout in the adapter bottleneck (PILOT 0.1)")
    alpha: float = Field(0.1, ge=0, description="subspace reweighting: weight of a class's other subspaces, "
                         "divided by the task index t (PILOT alpha 0.1)")
    reweight: bool = Field(True, description="subspace reweighting at inference (PILOT use_reweight true); false: "
                           "cosine of the concatenated features")
    recalc_sim: bool = Field(True, description="recompute every old class's completed prototypes in every later "
                             "subspace after each task (PILOT recalc_sim true); false: newest subspace only")
    sim_temperature: float = Field(1.0, gt=0, description="softmax temperature of the prototype complement's "
                                   "similarities (PILOT: 1)")
    use_init_ptm: bool = Field(False, description="add the pretrained backbone's feature as a subspace (PILOT "
                               "use_init_ptm false)")
    beta: float = Field(0.0, ge=0, description="weight of the pretrained subspace with use_init_ptm (PILOT 0)")


def prototype_complement(own_old: torch.Tensor, shared_old: torch.Tensor, shared_new: torch.Tensor, *,
                         temperature: float = 1.0) -> torch.Tensor:
    """Old classes' prototypes in a new subspace, from classes seen in both (EASE's prototype complement).

    Args:
        own_old: (n_a, d) the old classes' prototypes in their own (old) subspace.
        shared_old: (n_b, d) the co-occurring classes' prototypes in that old subspace.
        shared_new: (n_b, d') the co-occurring classes' prototypes in the new subspace.

    Returns:
        (n_a, d'): ``softmax_b(cos(own_old[a], shared_old[b]) / τ) @ shared_new``.
    """
    sim = F.normalize(own_old, dim=-1) @ F.normalize(shared_old, dim=-1).T  # (n_a, n_b)
    return torch.softmax(sim / temperature, dim=1) @ shared_new


def subspace_weights(n_tasks: int, *, alpha: float, beta: float = 0.0, use_init_ptm: bool = False) -> torch.Tensor:
    """(n_tasks, S) weight of subspace k in the logits of a class of task i (EASE's subspace reweighting).

    1 on the class's own subspace, α / t on the other task subspaces (t = n_tasks - 1), β on the pretrained
    subspace (column 0 with ``use_init_ptm``).
    """
    off = int(use_init_ptm)
    t = n_tasks - 1
    w = torch.full((n_tasks, n_tasks + off), alpha / max(t, 1))
    if off:
        w[:, 0] = beta
    for i in range(n_tasks):
        w[i, i + off] = 1.0
    return w


class EaseClassifier(nn.Module):
    """Images -> logits of every seen class from per-subspace features and prototypes.

    Args:
        backbone: the adapted backbone (its adapter sets switched per subspace).
        subspaces: adapter-set names per subspace (:data:`PTM`: no set, the pretrained feature).
        protos: (C, S, d) prototypes.
        class_task: (C,) task index of every class.
        weights: (n_tasks, S) subspace weights, or None for the cosine of the concatenated vectors.
        fallback: what predicts while there are no subspaces yet (the untrained model, before the first task ends).
    """

    def __init__(self, backbone: nn.Module, subspaces: list[str], protos: torch.Tensor, class_task: torch.Tensor,
                 weights: torch.Tensor | None, fallback: nn.Module | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        self._fallback = [fallback]  # a plain list: not a submodule of the classifier
        self.subspaces = subspaces
        self.register_buffer("protos", protos.float().clone(), persistent=False)
        self.register_buffer("class_task", class_task.long().clone(), persistent=False)
        self.register_buffer("weights", None if weights is None else weights.float().clone(), persistent=False)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, d): the feature of ``x`` in every subspace."""
        out = []
        for name in self.subspaces:
            with only_adapters(self.backbone, [] if name == PTM else [name]):
                out.append(self.backbone(x))
        return torch.stack(out, dim=1)

    def logits_from(self, feats: torch.Tensor) -> torch.Tensor:
        protos = self.protos.to(feats.device, feats.dtype)
        if self.weights is None:
            return F.normalize(feats.flatten(1), dim=-1) @ F.normalize(protos.flatten(1), dim=-1).T
        cos = torch.einsum("bsd,csd->bcs", F.normalize(feats, dim=-1), F.normalize(protos, dim=-1))
        w = self.weights.to(feats.device, feats.dtype)[self.class_task.to(feats.device)]  # (C, S)
        return (cos * w).sum(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.subspaces:
            return self._fallback[0](x)
        return self.logits_from(self.features(x))


@torch.no_grad()
def _class_means(backbone: nn.Module, data, names: list[str], lo: int, hi: int, *, batch_size: int,
                 device) -> torch.Tensor:
    """(hi - lo, d) mean feature of each class of ``data`` (labels in [lo, hi)) with only ``names`` enabled."""
    was = backbone.training
    backbone.eval()
    sums, counts = None, torch.zeros(hi - lo)
    with only_adapters(backbone, names):
        for x, y in phase(data.batches(batch_size), "ease: prototypes", total=data.num_batches(batch_size)):
            f = backbone(x.to(device)).double().cpu()
            sums = torch.zeros(hi - lo, f.shape[1], dtype=torch.float64) if sums is None else sums
            sums.index_add_(0, y.cpu() - lo, f)
            counts.index_add_(0, y.cpu() - lo, torch.ones(len(y)))
    backbone.train(was)
    return (sums / counts.clamp_min(1).double()[:, None]).float()


@register_method
class EASE(ContinualMethod):
    name = "ease"
    description = ("EASE (Zhou et al., CVPR 2024): one adapter subspace per task, prototypes completed in new "
                   "subspaces from class similarity, reweighted cosine ensemble")
    Options = EASEOptions
    optim_defaults, optim_source = grid_rate(5e-3, "Adam; the paper's SGD rates do not carry over")

    def __init__(self, options, *, seed: int = 0) -> None:
        super().__init__(options, seed=seed)
        self.protos = torch.zeros(0, 0, 0)  # (C, S, d)
        self.ranges: list[tuple[int, int]] = []
        self._inference: EaseClassifier | None = None

    @property
    def _off(self) -> int:
        return int(self.options.use_init_ptm)

    def setup(self, model) -> None:
        super().setup(model)
        model.backbone.requires_grad_(False)
        adapter_bank(model.backbone)  # exists from the start, so a resumed run rebuilds its sets into it
        self._inference = EaseClassifier(model.backbone, [], torch.zeros(0, 0, 0), torch.zeros(0), None, model)

    def begin_task(self, task, ctx) -> None:
        if task.offset < (self.ranges[-1][1] if self.ranges else 0):
            raise ValueError(f"scenario.kind: ease needs new classes in every task (class- or task-incremental); "
                             f"task {task.index} reuses outputs from {task.offset}")
        super().begin_task(task, ctx)
        o, bb = self.options, self.model.backbone
        for s in adapter_sets(bb).values():
            s.requires_grad_(False)
            s.enabled = False
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + task.index)
        attach_adapters(bb, bottleneck=o.bottleneck, scale=o.adapter_scale, dropout=o.adapter_dropout,
                        name=f"task{task.index}", generator=gen)
        self.model.head.requires_grad_(False)
        self.model.head.blocks[-1].requires_grad_(True)  # the proxy head of this task's classes

    def end_task(self, task, ctx) -> None:
        self.model.requires_grad_(False)
        self.ranges.append(task.class_range)
        self._add_prototypes(task, ctx)
        self._complete()
        self._build_inference()

    def _subspaces(self) -> list[str]:
        return [PTM] * self._off + [f"task{k}" for k in range(len(self.ranges))]

    def _add_prototypes(self, task, ctx) -> None:
        """P[c, k] of the task's classes in every subspace k (the new subspace's column starts at zero)."""
        lo, hi = task.class_range
        subspaces = self._subspaces()
        means = [_class_means(self.model.backbone, task.train, [] if s == PTM else [s], lo, hi,
                              batch_size=ctx.eval_batch_size, device=ctx.device) for s in subspaces]
        old = self.protos
        d = means[0].shape[1]
        protos = torch.zeros(hi, len(subspaces), d)
        if old.numel():
            protos[: old.shape[0], : old.shape[1]] = old
        protos[lo:hi] = torch.stack(means, dim=1)
        self.protos = protos

    def _complete(self) -> None:
        """Every old class's prototype in every later subspace (PILOT solve_sim_reset / solve_similarity)."""
        t, off, P = len(self.ranges) - 1, self._off, self.protos
        for i in range(t):
            lo_i, hi_i = self.ranges[i]
            for j in (range(i + 1, t + 1) if self.options.recalc_sim else [t]):
                ref = slice(self.ranges[j][0], self.ranges[t][1])  # classes of tasks j..t: prototypes in i and j
                P[lo_i:hi_i, j + off] = prototype_complement(P[lo_i:hi_i, i + off], P[ref, i + off],
                                                             P[ref, j + off],
                                                             temperature=self.options.sim_temperature)

    def _build_inference(self) -> None:
        o = self.options
        class_task = torch.cat([torch.full((hi - lo,), k) for k, (lo, hi) in enumerate(self.ranges)])
        weights = subspace_weights(len(self.ranges), alpha=o.alpha, beta=o.beta,
                                   use_init_ptm=o.use_init_ptm) if o.reweight else None
        self._inference = EaseClassifier(self.model.backbone, self._subspaces(), self.protos, class_task, weights,
                                         self.model)

    def inference_model(self) -> nn.Module:
        return self._inference

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"protos": self.protos.clone()} if self.ranges else {}

    def state_meta(self) -> dict:
        return {"ranges": [list(r) for r in self.ranges]}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self.ranges = [(int(lo), int(hi)) for lo, hi in meta.get("ranges", [])]
        if self.ranges:
            self.protos = tensors["protos"].float().cpu()
            self._build_inference()
