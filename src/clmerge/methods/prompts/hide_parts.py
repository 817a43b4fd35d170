"""HiDe-Prompt's parts: the task-specific prompt pool, the task-identity head and the contrastive regulariser.

HiDe-Prompt (Wang et al., NeurIPS 2023, "Hierarchical Decomposition of Prompt-Based Continual Learning:
Rethinking Obscured Sub-optimality"; official code thu-ml/HiDe-Prompt) decomposes the class-incremental
objective into within-task prediction (WTP), task-identity inference (TII) and task-adaptive prediction (TAP).
These are the pieces the method in :mod:`.hide_prompt` composes with the prompt mechanism
(:mod:`clmerge.adapters.prompt`) and the class statistics (:class:`clmerge.models.heads.ClassFeatureStats`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...adapters.prompt import PromptInput
from ...models.classifier import IncrementalHead
from ...utils.extras import require_extra
from .pools import PromptPool, uniform_tensor

__all__ = ["HiDePromptPool", "MultiCentroidStats", "TaskIdentityHead", "contrastive_regulariser"]


class HiDePromptPool(PromptPool):
    """One prefix prompt per task: ``e[l, k|v, t]`` (L, D) for every prefix layer l (the code's E-prompt with
    ``top_k=1``, prefix-tuning, separate key and value prefixes of L tokens each, U(-1, 1) init).

    Training on task t uses prompt t (the code's ``use_prompt_mask``), optionally mixed with the mean of the
    earlier prompts (``momentum``); evaluation uses the prompt of the task that ``chooser(q)`` infers (TII).
    """

    def __init__(self, dim: int, *, pool_size: int, length: int, layers: list[int], momentum: float,
                 init_from_previous: bool, generator: torch.Generator) -> None:
        super().__init__()
        self.layers, self.n_choices, self.length = list(layers), pool_size, length
        self.momentum, self.init_from_previous = momentum, init_from_previous
        self.e_prompts = nn.Parameter(uniform_tensor((len(layers), 2, pool_size, length, dim), -1.0, 1.0, generator))
        self.prefix_layers = sorted(set(layers))
        self.layer_options = {"layers": self.layers}
        self.chooser: Callable[[torch.Tensor], torch.Tensor] | None = None  # q (B, D) -> task ids (B,)

    def start_task(self, t: int, n_tasks: int, generator: torch.Generator) -> None:
        if n_tasks > self.n_choices:
            raise ValueError(f"method.pool_size: {self.n_choices} prompts for {n_tasks} tasks; set pool_size >= "
                             f"{n_tasks}")
        super().start_task(t, n_tasks, generator)
        if t > 0 and self.init_from_previous:  # code: shared_prompt_pool, prompt t starts as prompt t-1
            with torch.no_grad():
                self.e_prompts[:, :, t] = self.e_prompts[:, :, t - 1]

    def _mixed(self, t: int) -> torch.Tensor:
        """Prompt t as used while training t: (1 - m) e_t + m mean(e_<t) (code ``prompt_momentum``, old detached)."""
        own = self.e_prompts[:, :, t]  # (n, 2, L, D)
        if t == 0 or self.momentum == 0:
            return own
        return (1 - self.momentum) * own + self.momentum * self.e_prompts[:, :, :t].detach().mean(2)

    @torch.no_grad()
    def fold_momentum(self) -> None:
        """After training task t, store the mixed prompt (the code's end-of-task momentum update)."""
        t = int(self.task)
        if t > 0 and self.momentum > 0:
            self.e_prompts[:, :, t] = self._mixed(t)

    def prompts_for(self, ids: torch.Tensor) -> PromptInput:
        """Prefixes of the given per-sample task ids (B,)."""
        return PromptInput(prefixes={layer: (self.e_prompts[i, 0][ids], self.e_prompts[i, 1][ids])
                                     for i, layer in enumerate(self.layers)})  # (B, L, D) each

    def task_prompt(self, batch: int) -> PromptInput:
        """The current task's prompt as trained (with momentum), for a batch of ``batch`` samples."""
        mixed = self._mixed(int(self.task))
        return PromptInput(prefixes={layer: (mixed[i, 0].expand(batch, -1, -1), mixed[i, 1].expand(batch, -1, -1))
                                     for i, layer in enumerate(self.layers)})

    def choose(self, q: torch.Tensor) -> torch.Tensor:
        if self.chooser is None:
            raise RuntimeError("HiDe-Prompt: no task-identity inference attached to the pool")
        return self.chooser(q)

    def select(self, q: torch.Tensor) -> PromptInput:
        if self.training:
            self._count(torch.eye(self.n_choices, dtype=torch.float64)[int(self.task)] * q.shape[0])
            return self.task_prompt(q.shape[0])
        return self.prompts_for(self.choose(q))

    def usage(self, q: torch.Tensor) -> torch.Tensor:
        """TII's choice per sample, one-hot (B, pool_size)."""
        return F.one_hot(self.choose(q), self.n_choices).float()

    def task_hits(self, q: torch.Tensor, task: int, train_counts: list[float]) -> torch.Tensor:
        """Exact task-id accuracy of TII: the inferred task is the true one."""
        return self.choose(q) == task


class TaskIdentityHead(nn.Module):
    """TII's classifier on the frozen backbone's [CLS] feature: the code's ``MlpMapping`` (residual MLP
    ``LN(x + W2 GELU(W1 x))``, width ``hidden`` x D) followed by a linear layer over all seen classes.

    The predicted task is the task of the highest-scoring seen class (code; the paper's auxiliary output layer
    over the classes, whose task is the inferred identity). ``hidden=0``: a linear layer on the features.

    Args:
        dim: feature dimension D.
        hidden: width multiplier of the MLP's hidden layer (code ``original_model_mlp_structure=[2]``), 0: none.
    """

    def __init__(self, dim: int, hidden: int, generator: torch.Generator) -> None:
        super().__init__()
        self.hidden = hidden
        if hidden:
            self.fc1, self.fc2 = nn.Linear(dim, hidden * dim), nn.Linear(hidden * dim, dim)
            self.norm = nn.LayerNorm(dim)
            with torch.no_grad():  # timm's ViT init for Linear layers: trunc normal std .02, zero bias
                for fc in (self.fc1, self.fc2):
                    nn.init.trunc_normal_(fc.weight, std=0.02, a=-0.04, b=0.04, generator=generator)
                    fc.bias.zero_()
        self.classes = IncrementalHead(dim)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if not self.hidden:
            return x
        return self.norm(x + self.fc2(F.gelu(self.fc1(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classes(self.features(x))  # (B, seen classes)


def contrastive_regulariser(feats: torch.Tensor, prototypes: torch.Tensor, temperature: float,
                            rows: str = "all") -> torch.Tensor:
    """HiDe-Prompt's contrastive regularisation of WTP: the current task's prompted features are pushed away
    from each other and from the old classes' prototypes (means of the prompted features of old tasks).

    Transcribes the official ``orth_loss``: ``M = [prototypes; feats]`` (P + B, D), logits ``M M^T / tau`` and
    the cross-entropy of each row against its own index (the diagonal is the positive, every other prototype
    and feature a negative), averaged over all rows (``rows="all"``, code) or over the batch's rows only
    (``rows="batch"``: a sum over the current task's representations h, as the paper's L_CR is written).

    Args:
        feats: prompted [CLS] features of the batch (B, D).
        prototypes: old classes' prototypes (P, D); P may be 0 (first task).
        temperature: tau (code: 0.8).
        rows: ``all`` or ``batch``, the rows whose cross-entropy is averaged.
    """
    m = torch.cat([prototypes.to(feats.dtype), feats], dim=0)
    sim = m @ m.t() / temperature
    first = len(prototypes) if rows == "batch" else 0
    return F.cross_entropy(sim[first:], torch.arange(first, len(m), device=m.device))


class MultiCentroidStats:
    """The official code's storage-efficient class statistics (``ca_storage_efficient_method='multi-centroid'``):
    per class, k-means into ``n_centroids`` clusters, each kept as its mean and per-dimension variance.

    ``sample(c, n)`` draws ``n`` features from N(m_k, diag(v_k) + shrink I) for every cluster k of class c whose
    variance is not all zero (the code skips one-sample clusters; here only while another cluster remains), so it
    returns ``n x (clusters used)`` rows, as the code does. Same interface as
    :class:`~clmerge.models.heads.ClassFeatureStats` where :func:`~clmerge.models.heads.align_linear_head` and
    HiDe-Prompt use it.

    Args:
        dim: feature dimension D.
        n_centroids: clusters per class (code ``n_centroids`` 10); fewer when a class has fewer samples.
        seed: k-means seed (sklearn ``KMeans``, k-means++ init, 10 restarts as the sklearn of the code's time).
        shrink: added to the variances when sampling (code 1e-4).
    """

    def __init__(self, dim: int, n_centroids: int, seed: int, shrink: float = 1e-4) -> None:
        require_extra("sklearn.cluster", what="hide_prompt method.stats=multi_centroid (k-means)")
        self.dim, self.n_centroids, self.seed, self.shrink = dim, n_centroids, seed, shrink
        self.counts: dict[int, int] = {}
        self.tensors: dict[str, torch.Tensor] = {}  # "mean.{c}", "centroids.{c}" (k, D), "vars.{c}" (k, D)

    @property
    def classes(self) -> list[int]:
        return sorted(self.counts)

    def mean(self, c: int) -> torch.Tensor:
        return self.tensors[f"mean.{c}"]

    def centroids(self, c: int) -> torch.Tensor:
        return self.tensors[f"centroids.{c}"]

    def update(self, feats: torch.Tensor, labels: torch.Tensor) -> None:
        from sklearn.cluster import KMeans

        feats = feats.detach().double().cpu()
        for c in sorted(int(v) for v in labels.unique()):
            if c in self.counts:
                raise ValueError(f"class {c} was already seen: class statistics need each class in one task")
            x = feats[labels.cpu() == c]
            k = min(self.n_centroids, len(x))
            assign = KMeans(n_clusters=k, n_init=10, random_state=(self.seed * 7919 + c) % 2**31).fit(x.numpy())
            assign = torch.as_tensor(assign.labels_)
            groups = [x[assign == j] for j in range(k) if (assign == j).any()]
            self.counts[c] = len(x)
            self.tensors[f"mean.{c}"] = x.mean(0)
            self.tensors[f"centroids.{c}"] = torch.stack([g.mean(0) for g in groups])
            self.tensors[f"vars.{c}"] = torch.stack([g.var(0, unbiased=False) for g in groups])  # np.var

    def sample(self, c: int, n: int, generator: torch.Generator) -> torch.Tensor:
        means, var = self.centroids(c), self.tensors[f"vars.{c}"]
        used = var.mean(1) > 0
        if not bool(used.any()):
            used = torch.ones_like(used)
        means, std = means[used], (var[used] + self.shrink).sqrt()
        z = torch.randn(len(means), n, self.dim, generator=generator, dtype=torch.float64)
        return (means[:, None] + z * std[:, None]).reshape(-1, self.dim)

    def release_factors(self) -> None:
        """Nothing cached (diagonal covariances)."""

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        return dict(self.tensors), {"counts": {str(c): n for c, n in self.counts.items()}}

    def load(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self.tensors = {k: v.double() for k, v in tensors.items()}
        self.counts = {int(c): int(n) for c, n in meta["counts"].items()}
