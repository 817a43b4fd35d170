"""``fecam``: Goswami et al., "FeCAM: Exploiting the Heterogeneity of Class Distributions in Exemplar-Free
Continual Learning" (NeurIPS 2023).

The backbone is frozen after the first session (by default it is never trained: FeCAM's pretrained-ViT code,
``dipamgoswami/FeCAM`` ``FeCAM_vit_cifar100.py``, uses the pretrained ViT as it is). At the end of every task,
for each new class c, the mean μ_c and the covariance Σ_c (``np.cov``: unbiased) of its training features are
kept; Σ_c is shrunk and normalised, and a test feature x goes to the class of the smallest squared Mahalanobis
distance

    d_c(x) = (x - μ_c)^T  pinv(Σ'_c)  (x - μ_c)        (logits: -d_c)

The options name every step (defaults: FeCAM's ViT code):

- ``feature_norm``: ``before_stats`` (the ViT code: features L2-normalised before means, covariances and
  distances), ``at_distance`` (LAMDA-PILOT ``models/fecam.py``: statistics of the raw features, the feature and
  the mean L2-normalised only in the distance), ``none``;
- ``tukey_beta``: Tukey's ladder-of-powers transform x -> x^β (β = 0: log x) applied to every feature before
  anything else (the paper, Eq. 9, and its ResNet code, ``models/base.py`` ``_tukeys_transform``, β = 0.5). It
  needs non-negative features (a ResNet's after its ReLU); a ViT's features are signed, so the ViT code and
  PILOT leave it out, and so does the default (None). A negative feature with the transform on is refused;
- ``shrink``: ``fecam`` (Σ + α1 · mean(diag Σ) · I + α2 · mean(non-zero off-diagonal of Σ) · (1 - I), ``shrink_cov``
  of both FeCAM codes; α1 = 1, α2 = 0 in the ViT code, α2 = 1 in the ResNet exps) or ``identity`` (PILOT: Σ + 100 I);
- ``cov_norm``: ``correlation`` (Σ' / (σ σ^T), σ = sqrt(diag Σ'); FeCAM's ``normalize_cov``), ``corrcoef``
  (PILOT: ``torch.corrcoef`` of the shrunk covariance matrix, its rows taken as variables), ``none``;
- ``first_session_adapt``: PILOT tunes an adapter (``variant``, PETL options as APER and RanPAC) with its
  cosine head on the first task, then freezes the backbone; FeCAM's ViT code does not (default false).

PILOT's rule is ``feature_norm=at_distance shrink=identity cov_norm=corrcoef first_session_adapt=true``. The
ResNet code applies Tukey's transform only from the second task on (``self._cur_task > 0``); here the
transform, when on, applies from the first task. The classifier is this method's own head (its inference
model's), evaluated as ``head.classifier=linear``; the head suite's feature heads and ``head.compare`` are
refused (its inference model is not one backbone with a linear head); nothing is trained after the first
session.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from ..models.classifier import ContinualClassifier
from .base import register_method
from .first_session import PETLOptions, attach_petl
from .frozen_backbone import FirstSessionMethod
from ..utils.progress import phase

__all__ = ["FeCAM", "FeCAMHead", "FeCAMOptions", "shrink_covariance", "normalize_covariance", "tukey",
           "mahalanobis_sq"]


class FeCAMOptions(PETLOptions):
    feature_norm: Literal["before_stats", "at_distance", "none"] = Field(
        "before_stats", description="L2 normalisation of the features: before_stats (FeCAM's ViT code), "
        "at_distance (PILOT: feature and mean normalised in the distance only), none")
    tukey_beta: float | None = Field(None, ge=0, description="Tukey's transform x -> x^beta (0: log) before "
                                     "everything (paper and ResNet code: 0.5; needs non-negative features); "
                                     "None: off (FeCAM's ViT code, PILOT)")
    shrink: Literal["fecam", "identity", "none"] = Field(
        "fecam", description="covariance shrinkage: fecam (alpha1 * mean diag * I + alpha2 * mean off-diag * "
        "(1 - I)), identity (PILOT: + shrink_identity * I), none")
    alpha1: float = Field(1.0, ge=0, description="fecam shrinkage: weight of the mean variance (code: 1)")
    alpha2: float = Field(0.0, ge=0, description="fecam shrinkage: weight of the mean covariance (ViT code: 0; "
                          "ResNet exps: 1)")
    shrink_identity: float = Field(100.0, ge=0, description="identity shrinkage: Σ + this · I (PILOT alpha 100)")
    cov_norm: Literal["correlation", "corrcoef", "none"] = Field(
        "correlation", description="after shrinkage: correlation (Σ/(σσ^T), FeCAM), corrcoef (PILOT "
        "torch.corrcoef of the matrix), none")
    first_session_adapt: bool = Field(False, description="tune the PETL module (variant) on the first task with "
                                      "its cosine head, then freeze (PILOT: true; FeCAM's ViT code: false)")


def tukey(x: torch.Tensor, beta: float) -> torch.Tensor:
    """Tukey's ladder of powers: x^β, or log x at β = 0 (``_tukeys_transform``)."""
    if bool((x < 0).any()):
        raise ValueError(f"method.tukey_beta={beta}: Tukey's transform needs non-negative features and the "
                         f"backbone gave {float(x.min()):.4g}; set method.tukey_beta=null (FeCAM's ViT code)")
    return torch.log(x) if beta == 0 else torch.pow(x, beta)


def shrink_covariance(cov: torch.Tensor, alpha1: float, alpha2: float) -> torch.Tensor:
    """Σ + α1 · mean(diag Σ) · I + α2 · (mean of the non-zero off-diagonal entries) · (1 - I)."""
    eye = torch.eye(cov.shape[0], dtype=cov.dtype)
    off = cov * (1 - eye)
    nonzero = off != 0
    off_mean = off.sum() / nonzero.sum() if bool(nonzero.any()) else off.sum() * 0
    return cov + alpha1 * torch.diagonal(cov).mean() * eye + alpha2 * off_mean * (1 - eye)


def normalize_covariance(cov: torch.Tensor) -> torch.Tensor:
    """Σ / (σ σ^T) with σ = sqrt(diag Σ) (FeCAM's ``normalize_cov``)."""
    sd = torch.sqrt(torch.diagonal(cov))
    return cov / (sd[:, None] * sd[None, :])


def mahalanobis_sq(diff: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    """diag(diff P diff^T): the squared Mahalanobis distance of each row of ``diff``."""
    return ((diff @ precision) * diff).sum(-1)


class FeCAMHead(nn.Module):
    """-d_c(x) for every kept class c, from the class means and the pseudo-inverses of their matrices."""

    def __init__(self, means: torch.Tensor, precisions: torch.Tensor, options: FeCAMOptions) -> None:
        super().__init__()
        self.register_buffer("means", means, persistent=False)  # (C, d), float64
        self.register_buffer("precisions", precisions, persistent=False)  # (C, d, d), float64
        self.options = options

    def transform(self, feats: torch.Tensor) -> torch.Tensor:
        """What the statistics are computed on (Tukey, then the before_stats normalisation)."""
        x = feats.double()
        if self.options.tukey_beta is not None:
            x = tukey(x, self.options.tukey_beta)
        if self.options.feature_norm == "before_stats":
            x = F.normalize(x, p=2, dim=-1)
        return x

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        x = self.transform(feats)
        means, precs = self.means.to(x.device), self.precisions.to(x.device)
        if self.options.feature_norm == "at_distance":
            x, means = F.normalize(x, p=2, dim=-1), F.normalize(means, p=2, dim=-1)
        dists = torch.stack([mahalanobis_sq(x - means[c], precs[c]) for c in range(len(means))], dim=-1)
        return (-dists).to(feats.dtype)


class FeCAMClassifier(nn.Module):
    """The model's backbone followed by the FeCAM head (before the first statistics: the model's own head).

    Not a :class:`ContinualClassifier` on purpose: the head suite's feature heads and ``head.compare`` (which
    copies or reads a linear head) are refused for it with a config error, as for EASE and MOS."""

    def __init__(self, model: ContinualClassifier, head: FeCAMHead | None) -> None:
        super().__init__()
        self.model, self.head = model, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = self.model.forward_features(x)
        return self.model.forward_head(feats) if self.head is None else self.head(feats)


@torch.no_grad()
def _features(model: ContinualClassifier, data, *, batch_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Backbone features (float64, CPU) and labels of ``data`` in eval mode (PILOT: the train set, test mode)."""
    was = model.training
    model.eval()
    fs, ys = [], []
    try:
        for x, y in phase(data.batches(batch_size), "fecam: features", total=data.num_batches(batch_size)):
            fs.append(model.forward_features(x.to(device)).double().cpu())
            ys.append(y)
    finally:
        model.train(was)
    return torch.cat(fs), torch.cat(ys)


@register_method
class FeCAM(FirstSessionMethod):
    name = "fecam"
    description = ("FeCAM (Goswami et al. 2023): class means and shrunk, normalised covariances of frozen "
                   "features; Mahalanobis classifier; nothing trained after the first session")
    Options = FeCAMOptions
    # the evaluated head is this method's own (the Mahalanobis head of its inference model): the config's
    # head.classifier=linear selects it. The instance flag below tells the engine there is nothing to train
    # in a task without first-session adaptation.
    trains_linear_head: ClassVar[bool] = True
    optim_defaults: ClassVar[dict[str, Any]] = {"lr": 1e-2}
    optim_source = ("official code (PILOT exps/fecam.json: init_lr 0.01, SGD, the first-session adapter; used "
                    "only with method.first_session_adapt=true)")

    def __init__(self, options, *, seed: int = 0) -> None:
        super().__init__(options, seed=seed)
        self.trains_linear_head = False  # engine: no fit in a task without adaptation
        self.means = torch.zeros(0, 0, dtype=torch.float64)
        self.precisions = torch.zeros(0, 0, 0, dtype=torch.float64)
        self.n_classes = 0

    def _adapts(self) -> bool:
        return self.options.first_session_adapt

    def setup(self, model) -> None:
        super().setup(model)
        self._tuned = None
        if self._adapts():
            self._tuned = attach_petl(model.backbone, self.options, name="fecam",
                                      generator=torch.Generator().manual_seed(self.seed))
            self._tuned.requires_grad_(False)

    def _start_first_session(self, task, ctx) -> None:
        self._tuned.requires_grad_(True)

    def begin_task(self, task, ctx) -> None:
        if task.offset < self.n_classes:
            raise ValueError(f"scenario.kind: fecam needs new classes in every task (class- or task-incremental); "
                             f"task {task.index} reuses outputs from {task.offset}")
        super().begin_task(task, ctx)

    @torch.no_grad()
    def class_statistics(self, feats: torch.Tensor, labels: torch.Tensor, lo: int, hi: int):
        """Means (hi-lo, d) and precision matrices (hi-lo, d, d) of classes lo..hi-1, float64."""
        o = self.options
        head = FeCAMHead(self.means, self.precisions, o)
        x = head.transform(feats)
        means, precs = [], []
        for c in range(lo, hi):
            xc = x[labels == c]
            if len(xc) < 2:
                raise ValueError(f"fecam: class {c} has {len(xc)} training example(s); a covariance needs 2")
            cov = torch.cov(xc.T)
            if o.shrink == "fecam":
                cov = shrink_covariance(cov, o.alpha1, o.alpha2)
            elif o.shrink == "identity":
                cov = cov + o.shrink_identity * torch.eye(cov.shape[0], dtype=cov.dtype)
            if o.cov_norm == "correlation":
                cov = normalize_covariance(cov)
            elif o.cov_norm == "corrcoef":
                cov = torch.corrcoef(cov)
            means.append(xc.mean(0))
            precs.append(torch.linalg.pinv(cov))
        return torch.stack(means), torch.stack(precs)

    def end_task(self, task, ctx) -> None:
        super().end_task(task, ctx)
        feats, labels = _features(self.model, task.train, batch_size=ctx.eval_batch_size, device=ctx.device)
        lo, hi = task.class_range
        means, precs = self.class_statistics(feats, labels, lo, hi)
        d = means.shape[1]
        if self.n_classes == 0:
            self.means = torch.zeros(0, d, dtype=torch.float64)
            self.precisions = torch.zeros(0, d, d, dtype=torch.float64)
        self.means = torch.cat([self.means[:lo], means])
        self.precisions = torch.cat([self.precisions[:lo], precs])
        self.n_classes = hi
        self._build_inference()

    def _build_inference(self) -> None:
        head = FeCAMHead(self.means, self.precisions, self.options) if self.n_classes else None
        self._inference = FeCAMClassifier(self.model, head)

    def inference_model(self) -> nn.Module:
        if self._inference is None:
            self._build_inference()
        return self._inference

    def state_tensors(self) -> dict[str, torch.Tensor]:
        if not self.n_classes:
            return {}
        return {"means": self.means.contiguous(), "precisions": self.precisions.contiguous()}

    def state_meta(self) -> dict:
        return {**super().state_meta(), "n_classes": self.n_classes}

    def load_state(self, tensors, meta) -> None:
        super().load_state(tensors, meta)
        self.n_classes = int(meta.get("n_classes", 0))
        if self.n_classes:
            self.means = tensors["means"].double().cpu()
            self.precisions = tensors["precisions"].double().cpu()
            self._build_inference()
