"""Classifier heads on top of a continual backbone's features: class statistics, NCM, RanPAC, SLCA alignment.

All three read the backbone's features of each task's training data once, at the end of the task, and keep
only statistics (never images), so they are rehearsal-free:

- :class:`ClassFeatureStats`: per-class mean and covariance (float64), stored full, low-rank + diagonal, or
  diagonal. The class means feed :class:`NCMHead`; means and covariances feed :func:`align_linear_head`.
- :class:`NCMHead`: nearest class mean, cosine similarity by default (the prototype classifier of
  SimpleCIL / APER, Zhou et al. 2023, and PILOT's ``simplecil``).
- :class:`RanPACHead`: RanPAC (McDonnell et al., NeurIPS 2023, Sec. 4): a fixed random projection
  ``h = ReLU(f W_rand)``, ``W_rand ∈ R^{D×M}`` with N(0, 1) entries, accumulated Gram ``G = Σ h hᵀ`` and
  ``Q = Σ h yᵀ`` (Eq. 4), and the ridge classifier ``W_o = (G + λI)⁻¹ Q`` (Eq. 5); λ is chosen per task as
  the official code does, over ``10^-8 … 10^8`` by the MSE on the last 20% of the task's training features
  of a fit on the first 80%.
- :func:`align_linear_head`: classifier alignment of SLCA (Zhang et al., ICCV 2023, Sec. 3.3), as in
  InfLoRA's ``-ca`` variant: sample pseudo-features from N(μ_c, Σ_c) of every seen class, shuffle, and
  retrain the linear head on them with SGD, optionally with SLCA's per-task logit normalisation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .classifier import IncrementalHead
from ..utils.precision import full_precision

__all__ = ["ClassFeatureStats", "NCMHead", "RanPACHead", "align_linear_head", "ridge_floor",
           "ridge_grid_choice", "ridge_solve"]

RANPAC_RIDGES = [10.0**k for k in range(-8, 9)]


class ClassFeatureStats:
    """Per-class mean and covariance of backbone features, in float64.

    Args:
        dim: feature dimension D.
        cov: ``full`` (D×D per class), ``lowrank`` (top-``rank`` eigenpairs plus the residual diagonal, for a
            big D), ``diag`` (variances only) or ``none`` (means only, enough for NCM).
        rank: kept eigenpairs for ``cov="lowrank"``.
        shrink: added to the covariance's diagonal (SLCA adds 1e-4·I so that it is positive definite).
    """

    def __init__(self, dim: int, *, cov: str = "full", rank: int = 16, shrink: float = 1e-4) -> None:
        if cov not in ("full", "lowrank", "diag", "none"):
            raise ValueError(f"head.align_cov: unknown {cov!r} (full, lowrank, diag)")
        self.dim, self.cov, self.rank, self.shrink = dim, cov, rank, shrink
        self.counts: dict[int, int] = {}
        self.tensors: dict[str, torch.Tensor] = {}  # "mean.{c}", "cov.{c}" | "U.{c}", "s.{c}", "diag.{c}"
        self._cholesky: dict[int, torch.Tensor] = {}  # factors of the full covariances, kept while sampling

    @property
    def classes(self) -> list[int]:
        return sorted(self.counts)

    def mean(self, c: int) -> torch.Tensor:
        return self.tensors[f"mean.{c}"]

    @full_precision
    def update(self, feats: torch.Tensor, labels: torch.Tensor) -> None:
        """Add the statistics of every class in ``labels`` (each class is seen in one task only)."""
        feats = feats.detach().double().cpu()
        for c in sorted(int(v) for v in labels.unique()):
            if c in self.counts:
                raise ValueError(f"class {c} was already seen: head statistics need each class in one task")
            x = feats[labels.cpu() == c]
            self.counts[c] = len(x)
            self.tensors[f"mean.{c}"] = x.mean(0)
            if self.cov == "none":
                continue
            # unbiased covariance (torch.cov, as SLCA) plus the shrinkage; one sample -> shrinkage only
            cov = torch.cov(x.T) if len(x) > 1 else torch.zeros(self.dim, self.dim, dtype=torch.float64)
            cov = cov.reshape(self.dim, self.dim) + self.shrink * torch.eye(self.dim, dtype=torch.float64)
            if self.cov == "full":
                self.tensors[f"cov.{c}"] = cov
            elif self.cov == "diag":
                self.tensors[f"diag.{c}"] = cov.diagonal().clone()
            else:
                evals, evecs = torch.linalg.eigh(cov)
                k = min(self.rank, self.dim)
                U, s = evecs[:, -k:], evals[-k:].clamp_min(0)
                resid = (cov.diagonal() - (U**2 * s).sum(1)).clamp_min(self.shrink)
                self.tensors.update({f"U.{c}": U, f"s.{c}": s, f"diag.{c}": resid})

    def sample(self, c: int, n: int, generator: torch.Generator) -> torch.Tensor:
        """``n`` draws from N(μ_c, Σ_c) (float64), reparameterised so that ``generator`` alone decides them."""
        mu = self.mean(c)
        if self.cov == "full":
            z = torch.randn(n, self.dim, generator=generator, dtype=torch.float64)
            if c not in self._cholesky:  # a class's covariance never changes once stored
                self._cholesky[c] = torch.linalg.cholesky(self.tensors[f"cov.{c}"])
            return mu + z @ self._cholesky[c].T
        if self.cov == "diag":
            z = torch.randn(n, self.dim, generator=generator, dtype=torch.float64)
            return mu + z * self.tensors[f"diag.{c}"].sqrt()
        if self.cov == "lowrank":
            U, s, d = self.tensors[f"U.{c}"], self.tensors[f"s.{c}"], self.tensors[f"diag.{c}"]
            z1 = torch.randn(n, len(s), generator=generator, dtype=torch.float64)
            z2 = torch.randn(n, self.dim, generator=generator, dtype=torch.float64)
            return mu + (z1 * s.sqrt()) @ U.T + z2 * d.sqrt()
        raise ValueError("pseudo-features need class covariances (head.align_cov is none)")

    def release_factors(self) -> None:
        """Drop the Cholesky factors cached by :meth:`sample` (as large as the covariances themselves)."""
        self._cholesky = {}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        return dict(self.tensors), {"counts": {str(c): n for c, n in self.counts.items()}}

    def load(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self.tensors = {k: v.double() for k, v in tensors.items()}
        self._cholesky = {}
        self.counts = {int(c): int(n) for c, n in meta["counts"].items()}


class NCMHead:
    """Nearest class mean on backbone features.

    Args:
        stats: the class statistics holding the means.
        metric: ``cosine`` (logit = cos(f, μ_c), SimpleCIL/APER's prototype classifier) or ``euclidean``
            (logit = −‖f − μ_c‖²).
    """

    def __init__(self, stats: ClassFeatureStats, metric: str = "cosine") -> None:
        self.stats, self.metric = stats, metric

    def logits(self, feats: torch.Tensor, n_outputs: int) -> torch.Tensor:
        """(B, n_outputs) scores; classes without a mean get −inf."""
        out = torch.full((len(feats), n_outputs), -math.inf, dtype=feats.dtype, device=feats.device)
        classes = [c for c in self.stats.classes if c < n_outputs]
        if not classes:
            return out
        means = torch.stack([self.stats.mean(c) for c in classes]).to(feats.device, feats.dtype)
        if self.metric == "cosine":
            scores = F.normalize(feats, dim=-1) @ F.normalize(means, dim=-1).T
        else:
            scores = -torch.cdist(feats, means) ** 2
        out[:, classes] = scores
        return out


def ridge_grid_choice(H: torch.Tensor, Y: torch.Tensor, ridges: list[float] = RANPAC_RIDGES) -> float:
    """RanPAC's λ: fit ``(H₁ᵀH₁ + λI)⁻¹H₁ᵀY₁`` on the first 80% of rows, pick the λ of least MSE on the rest.

    Uses the SVD of H₁, which gives the same ridge solutions as the M×M solve for every λ > 0 at the cost of
    one thin SVD (the official code solves the M×M system once per λ).

    Args:
        H: (n, M) projected features of the task's training data, float64, rows in a random order.
        Y: (n, C) one-hot targets.
        ridges: the grid (RanPAC: 10^-8 … 10^8).
    """
    n_fit = int(len(H) * 0.8)
    if n_fit < 1 or n_fit == len(H):
        return 1.0
    U, s, Vh = torch.linalg.svd(H[:n_fit], full_matrices=False)
    UtY = U.T @ Y[:n_fit]
    losses = []
    for lam in ridges:
        W = Vh.T @ ((s / (s**2 + lam))[:, None] * UtY)  # (M, C)
        losses.append(float(((H[n_fit:] @ W - Y[n_fit:]) ** 2).mean()))
    return ridges[min(range(len(ridges)), key=losses.__getitem__)]


RIDGE_FLOOR = 1e-12  # relative to trace(G): below it the float64 solve of a rank-deficient G has no correct digit


def ridge_floor(G: torch.Tensor) -> float:
    """The smallest λ :func:`ridge_solve` uses: ``1e-12 · trace(G)``. With fewer training rows than M (G
    rank-deficient) a λ far below G's largest eigenvalue makes ``G + λI`` numerically singular: at λ = 1e-8 and
    a largest eigenvalue of 1e9 its condition number is 1e17, and the solve returns a W_o 64x too large that
    classifies 43% of a toy problem where the exact ridge solution (the SVD form that :func:`ridge_grid_choice`
    scores) classifies 100%. Above the floor the condition number is at most 1e12 (trace(G) bounds the largest
    eigenvalue) and the solution agrees with the exact one."""
    return float(G.diagonal().sum()) * RIDGE_FLOOR


def ridge_solve(G: torch.Tensor, Q: torch.Tensor, lam: float) -> torch.Tensor:
    """``(G + λI)⁻¹ Q`` for a Gram matrix G (RanPAC Eq. 5), by Cholesky: G + λI is symmetric positive definite
    for λ > 0, so this is the official code's ``torch.linalg.solve`` (an LU) at half its flops. λ is raised to
    :func:`ridge_floor` where it is below it (a numerical guard; the official setting, more training rows than
    M, never reaches it). Memory: G's shifted copy and its factor, two more M×M float64 matrices (1.6 GB at
    M = 10000)."""
    lam = max(lam, ridge_floor(G))
    A = G.clone()
    A.diagonal().add_(lam)
    L, info = torch.linalg.cholesky_ex(A)
    if int(info) != 0:  # not positive definite in floating point (tiny λ, rank-deficient G): LU, as official
        return torch.linalg.solve(G + lam * torch.eye(len(G), dtype=G.dtype), Q)
    del A
    return torch.cholesky_solve(Q, L)


class RanPACHead:
    """RanPAC's random-projection ridge classifier (Eqs. 4-5 of McDonnell et al. 2023).

    Args:
        in_dim: backbone feature dimension D.
        proj_dim: M, the random projection's width (``head.ranpac_dim``, 10000 as the official ``M``). G is
            M×M float64 (800 MB at 10000) and is checkpointed; the time of one task's update (G += HᵀH, λ's
            selection, the Cholesky solve) is in benchmarks/lora_cl/results_ranpac_aper.md.
        seed: seed of ``W_rand`` (it is regenerated from the seed, never stored).
    """

    def __init__(self, in_dim: int, proj_dim: int, seed: int) -> None:
        self.in_dim, self.proj_dim, self.seed = in_dim, proj_dim, seed
        self.W_rand = torch.randn(in_dim, proj_dim, generator=torch.Generator().manual_seed(seed))
        self.G = torch.zeros(proj_dim, proj_dim, dtype=torch.float64)
        self.Q = torch.zeros(proj_dim, 0, dtype=torch.float64)
        self.W_o: torch.Tensor | None = None  # (M, C) float64
        self.ridges: list[float] = []

    def project(self, feats: torch.Tensor) -> torch.Tensor:
        """h = ReLU(f W_rand) (RanPAC Sec. 4.2)."""
        return torch.relu(feats.float() @ self.W_rand.to(feats.device))

    @full_precision
    def update(self, feats: torch.Tensor, labels: torch.Tensor, n_classes: int, generator: torch.Generator) -> None:
        """Accumulate G, Q from one task's features (Eq. 4), choose λ, re-solve W_o (Eq. 5)."""
        order = torch.randperm(len(feats), generator=generator)  # the official loader shuffles
        H = self.project(feats.cpu()).double()[order]
        Y = F.one_hot(labels.cpu()[order].long(), n_classes).double()
        if self.Q.shape[1] < n_classes:
            self.Q = torch.cat([self.Q, torch.zeros(self.proj_dim, n_classes - self.Q.shape[1],
                                                    dtype=torch.float64)], 1)
        self.G += H.T @ H
        self.Q += H.T @ Y
        lam = ridge_grid_choice(H, Y)
        self.ridges.append(max(lam, ridge_floor(self.G)))  # the λ the solve uses
        self.W_o = ridge_solve(self.G, self.Q, lam)

    def logits(self, feats: torch.Tensor, n_outputs: int) -> torch.Tensor:
        if self.W_o is None:
            raise RuntimeError("RanPAC head used before any task was fitted")
        W = self.W_o[:, :n_outputs].to(feats.device, torch.float32)
        out = self.project(feats) @ W
        if out.shape[1] < n_outputs:
            pad = torch.full((len(out), n_outputs - out.shape[1]), -math.inf, device=out.device)
            out = torch.cat([out, pad], 1)
        return out

    def nbytes(self) -> int:
        w = 0 if self.W_o is None else self.W_o.numel() * 8
        return (self.G.numel() + self.Q.numel()) * 8 + w  # W_rand is regenerated from the seed

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        tensors = {"G": self.G, "Q": self.Q}
        if self.W_o is not None:
            tensors["W_o"] = self.W_o
        return tensors, {"seed": self.seed, "proj_dim": self.proj_dim, "ridges": self.ridges}

    def load(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        if int(meta["seed"]) != self.seed or int(meta["proj_dim"]) != self.proj_dim:
            raise ValueError("checkpoint's RanPAC projection differs from the config's")
        self.G, self.Q, self.W_o = tensors["G"].double(), tensors["Q"].double(), tensors.get("W_o")
        self.ridges = list(meta["ridges"])


def _normalised_logits(logits: torch.Tensor, ranges: list[tuple[int, int]], temperature: float) -> torch.Tensor:
    """SLCA's logit normalisation: divide by the mean over tasks of each task block's L2 norm, then by τ."""
    norms = torch.cat([logits[:, lo:hi].norm(dim=-1, keepdim=True) + 1e-7 for lo, hi in ranges], -1)
    return logits / norms.mean(-1, keepdim=True) / temperature


def align_linear_head(head: IncrementalHead, stats: ClassFeatureStats, ranges: list[tuple[int, int]], *,
                      epochs: int = 5, lr: float = 0.01, samples_per_class: int = 256, weight_decay: float = 5e-4,
                      logit_norm: float | None = 0.1, mean_decay: bool = True,
                      generator: torch.Generator) -> list[float]:
    """SLCA classifier alignment: retrain ``head`` on pseudo-features of every seen class (in place).

    Per epoch, draw ``samples_per_class`` features from N(μ_c, Σ_c) for each class c (``stats.sample`` may
    return more rows, e.g. that many per centroid of a multi-centroid store), shuffle them, and take
    one SGD step (momentum 0.9, cosine schedule over the epochs) per batch of ``samples_per_class``, on the
    cross-entropy over all seen classes (optionally of SLCA's normalised logits).

    Args:
        head: the linear head to retrain (only its parameters change).
        stats: class means and covariances of every seen class.
        ranges: the seen tasks' class ranges ``[lo, hi)``, in task order.
        epochs, lr, samples_per_class, weight_decay: SLCA's ``ca_epochs`` 5, learning rate 0.01 (SLCA's
            ``lrate`` and InfLoRA-CA's hard-coded value), 256, 5e-4.
        logit_norm: temperature τ of the logit normalisation (SLCA 0.1), or None for plain logits.
        mean_decay: SLCA's sampling mean ``μ_c · (0.9 + 0.1 (t_c + 1) / (t + 1))``, which shrinks older tasks'
            means (t_c: the class's task, t: the current task).
        generator: the RNG of the draws and the shuffles.

    Returns:
        the mean loss of each epoch.
    """
    n_seen = ranges[-1][1]
    task_of = {c: i for i, (lo, hi) in enumerate(ranges) for c in range(lo, hi)}
    classes = [c for c in range(n_seen) if c in stats.counts]
    params = [p for p in head.parameters()]
    ref = params[0]
    was_grad = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
    losses = []
    for _ in range(epochs):
        xs, ys = [], []
        for c in classes:
            scale = 0.9 + 0.1 * (task_of[c] + 1) / len(ranges) if mean_decay else 1.0
            draw = stats.sample(c, samples_per_class, generator)
            xs.append(draw + (scale - 1.0) * stats.mean(c))
            ys.append(torch.full((len(draw),), c, dtype=torch.long))  # a multi-centroid store draws per centroid
        perm = torch.randperm(sum(len(v) for v in ys), generator=generator)
        x = torch.cat(xs)[perm].to(ref.device, ref.dtype)
        y = torch.cat(ys)[perm].to(ref.device)
        total = 0.0
        for i in range(0, len(x), samples_per_class):
            logits = head(x[i:i + samples_per_class])[:, :n_seen]
            if logit_norm is not None:
                logits = _normalised_logits(logits, ranges, logit_norm)
            loss = F.cross_entropy(logits, y[i:i + samples_per_class])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(logits)
        sched.step()
        losses.append(total / len(x))
    for p, g in zip(params, was_grad):
        p.requires_grad_(g)
        p.grad = None
    stats.release_factors()  # one factorisation per class and alignment, not one per epoch
    return losses
