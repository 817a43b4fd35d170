"""``icarl``: iCaRL (Rebuffi et al., CVPR 2017, "iCaRL: Incremental Classifier and Representation Learning"), as
in PyCIL's ``models/icarl.py`` and the exemplar machinery of its ``models/base.py`` (docs/classic_baselines.md).

- Exemplars: a fixed memory of ``buffer_size`` examples, ``buffer_size // (classes seen)`` per class. At the end
  of each task every old class keeps its first exemplars (herding order) and each new class gets its own,
  chosen by herding on the L2-normalised features of the trained model.
- Training: the new task's data with the exemplars (here: a memory batch drawn beside each current batch),
  ``L = CE(f(x), y) + KD(f(x)[:, :known], f_old(x); T)``, the cross-entropy over every seen class and PyCIL's
  distillation (T = 2, weight 1) towards the model frozen after the previous task.
- Classifier: the nearest mean of exemplars (each class's mean of normalised exemplar features, normalised,
  recomputed with the current model after each task); ``classifier: linear`` evaluates the trained head instead.

The memory reuses the reservoir buffer's storage, draws, checkpoint and memory report (:class:`~clmerge.methods.rehearsal.ER`'s); only
the insertion differs (herding at the end of a task instead of reservoir sampling after each step).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from .base import grid_rate, register_method
from .lwf import frozen_copy, kd_loss
from .rehearsal import ER, ReplayOptions, replay_generator
from .reservoir import ReservoirBuffer

__all__ = ["ICaRL", "ICaRLOptions", "HerdingMemory", "herding_order", "NMEClassifier"]

EPSILON = 1e-8  # PyCIL's models/base.py


class ICaRLOptions(ReplayOptions):
    buffer_size: int = Field(2000, ge=1, description="exemplars in the fixed memory (the paper's and PyCIL's K: "
                                                     "2000)")
    minibatch_size: int | None = Field(None, ge=1, description="memory examples per step (None: in the proportion "
                                                               "of the memory to the task's training set, as if "
                                                               "appended to it, PyCIL's way)")
    temperature: float = Field(2.0, gt=0, description="distillation temperature T (PyCIL: 2)")
    kd_weight: float = Field(1.0, ge=0, description="distillation weight (PyCIL: 1, loss_clf + loss_kd)")
    loss: Literal["ce_kd", "bce"] = Field(
        "ce_kd", description="'ce_kd': PyCIL's cross-entropy plus softmax distillation; 'bce': the paper's sigmoid "
                             "binary cross-entropy, old classes' targets the previous model's sigmoids")
    classifier: Literal["nme", "linear"] = Field(
        "nme", description="'nme': nearest mean of exemplars (the paper's, PyCIL's NME); 'linear': the trained head")
    head_convention: Literal["grow"] = Field("grow", description="PyCIL's head grows per task (update_fc)")


def herding_order(vectors: torch.Tensor, m: int) -> list[int]:
    """PyCIL's herding (``models/base.py`` ``_construct_exemplar``): ``m`` rows of the normalised ``vectors``,
    each the one whose addition brings the mean of the chosen closest to the class mean."""
    mean = vectors.mean(0)
    left = list(range(len(vectors)))
    chosen: list[int] = []
    total = torch.zeros_like(mean)
    for k in range(1, min(m, len(vectors)) + 1):
        cand = vectors[left]
        i = int(torch.linalg.vector_norm(mean - (cand + total) / k, dim=1).argmin())
        chosen.append(left.pop(i))
        total = total + vectors[chosen[-1]]
    return chosen


def normalized(v: torch.Tensor) -> torch.Tensor:
    """Rows divided by their L2 norm plus PyCIL's epsilon."""
    return v / (torch.linalg.vector_norm(v, dim=1, keepdim=True) + EPSILON)


class HerdingMemory(ReservoirBuffer):
    """The reservoir buffer's storage, filled in order: every class's exemplars in herding order, classes in
    ascending label. ``keep(m)`` cuts each class to its first ``m``; ``append`` writes the next rows."""

    def append(self, **fields: torch.Tensor) -> None:
        n = len(next(iter(fields.values())))
        if self.n_seen + n > self.size:
            raise RuntimeError(f"herding memory: {self.n_seen} + {n} exemplars exceed its {self.size} slots")
        for name, value in fields.items():
            self._field(name, value)[self.n_seen: self.n_seen + n] = value.detach()
        self.n_seen += n

    def keep(self, m: int) -> None:
        old = {k: v[: len(self)] for k, v in self.fields.items()}
        self.fields, self.n_seen = {}, 0
        if not old:
            return
        for c in old["y"].unique().tolist():
            rows = (old["y"] == c).nonzero().flatten()[:m]
            if len(rows):
                self.append(**{k: v[rows.to(v.device)] for k, v in old.items()})


class NMEClassifier(nn.Module):
    """Images -> minus the squared distance of their normalised features to each class mean (PyCIL's
    ``_eval_nme``: the argmin of ``cdist(class_means, vectors, 'sqeuclidean')``)."""

    def __init__(self, model: nn.Module, means: torch.Tensor | None) -> None:
        super().__init__()
        self.model = model  # before the first task ends (no means yet) it predicts with its linear head
        self.register_buffer("means", None if means is None else means.float().clone(), persistent=False)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.forward_features(x)

    def forward_head(self, feats: torch.Tensor) -> torch.Tensor:
        v = normalized(feats.float())
        return -torch.cdist(v, self.means.to(v.device)).pow(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.means is None:
            return self.model(x)
        return self.forward_head(self.forward_features(x))


@register_method
class ICaRL(ER):  # ER's memory machinery (storage, draws, checkpoint, report); its own loss and filling
    name = "icarl"
    description = "iCaRL: herding exemplars, distillation to the previous model, nearest-mean-of-exemplars classifier"
    Options = ICaRLOptions
    optim_defaults, optim_source = grid_rate(3e-4, "Adam, split_mnist5k seed 0: validation CIL 76.50 at "
                                                   "3e-4 against 75.50, 64.75 at 1e-4, 1e-3")

    def __init__(self, options: ICaRLOptions, *, seed: int = 0) -> None:
        super().__init__(options, seed=seed)
        self.buffer = HerdingMemory(options.buffer_size)
        self.old: nn.Module | None = None
        self.means: torch.Tensor | None = None

    def loss(self, model, x, y, ctx) -> torch.Tensor:
        o = self.options
        if len(self.buffer) > 0:
            n = o.minibatch_size or max(1, round(len(x) * len(self.buffer) / max(1, len(ctx.task.train))))
            buf = self.buffer.sample(n, replay_generator(self.seed, self.step, 1))
            x, y = torch.cat([x, buf["x"].to(x.device)]), torch.cat([y, buf["y"].to(y.device)])
        logits = model(x)[:, : ctx.task.class_range[1]]
        old = None
        if self.old is not None:
            with torch.no_grad():
                old = self.old(x)
        if o.loss == "bce":  # the paper's Algorithm 3: every seen class a sigmoid, old ones towards f_old
            target = F.one_hot(y, logits.shape[1]).float()
            if old is not None:
                target[:, : old.shape[1]] = torch.sigmoid(old.float())
            return F.binary_cross_entropy_with_logits(logits.float(), target, reduction="sum") / len(x)
        loss = F.cross_entropy(logits, y)  # every seen class (PyCIL models/icarl.py line 160)
        if old is not None:
            loss = loss + o.kd_weight * kd_loss(logits[:, : old.shape[1]], old, o.temperature)
        return loss

    @torch.no_grad()
    def end_task(self, task, ctx) -> None:
        """PyCIL ``build_rehearsal_memory``: cut the old classes, herd the new ones, recompute every class
        mean with the trained model; then freeze the model as the previous one (``after_task``)."""
        model, o = self.model, self.options
        lo, hi = task.class_range
        m = o.buffer_size // hi
        was = model.training
        model.eval()
        device = next(model.parameters()).device
        self.buffer.keep(m)
        xs, ys, fs = [], [], []
        for x, y in task.train.batches(ctx.eval_batch_size):
            xs.append(x)
            ys.append(y)
            fs.append(normalized(model.forward_features(x.to(device)).float()).cpu())
        xs, ys, fs = torch.cat(xs), torch.cat(ys), torch.cat(fs)
        for c in range(lo, hi):
            rows = (ys == c).nonzero().flatten()
            pick = rows[herding_order(fs[rows], m)]
            if len(pick):
                self.buffer.to(device)
                self.buffer.append(x=xs[pick].to(device), y=ys[pick].to(device))
        self.means = self._class_means(hi, device, ctx.eval_batch_size)
        self.old = frozen_copy(model)
        model.train(was)
        super().end_task(task, ctx)

    def _class_means(self, n_classes: int, device, batch: int) -> torch.Tensor:
        """Each class's mean of normalised exemplar features, normalised (PyCIL models/base.py lines 209-214)."""
        f = self.buffer.fields
        n = len(self.buffer)
        feats = torch.cat([normalized(self.model.forward_features(f["x"][s: min(s + batch, n)].to(device)).float())
                           for s in range(0, n, batch)]) if n else torch.zeros(0, 1, device=device)
        labels = f["y"][:n].to(device) if n else torch.zeros(0, dtype=torch.long, device=device)
        means = torch.zeros(n_classes, feats.shape[1], device=device)
        for c in range(n_classes):
            sel = feats[labels == c]
            if len(sel):
                mu = sel.mean(0)
                means[c] = mu / torch.linalg.vector_norm(mu)
        return means

    def inference_model(self) -> nn.Module:
        if self.options.classifier == "nme":  # its own classifier: head.compare and the feature heads refused
            return NMEClassifier(self.model, self.means)
        return self.model

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = super().state_tensors()
        if self.means is not None:
            out["icarl/means"] = self.means
        if self.old is not None:
            out.update({f"old/{k}": v for k, v in self.old.state_dict().items()})
        return out

    def load_state(self, tensors, meta) -> None:
        super().load_state({k: v for k, v in tensors.items() if k.startswith("buffer/")}, meta)
        self.means = tensors["icarl/means"].clone() if "icarl/means" in tensors else None
        old = {k[len("old/"):]: v for k, v in tensors.items() if k.startswith("old/")}
        if old:
            self.old = frozen_copy(self.model)
            self.old.load_state_dict(old, strict=True)
