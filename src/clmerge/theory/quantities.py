"""The measurable terms of the bound (Li, Tang et al., arXiv:2601.21690, Theorem 3).

* ``sigma_i^2``: per-sample gradient variance of task ``i`` at the base (Assumption 2, with ``b_i = 1``):
  ``(1/m) sum_j ||g_ij - g_i||^2`` over ``m`` samples, ``g_i`` their mean gradient.
* ``zeta_i^2``: heterogeneity (Assumption 3): ``||g_i - (1/N) sum_k g_k||^2`` at the base.
* operational heterogeneity of task vectors (Proof of Corollary 1, Eq. 10):
  ``H(M) = sum_i lambda_i ||M(tau_i) - sum_k lambda_k M(tau_k)||^2`` with ``lambda_i = 1/N``, before
  (``M = id``) and after the TIES or DARE operator.
* L2 stability (Definition 2): ``||A(D) - A(D^(i))||^2`` for two fine-tunings that differ in one sample.
* implicit weights (Eq. 14): the ``lambda_i`` of an average of experts trained for ``K_i`` steps, measured by
  regressing the averaged task vector on reference task vectors trained for a common ``K``.

Gradients and task vectors cover the merged (backbone) parameters only; task heads are never merged.
Reductions run in float64.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor, nn

from ..merging.methods.dare import dare_generator
from ..merging.methods.dare import dare_tensor
from ..merging.methods.ties import magnitude_threshold
from ..params.fisher import per_sample_grads

__all__ = ["gradient_stats", "heterogeneity", "dispersion", "ties_operator", "dare_operator", "squared_distance",
           "implicit_weights", "displacement_share", "predicted_weights", "task_vectors"]

Params = dict[str, Tensor]


def _float_keys(p: Params) -> list[str]:
    # sorted: dicts decoded from safetensors come back in no fixed order, and float sums depend on it
    return sorted(k for k, v in p.items() if v.is_floating_point())


def task_vectors(base: Params, experts: Sequence[Params]) -> list[Params]:
    """``tau_i = x_i - x_0`` per floating key, float64."""
    keys = _float_keys(base)
    return [{k: e[k].double() - base[k].double() for k in keys} for e in experts]


def gradient_stats(backbone: nn.Module, head: nn.Module, x: Tensor, y: Tensor,
                   chunk: int = 32) -> tuple[Params, float]:
    """``(mean gradient g_i, sigma_i^2)`` of the per-sample cross-entropy over the backbone's parameters.

    ``sigma_i^2 = (1/m) sum_j ||g_ij - g_i||^2`` (the trace of the per-sample gradient covariance; the
    paper's ``sigma_i^2`` of Assumption 2 at batch size 1), from ``per_sample_grads`` (vectorised; looped for
    token-id inputs).
    """
    model = nn.Sequential(backbone, head)
    model.eval()
    names = [f"0.{n}" for n, p in backbone.named_parameters() if p.requires_grad]
    sums: Params = {}
    sq = 0.0
    for i in range(0, len(x), chunk):
        g = per_sample_grads(model, names, x[i:i + chunk], y[i:i + chunk])
        for n in names:
            gd = g[n].double()
            sums[n] = gd.sum(0) + sums.get(n, 0.0)
            sq += float(gd.pow(2).sum())
    m = len(x)
    mean = {n[2:]: s / m for n, s in sums.items()}
    # E||g_j - g||^2 = E||g_j||^2 - ||g||^2
    sigma2 = sq / m - sum(float(v.pow(2).sum()) for v in mean.values())
    return mean, max(sigma2, 0.0)


def heterogeneity(mean_grads: Sequence[Params]) -> list[float]:
    """``zeta_i^2 = ||grad f_i - grad f||^2`` with ``grad f = (1/N) sum_k grad f_k`` (Assumption 3, Eq. 1)."""
    keys = list(mean_grads[0])
    avg = {k: torch.stack([g[k] for g in mean_grads]).mean(0) for k in keys}
    return [sum(float((g[k] - avg[k]).pow(2).sum()) for k in keys) for g in mean_grads]


def dispersion(tvs: Sequence[Params], weights: Sequence[float] | None = None) -> float:
    """``sum_i lambda_i ||v_i - sum_k lambda_k v_k||^2`` (a measurable proxy for ``sum_i lambda_i zeta_i^2``)."""
    n = len(tvs)
    lam = np.full(n, 1.0 / n) if weights is None else np.asarray(weights, dtype=float)
    total = 0.0
    for k in tvs[0]:
        stack = torch.stack([v[k] for v in tvs])  # (N, *shape)
        w = torch.as_tensor(lam, dtype=stack.dtype).reshape(-1, *([1] * (stack.dim() - 1)))
        mean = (w * stack).sum(0)
        total += float((w * (stack - mean).pow(2)).sum())
    return total


def ties_operator(tvs: Sequence[Params], density: float) -> list[Params]:
    """TIES's mask ``M(tau_i) = m_i * tau_i``: the global top-``density`` trim of each task vector, then only
    the entries whose sign agrees with the elected sign ``sgn(sum_i tau_hat_i)`` (Corollary 1's operator)."""
    keys = list(tvs[0])
    thr = [magnitude_threshold(torch.cat([v[k].abs().reshape(-1) for k in keys]), density) for v in tvs]
    out: list[Params] = [{} for _ in tvs]
    for k in keys:
        trimmed = torch.stack([torch.where(v[k].abs() >= t, v[k], torch.zeros_like(v[k])) for v, t in zip(tvs, thr)])
        sign = torch.sign(trimmed.sum(0))
        sign = torch.where(sign == 0, torch.sign(sign.sum()), sign)
        agree = torch.where(sign > 0, trimmed > 0, trimmed < 0)
        for i in range(len(tvs)):
            out[i][k] = trimmed[i] * agree[i]
    return out


def dare_operator(tvs: Sequence[Params], drop_rate: float, *, rescale: bool = True, seed: int = 0) -> list[Params]:
    """DARE's ``M(tau_i) = m_i * tau_i / (1 - p)`` with the same masks as ``merging.dare`` (seed, key, expert).

    The paper's Corollary 1 ignores the ``1/(1-p)`` rescaling; with ``rescale=True`` the kept
    entries grow, so the dispersion need not fall.
    """
    return [{k: dare_tensor(v[k].float(), drop_rate, rescale=rescale, generator=dare_generator(seed, k, i)).double()
             for k in v} for i, v in enumerate(tvs)]


def squared_distance(a: Params, b: Params) -> float:
    """``||a - b||_2^2`` over the floating keys (float64): the L2-stability of Definition 2 for one pair."""
    return sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in _float_keys(a))


def implicit_weights(avg_tv: Params, ref_tvs: Sequence[Params]) -> list[float]:
    """Measured ``lambda_i`` of Eq. (14): least squares ``avg_tv ~ sum_i w_i ref_i``, normalised to sum 1.

    ``ref_i`` is task ``i``'s task vector after a common number of steps, a proxy for its normalised
    direction ``d_i``; the paper predicts ``w_i ∝ K_i``.
    """
    keys = list(avg_tv)
    a = torch.stack([torch.cat([r[k].reshape(-1) for k in keys]) for r in ref_tvs], 1).double()  # (d, N)
    b = torch.cat([avg_tv[k].reshape(-1) for k in keys]).double()
    w = torch.linalg.lstsq(a, b.unsqueeze(1)).solution.squeeze(1).numpy()
    return (w / w.sum()).tolist()


def displacement_share(tvs: Sequence[Params]) -> list[float]:
    """``||tau_i|| / sum_j ||tau_j||``: each expert's share of the total displacement. Under Eq. (14) with
    normalised directions of equal length (``tau_i = -eta K_i d_i``) this is ``K_i / sum_j K_j`` too."""
    norms = np.array([np.sqrt(sum(float(v[k].pow(2).sum()) for k in v)) for v in tvs])
    return (norms / norms.sum()).tolist()


def predicted_weights(steps: Sequence[int]) -> list[float]:
    """Eq. (14) for plain SGD: ``lambda_i = K_i / sum_j K_j``."""
    k = np.asarray(steps, dtype=float)
    return (k / k.sum()).tolist()
