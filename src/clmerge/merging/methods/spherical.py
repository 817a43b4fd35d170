"""Spherical merges of mergekit: SLERP (Shoemake 1985, as mergekit's ``slerp``), NuSLERP, Multi-SLERP and the
Karcher mean, tensor by tensor.

Each treats a tensor (or each of its rows) as a point on a hypersphere times a norm: the directions are
averaged on the sphere and the norms linearly. Arithmetic in float64; results are cast back to the inputs'
dtype by the driver.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ...errors import UsageError
from ...utils.device import like_device
from .driver import check_experts_weights, chunk_for, map_keys
from .registry import register_merge
from .sources import ModelSet, open_models

__all__ = ["slerp", "slerp_tensor", "DOT_THRESHOLD", "nuslerp", "nuslerp_tensor", "nuslerp_flat_key", "multislerp", "multislerp_tensor", "multislerp_key",
           "karcher", "karcher_tensor", "karcher_key", "gram64"]


# |cos| above this: the two tensors are treated as colinear and interpolated linearly (mergekit's value)
DOT_THRESHOLD = 0.9995
# a tensor whose norm is at most this has no direction: linear interpolation
NORM_EPS = 1e-8


def slerp_tensor(t: float, v0: Tensor, v1: Tensor, *, dot_threshold: float = DOT_THRESHOLD) -> Tensor:
    """Shoemake's slerp of two tensors, flattened, in float64 (mergekit: float32, same rule).

    ``cos(Omega) = <v0, v1> / (|v0| |v1|)`` (the angle of the normalised copies), and
    ``slerp = sin((1 - t) Omega) / sin(Omega) * v0 + sin(t Omega) / sin(Omega) * v1`` on the unnormalised
    vectors, so norms are interpolated too. Falls back to ``lerp = (1 - t) v0 + t v1`` when
    ``|cos(Omega)| > dot_threshold`` (nearly parallel or antiparallel: ``sin(Omega)`` near 0) or when either
    norm is at most ``1e-8``.
    """
    a, b = v0.double().reshape(1, -1), v1.double().reshape(1, -1)
    na, nb = a.norm(dim=1), b.norm(dim=1)
    has_dir = (na > NORM_EPS) & (nb > NORM_EPS)
    cos = torch.where(has_dir, (a * b).sum(1) / (na * nb).clamp(min=NORM_EPS), 2.0)
    linear = cos.abs() > dot_threshold
    omega = torch.acos(torch.where(linear, 0.0, cos.clamp(-1.0, 1.0)))
    sin = torch.sin(omega)
    ca = torch.where(linear, 1.0 - t, torch.sin((1.0 - t) * omega) / torch.where(linear, 1.0, sin))
    cb = torch.where(linear, t, torch.sin(t * omega) / torch.where(linear, 1.0, sin))
    return (ca[:, None] * a + cb[:, None] * b).reshape(v0.shape)


@register_merge("slerp", "spherical interpolation between two models, tensor by tensor (t=0: the first)",
                needs_base=False)
def slerp(*, base: Any = None, experts: Sequence[Any], t: float = 0.5,
          dot_threshold: float = DOT_THRESHOLD) -> dict[str, Tensor]:
    """SLERP (Shoemake 1985) of two models, per tensor: ``sin((1-t)Omega)/sin(Omega) v0 + sin(t Omega)/sin(Omega) v1``
    with ``Omega`` the angle between the flattened tensors (see :func:`slerp_tensor` for the exact rule).

    The endpoints are ``(base, experts[0])`` when a base is given (mergekit's ``base_model`` is ``t = 0``), else
    ``(experts[0], experts[1])``. Integer buffers are copied from the ``t = 0`` endpoint.

    Args:
        t: interpolation fraction in [0, 1]; 0 gives the first model, 1 the second.
        dot_threshold: above this ``|cos(Omega)|`` the tensors count as colinear and are interpolated linearly
            (0.9995, mergekit's ``DOT_THRESHOLD``).
    """
    if not 0.0 <= t <= 1.0:
        raise ValueError(f"t must be in [0, 1], got {t}")
    if not 0.0 <= dot_threshold <= 1.0:
        raise ValueError(f"dot_threshold must be in [0, 1], got {dot_threshold}")
    if isinstance(experts, ModelSet):  # the merge driver's inputs (``clmerge merge``): keep its keys and sink
        models, count = experts, experts.num_experts + (experts.base is not None)
    else:
        count = -1 if isinstance(experts, (str, dict)) else len(experts) + (base is not None)
        models = open_models(base, experts) if count == 2 else None
    if count != 2:
        raise UsageError("slerp needs exactly two models: base= and one expert, or two experts and no base")

    def kernel(key: str, b: Tensor | None, xs: list[Tensor]) -> Tensor:
        first, second = (b, xs[0]) if b is not None else (xs[0], xs[1])
        return slerp_tensor(t, first, second, dot_threshold=dot_threshold)

    return map_keys(models, kernel)


def _equal_or(weights: Tensor | None, n: int) -> Tensor:
    return torch.full((n,), 1.0 / n, dtype=torch.float64) if weights is None else weights


def nuslerp_tensor(t: float, v0: Tensor, v1: Tensor, *, row_wise: bool = False, flatten: bool = True,
                   eps: float = NORM_EPS) -> Tensor:
    """Slerp of ``v0`` and ``v1`` along vectors of the tensor (Shoemake 1985 on each vector):
    ``sin((1-t) Omega)/sin(Omega) a + sin(t Omega)/sin(Omega) b``, ``cos(Omega) = <a, b> / (|a| |b|)``.

    ``flatten``: one vector, the whole tensor. Otherwise the vectors run along the last dimension, or along
    the first with ``row_wise`` (mergekit's ``nuslerp_row_wise``: its vectors are the slices along dim 0).
    Linear interpolation ``(1-t) a + t b`` where ``|sin(Omega)| < eps`` (colinear) or either norm is at most
    ``eps`` (mergekit clamps such a norm instead, which makes the angle 90 degrees).
    """
    a, b = v0.double(), v1.double()
    if flatten or a.dim() == 0:
        a, b = a.reshape(1, -1), b.reshape(1, -1)
    elif row_wise:
        a, b = a.movedim(0, -1), b.movedim(0, -1)
    moved_shape = a.shape
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    na, nb = a.norm(dim=1, keepdim=True), b.norm(dim=1, keepdim=True)
    ca, cb = slerp_coefficients(t, na, nb, (a * b).sum(1, keepdim=True), eps)
    out = (ca * a + cb * b).reshape(moved_shape)
    if not flatten and row_wise and v0.dim() > 0:
        out = out.movedim(-1, 0)
    return out.reshape(v0.shape)


def slerp_coefficients(t: float, na: Tensor, nb: Tensor, dot: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The slerp weights ``(c_a, c_b)`` of vectors of norms ``na``, ``nb`` and inner product ``dot`` (see
    :func:`nuslerp_tensor`): the output is ``c_a a + c_b b``."""
    cos = (dot / (na * nb).clamp(min=eps)).clamp(-1.0, 1.0)
    omega = torch.acos(cos)
    sin = torch.sin(omega)
    linear = (sin.abs() < eps) | (na <= eps) | (nb <= eps)
    safe = torch.where(linear, 1.0, sin)
    ca = torch.where(linear, 1.0 - t, torch.sin((1.0 - t) * omega) / safe)
    cb = torch.where(linear, t, torch.sin(t * omega) / safe)
    return ca, cb


def flat_spans(x: Tensor) -> list[tuple[int, int]]:
    """``[i, j)`` spans of :func:`.driver.chunk_for` entries over ``x`` flattened: the blocks of a streamed
    kernel."""
    n, chunk = x.numel(), chunk_for(x)
    return [(i, min(i + chunk, n)) for i in range(0, n, chunk)]


def _block64(xs: Sequence[Tensor], b: Tensor | None, i: int, j: int) -> Tensor:
    """Entries ``[i, j)`` of the flattened inputs as float64 ``(T, j - i)``, minus the base's when given."""
    flat = torch.stack([x.reshape(-1)[i:j].double() for x in xs])
    return flat if b is None else flat - b.reshape(-1)[i:j].double()


def gram64(xs: Sequence[Tensor], b: Tensor | None = None) -> Tensor:
    """The Gram matrix ``G_ij = <x_i - b, x_j - b>`` ``(T, T)`` in float64, accumulated block by block (the
    inputs' norms are ``sqrt(diag G)``): one pass with temporaries of one block. The sums run in another order
    than a whole-tensor ``norm`` or dot product, so they agree with those to float64 rounding."""
    g = torch.zeros(len(xs), len(xs), dtype=torch.float64)
    for i, j in flat_spans(xs[0]):
        f = _block64(xs, b, i, j)
        g += f @ f.T
    return g


def _write_blocks(xs: Sequence[Tensor], b: Tensor | None, fn: Callable[[Tensor, int, int], Tensor]) -> Tensor:
    """The output of a streamed kernel in the experts' dtype: block ``[i, j)`` is ``fn(inputs' block, i, j)``
    (float64, see :func:`_block64`) plus the base's block when a base is given."""
    out = torch.empty(xs[0].shape, dtype=xs[0].dtype)
    for i, j in flat_spans(xs[0]):
        res = fn(_block64(xs, b, i, j), i, j)
        out.view(-1)[i:j] = res if b is None else b.reshape(-1)[i:j].double() + res
    return out


def nuslerp_flat_key(t: float, xs: Sequence[Tensor], b: Tensor | None, eps: float = NORM_EPS) -> Tensor:
    """:func:`nuslerp_tensor` with ``flatten`` (of the task vectors, with a base) streamed: the norms and the
    inner product from :func:`gram64`, then ``c_a a + c_b b`` block by block (the same arithmetic per entry;
    the reductions to float64 rounding). Returned in the experts' dtype."""
    g = gram64(xs, b)
    ca, cb = slerp_coefficients(t, g[0, 0].sqrt(), g[1, 1].sqrt(), g[0, 1], eps)
    return _write_blocks(xs, b, lambda f, i, j: ca * f[0] + cb * f[1])


def _two_experts(name: str, models: ModelSet) -> None:
    if models.num_experts != 2:
        raise UsageError(f"{name} needs exactly two experts (plus an optional base), got {models.num_experts}")


@register_merge("nuslerp", "slerp of two models, or of their task vectors when a base is given; per tensor or "
                "per row (mergekit's nuslerp)", needs_base=False)
def nuslerp(*, base: Any = None, experts: Sequence[Any], weights: Sequence[float] | None = None,
            row_wise: bool = False, flatten: bool = True) -> dict[str, Tensor]:
    """NuSLERP (mergekit ``nuslerp``): ``t = w_1 / (w_0 + w_1)`` (0.5 when ``|w_0 + w_1| < 1e-6``), then
    :func:`nuslerp_tensor` of the two experts; with a base, of their task vectors:
    ``theta_0 + slerp(t, theta_1 - theta_0, theta_2 - theta_0)``.

    Args:
        weights: ``(w_0, w_1)``, the relative weights of the two experts (mergekit's per-model ``weight``);
            ``None``: equal (``t = 0.5``).
        row_wise: interpolate the slices along the first dimension separately (mergekit's
            ``nuslerp_row_wise``); only with ``flatten=False``.
        flatten: interpolate each tensor as one vector (mergekit's ``nuslerp_flatten``, default true there
            too); ``False``: each vector along the last dimension (or the first, with ``row_wise``).
    """
    models = open_models(base, experts)
    _two_experts("nuslerp", models)
    w = _equal_or(check_experts_weights(weights, 2), 2)
    total = float(w.sum())
    t = 0.5 if abs(total) < 1e-6 else float(w[1]) / total

    def kernel(key: str, b: Tensor | None, xs: list[Tensor]) -> Tensor:
        if flatten or xs[0].dim() == 0:
            return nuslerp_flat_key(t, xs, b)
        if b is None:
            return nuslerp_tensor(t, xs[0], xs[1], row_wise=row_wise, flatten=flatten)
        b64 = b.double()
        return b64 + nuslerp_tensor(t, xs[0].double() - b64, xs[1].double() - b64, row_wise=row_wise,
                                    flatten=flatten)

    return map_keys(models, kernel)


def multislerp_tensor(xs: Sequence[Tensor], weights: Tensor, *, eps: float = NORM_EPS, key: str = "") -> Tensor:
    """Barycentric interpolation on the hypersphere, one tensor per input (C. Goddard's "Multi-SLERP" blog
    post, mergekit's reference).

    With ``u_i = x_i / (|x_i| + eps)`` and weights ``w_i``: ``m = sum_i w_i u_i``, ``m^ = m / |m|``; tangent
    vectors ``v_i = u_i - <u_i, m^> m^``, ``v = sum_i w_i v_i``; the exponential map at ``m^`` gives the
    direction ``cos|v| m^ + sin|v| v / |v|`` (``|v| + eps`` in both places, as mergekit), scaled by
    ``sum_i w_i |x_i|``. When ``|m| < eps``: two inputs are combined linearly, more are an error.
    """
    flat = torch.stack([x.double().reshape(-1) for x in xs])
    norms = flat.norm(dim=1)
    units = flat / (norms[:, None] + eps)
    mean = weights @ units
    mean_norm = float(mean.norm())
    if mean_norm < eps:
        if len(xs) == 2:
            return (weights @ flat).reshape(xs[0].shape)
        raise ValueError(f"multislerp: key {key!r}: the weighted mean of the directions is zero (opposite "
                         "inputs whose weights balance); change the weights")
    mean = mean / mean_norm
    tangent = weights @ (units - (units @ mean)[:, None] * mean)
    tn = float(tangent.norm()) + eps
    direction = mean * math.cos(tn) + tangent * (math.sin(tn) / tn)
    return (direction * float(weights @ norms)).reshape(xs[0].shape)


@register_merge("multislerp", "spherical barycentre of any number of models (or task vectors with a base), "
                "tensor by tensor (mergekit's multislerp)", needs_base=False)
def multislerp(*, base: Any = None, experts: Sequence[Any], weights: Sequence[float] | None = None,
               normalize_weights: bool = True, eps: float = 1e-8) -> dict[str, Tensor]:
    """Multi-SLERP (mergekit ``multislerp``): :func:`multislerp_tensor` of the experts, or with a base of their
    task vectors, ``theta_0 + multislerp(theta_t - theta_0)``. One expert is returned as it is.

    Args:
        weights: per-expert weights ``w_t`` (mergekit's per-model ``weight``); ``None``: equal.
        normalize_weights: divide the weights by their sum (mergekit's default, true).
        eps: the small constant of the normalisations (mergekit's ``eps``, 1e-8).
    """
    models = open_models(base, experts)
    w = _equal_or(check_experts_weights(weights, models.num_experts), models.num_experts)
    if normalize_weights:
        w = w / float(w.sum())

    def kernel(key: str, b: Tensor | None, xs: list[Tensor]) -> Tensor:
        if len(xs) == 1:
            return xs[0]
        wd = like_device(w, xs[0])  # the weights live on the CPU; a kernel on a device takes them there
        return multislerp_key(xs, b, wd, eps=eps, key=key)

    return map_keys(models, kernel)


def multislerp_key(xs: Sequence[Tensor], b: Tensor | None, weights: Tensor, *, eps: float = NORM_EPS,
                   key: str = "") -> Tensor:
    """:func:`multislerp_tensor` of the inputs (their task vectors, with a base ``b``; then ``b`` is added
    back) streamed in blocks, in the experts' dtype. The reductions come from :func:`gram64` (the norms, and
    with ``G~_ij = G_ij / ((|x_i| + eps)(|x_j| + eps))`` the inner products of the directions:
    ``|m|^2 = w^T G~ w`` and ``<u_i, m^> = (G~ w)_i / |m|``), then a pass sums ``|v|^2`` of the tangent and a
    last pass writes the output; per entry the arithmetic is :func:`multislerp_tensor`'s, the reductions
    agree to float64 rounding. (In exact arithmetic ``v = m - <m, m^> m^ = 0``: the computed ``v`` is rounding
    noise, and the exponential map leaves ``m^`` as it is.)"""
    g = gram64(xs, b)
    norms = g.diagonal().sqrt()
    d = norms + eps
    gu = g / (d[:, None] * d[None, :])
    mean_norm = max(float(weights @ gu @ weights), 0.0) ** 0.5
    if mean_norm < eps:
        if len(xs) == 2:
            return _write_blocks(xs, b, lambda f, i, j: weights @ f)
        raise ValueError(f"multislerp: key {key!r}: the weighted mean of the directions is zero (opposite "
                         "inputs whose weights balance); change the weights")
    c = (gu @ weights) / mean_norm

    def parts(f: Tensor) -> tuple[Tensor, Tensor]:
        units = f / d[:, None]
        mean = (weights @ units) / mean_norm
        return mean, weights @ (units - c[:, None] * mean)

    tn = sum(float(parts(_block64(xs, b, i, j))[1].square().sum()) for i, j in flat_spans(xs[0])) ** 0.5 + eps
    scale, cos_tn, sin_tn = float(weights @ norms), math.cos(tn), math.sin(tn) / tn

    def direction(f: Tensor, i: int, j: int) -> Tensor:
        mean, tangent = parts(f)
        return (mean * cos_tn + tangent * sin_tn) * scale

    return _write_blocks(xs, b, direction)


def karcher_tensor(xs: Sequence[Tensor], weights: Tensor, *, max_iter: int = 10, tol: float = 1e-5) -> Tensor:
    """The weighted Karcher (Riemannian) mean of the directions of ``xs`` on the unit sphere, times the
    weighted mean norm (Karcher 1977, "Riemannian center of mass and mollifier smoothing"; the fixed-point
    iteration of Buss & Fillmore 2001, "Spherical averages and applications to spherical splines and
    interpolation").

    Directions ``u_i = x_i / |x_i|`` of the inputs with ``|x_i| > tol``, weights renormalised over those;
    start at the normalised weighted mean of the ``u_i``; repeat at most ``max_iter`` times
    ``v = sum_i w_i theta_i / sin(theta_i) (u_i - cos(theta_i) m)`` (the log map, ``theta_i`` the angle from
    ``m``, terms with ``theta_i < tol`` skipped) and ``m <- cos|v| m + sin|v| v / |v|`` (the exponential map),
    stopping once ``|v| < tol``. The result is ``(sum_i w_i |x_i|) m``, over all inputs with the given weights.
    """
    flat = torch.stack([x.double().reshape(-1) for x in xs])
    norms = flat.norm(dim=1)
    valid = norms > tol
    if not bool(valid.any()):
        return torch.zeros(xs[0].shape, dtype=torch.float64)
    units = flat[valid] / norms[valid, None]
    alphas = weights[valid] / float(weights[valid].sum())
    mean = alphas @ units
    mean = units[0].clone() if float(mean.norm()) < tol else mean / mean.norm()
    for _ in range(max_iter):
        cos = (units @ mean).clamp(-1.0, 1.0)
        theta = torch.acos(cos)
        far = theta >= tol
        coef = torch.where(far, alphas * theta / torch.where(far, torch.sin(theta), 1.0), 0.0)
        tangent = coef @ (units - cos[:, None] * mean)
        tn = float(tangent.norm())
        if tn < tol:
            break
        mean = math.cos(tn) * mean + math.sin(tn) * tangent / tn
        mean = mean / mean.norm().clamp(min=tol)
    return (float(weights @ norms) * mean).reshape(xs[0].shape)


@register_merge("karcher", "Riemannian (Karcher) mean of the models' directions on the sphere times their "
                "mean norm, tensor by tensor (mergekit's karcher)", needs_base=False)
def karcher(*, base: Any = None, experts: Sequence[Any], weights: Sequence[float] | None = None,
            max_iter: int = 10, tol: float = 1e-5, include_base: bool = False) -> dict[str, Tensor]:
    """Karcher mean (mergekit ``karcher``): :func:`karcher_tensor` of the experts' tensors, and of the base's
    with ``include_base``. One input is returned as it is.

    Args:
        weights: per-expert weights ``w_t``, normalised to sum to 1; ``None``: equal (mergekit uses equal).
        max_iter: iterations of the fixed point (mergekit's ``max_iter``, 10).
        tol: convergence tolerance on the tangent norm, and the norm below which an input has no direction
            (mergekit's ``tol``, 1e-5).
        include_base: ``False`` (clmerge's default): a base, if given, is not used; ``True``: the base is one more
            point of the mean, with the experts' equal weight (mergekit's ``karcher`` with a ``base_model``:
            every input model, the base included, is a point; a mergekit config sets this). Needs a base and
            no ``weights``.
    """
    if max_iter < 0:
        raise ValueError(f"max_iter must be >= 0, got {max_iter}")
    models = open_models(base, experts)
    if include_base and models.base is None:
        raise ValueError("include_base: true needs a base (the base is one more point of the mean)")
    if include_base and weights is not None:
        raise ValueError("include_base: true takes equal weights (as mergekit); drop weights")
    n = models.num_experts + bool(include_base)
    w = _equal_or(check_experts_weights(weights, models.num_experts), n)
    w = w / float(w.sum())

    def kernel(key: str, b: Tensor | None, xs: list[Tensor]) -> Tensor:
        if include_base:
            xs = [b, *xs]  # mergekit: the base first among the gathered tensors
        return xs[0] if len(xs) == 1 else karcher_key(xs, like_device(w, xs[0]), max_iter=max_iter, tol=tol)

    return map_keys(models, kernel)


def karcher_key(xs: Sequence[Tensor], weights: Tensor, *, max_iter: int = 10, tol: float = 1e-5) -> Tensor:
    """:func:`karcher_tensor` streamed, in the experts' dtype. The mean stays in the span of the directions
    ``u_i``, so it is kept as coefficients ``m = sum_i beta_i u_i`` and every inner product of the iteration
    comes from the Gram matrix of the directions (:func:`gram64`, one pass over the inputs); a second pass
    writes ``(sum_i w_i |x_i|) sum_i beta_i x_i / |x_i|`` block by block. The same iteration as
    :func:`karcher_tensor`, with its inner products summed in another order: the results agree to float64
    rounding (unless ``|v|`` lands within rounding of ``tol`` at some step, when the two may stop one
    iteration apart)."""
    g = gram64(xs)
    norms = g.diagonal().sqrt()
    valid = norms > tol
    if not bool(valid.any()):
        return torch.zeros(xs[0].shape, dtype=xs[0].dtype)
    nv = norms[valid]
    gu = g[valid][:, valid] / (nv[:, None] * nv[None, :])
    alphas = weights[valid] / float(weights[valid].sum())
    beta = karcher_coefficients(gu, alphas, max_iter, tol)
    coef = float(weights @ norms) * beta / nv
    idx = valid.nonzero().squeeze(1).tolist()
    return _write_blocks([xs[i] for i in idx], None, lambda f, i, j: coef @ f)


def karcher_coefficients(gu: Tensor, alphas: Tensor, max_iter: int, tol: float) -> Tensor:
    """The fixed point of :func:`karcher_tensor` on ``m = sum_i beta_i u_i``, from the directions' Gram matrix
    ``gu``: ``<u_i, m> = (G beta)_i``, ``|sum_i c_i u_i|^2 = c^T G c``; returns ``beta``."""

    def norm(c: Tensor) -> float:
        return max(float(c @ gu @ c), 0.0) ** 0.5

    mean_norm = norm(alphas)
    beta = torch.zeros_like(alphas)
    if mean_norm < tol:
        beta[0] = 1.0
    else:
        beta = alphas / mean_norm
    for _ in range(max_iter):
        cos = (gu @ beta).clamp(-1.0, 1.0)
        theta = torch.acos(cos)
        far = theta >= tol
        coef = torch.where(far, alphas * theta / torch.where(far, torch.sin(theta), 1.0), 0.0)
        tangent = coef - float(coef @ cos) * beta
        tn = norm(tangent)
        if tn < tol:
            break
        beta = math.cos(tn) * beta + math.sin(tn) * tangent / tn
        beta = beta / max(norm(beta), tol)
    return beta
