"""Low-rank factors from dense updates (truncated SVD) and atomic writing of adapter folders.

Eckart-Young: the best rank-``k`` approximation of ``Delta W = U S V^T`` in Frobenius norm keeps the ``k``
largest singular values, and its error is the tail's energy,

    ||Delta W - B' A'||_F / ||Delta W||_F = sqrt(sum_{i>k} s_i^2) / sqrt(sum_i s_i^2),

which is what is reported. The factors split the singular values evenly: ``B' = U_k sqrt(S_k)``,
``A' = sqrt(S_k) V_k^T`` (so ``B' A' = U_k S_k V_k^T``; PEFT scale 1 with ``lora_alpha = r``).

A full SVD of a 4096 x 4096 matrix takes about a minute on one core, so large matrices with ``k`` well below
their size use the randomized range finder with subspace iteration (Halko, Martinsson & Tropp 2011, Alg. 4.4
then Alg. 5.1, :func:`clmerge.utils.linalg.randomized_svd`): ``Q = orth((Delta W Delta W^T)^q Delta W
Omega)`` with ``k + p`` columns, then the exact SVD of ``Q^T Delta W``. Its error is measured directly
(``||Delta W - B' A'||_F``), not taken from singular values; on the test matrices it is within 0.5 % of the
optimum.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from ...errors import UsageError
from ...utils.device import current_device
from ...utils.outpaths import check_output_dir
from ...utils.linalg import randomized_svd

__all__ = ["low_rank_factors", "device_low_rank_factors", "LowRank", "SVD_MODES", "check_svd", "numerical_rank",
           "check_out_dir", "error_summary", "rank_pattern", "clamped_note", "rank_for_error", "rank_loss",
           "LOSS_WARN", "KEEP_ERROR"]

#: a write-back whose relative Frobenius error exceeds this in some module gets a warning ...
LOSS_WARN = 0.10
#: ... that names the rank at which every module's error is at most this (it keeps 99 % of each Delta W)
KEEP_ERROR = 0.01

SVD_MODES = ("auto", "full", "randomized")
# Above this many entries the full SVD runs in float32 (float64 doubles its time on LLM-sized matrices);
# the reported error then carries float32 rounding (~1e-7 relative).
_FLOAT64_SVD_MAX = 1 << 22
# "auto" uses the randomized SVD from this matrix side up, when k + p is at most a quarter of it.
_RANDOMIZED_MIN_SIDE = 1024
_POWER_ITERATIONS = 4


class LowRank(NamedTuple):
    """``A'`` (k, in) and ``B'`` (out, k), float32; squared Frobenius norms of the residual and of the input;
    every singular value (float64, on the CPU) when the SVD was the full one, else ``None``."""

    a: Tensor
    b: Tensor
    tail: float
    total: float
    svd: str
    spectrum: Tensor | None = None


def check_svd(svd: str) -> None:
    if svd not in SVD_MODES:
        raise UsageError(f"--svd {svd!r}: expected one of {', '.join(SVD_MODES)}")


def _oversample(k: int) -> int:
    """The sketch's extra columns here: ``max(10, k // 2)`` (more than the SVD merges' 10 for large ranks)."""
    return max(10, k // 2)


def _oversampled(k: int, m: int, n: int) -> int:
    return min(k + _oversample(k), m, n)


def low_rank_factors(delta: Tensor, rank: int, svd: str = "auto") -> LowRank:
    """Truncated SVD of ``delta`` (out, in) at ``rank``.

    Args:
        delta: the dense update (2-D).
        rank: ``k``; clamped to ``min(out, in)`` (exact there): the factors have ``min(k, out, in)``
            rows/columns, never zero padding (a rank above the matrix's sides only adds zeros to the file).
        svd: ``"full"`` (exact optimum), ``"randomized"``, or ``"auto"`` (randomized for sides of at least
            1024 when ``k`` plus oversampling is at most a quarter of the smaller side).

    Returns:
        :class:`LowRank` with ``B' A'`` the (near-)best rank-``k`` approximation; ``tail`` is the squared
        residual (tail singular values for a full SVD, measured for a randomized one) and ``total`` the
        squared norm of ``delta``.
    """
    check_svd(svd)
    m, n = delta.shape
    k = min(rank, m, n)
    small = min(m, n) < _RANDOMIZED_MIN_SIDE or 4 * _oversampled(k, m, n) > min(m, n)
    used = "full" if svd == "full" or (svd == "auto" and small) else "randomized"
    dt = torch.float64 if delta.numel() <= _FLOAT64_SVD_MAX else torch.float32
    x = delta.to(dt)
    if used == "full":
        u, s, vh = torch.linalg.svd(x, full_matrices=False)
        u, vh = u[:, :k], vh[:k]
    else:
        # seeded (0): the same factors for the same input
        u, s, vh = randomized_svd(x, k, oversample=_oversample(k), power_iters=_POWER_ITERATIONS, seed=0,
                                  slice_first=True)
    root = s[:k].sqrt()
    b = (u[:, :k] * root).float()
    a = (root[:, None] * vh[:k]).float()
    total = float(x.double().square().sum()) if used == "randomized" else float(s.double().square().sum())
    tail = float(s.double()[k:].square().sum()) if used == "full" else float((x - (u * s) @ vh).double().square().sum())
    return LowRank(a, b, tail, total, used, s.detach().double().cpu() if used == "full" else None)


def device_low_rank_factors(delta: Tensor, rank: int, svd: str = "auto") -> LowRank:
    """:func:`low_rank_factors` on the device of the enclosing :func:`~clmerge.utils.device.using_device`
    (``delta`` moved there, the factors moved back to the CPU); the plain call without one."""
    device = current_device()
    if device is None:
        return low_rank_factors(delta, rank, svd)
    with device.mode():
        low = low_rank_factors(device.put(delta), rank, svd)
    return low._replace(a=device.back(low.a), b=device.back(low.b))


def rank_pattern(factors: dict[str, tuple[Tensor, Tensor]], rank: int) -> dict[str, int]:
    """``{module: its rank}`` for the modules of ``{module: (A, B)}`` whose rank is not ``rank`` (clamped to
    ``min(out, in)``): the ``rank_pattern`` / ``alpha_pattern`` of the adapter config."""
    return {mod: a.shape[0] for mod, (a, _) in factors.items() if a.shape[0] != rank}


def clamped_note(pattern: dict[str, int], rank: int) -> str | None:
    """A one-line note naming the modules whose rank was clamped below ``rank`` (``None`` if none)."""
    low = {m: r for m, r in pattern.items() if r < rank}
    if not low:
        return None
    first = next(iter(low))
    return (f"note: rank {rank} is above min(out, in) for {len(low)} module{'s' if len(low) > 1 else ''} "
            f"(e.g. {first}: rank {low[first]}); written at that rank there (exact), not zero-padded")


def numerical_rank(delta: Tensor) -> int:
    """Singular values above ``s_max * max(out, in) * eps(float32)`` (numpy's ``matrix_rank`` rule at float32
    precision): the rank at which a truncated SVD reproduces ``delta`` to float32 rounding."""
    s = torch.linalg.svdvals(delta.to(torch.float64))
    if s.numel() == 0 or s[0] == 0:
        return 0
    return int((s > s[0] * max(delta.shape) * torch.finfo(torch.float32).eps).sum())


def relative_error(tail: float, total: float) -> float:
    """``sqrt(tail / total)`` (0 for a zero update)."""
    return math.sqrt(tail / total) if total > 0 else 0.0


def error_summary(per_module: dict[str, LowRank | tuple[float, float]]) -> dict:
    """Per-module and overall relative Frobenius errors from ``{module: LowRank}`` (or ``(tail, total)``),
    with how many modules used each SVD."""
    pairs = {m: (x.tail, x.total) if isinstance(x, LowRank) else x for m, x in per_module.items()}
    rel = {m: relative_error(t, s) for m, (t, s) in pairs.items()}
    tail, total = sum(t for t, _ in pairs.values()), sum(s for _, s in pairs.values())
    used = [x.svd for x in per_module.values() if isinstance(x, LowRank)]
    return {"per_module_rel_error": rel, "overall_rel_error": relative_error(tail, total),
            "max_rel_error": max(rel.values(), default=0.0), "svd": {u: used.count(u) for u in sorted(set(used))}}


def check_out_dir(out: Path, inputs: list[Path] = (), overwrite: bool = False) -> None:
    """Refuse an ``--out`` that names an input, holds one, or holds something already unless ``overwrite``
    (a new folder inside an input folder is fine: nothing there is read); the rule is the one output guard's,
    :func:`clmerge.utils.outpaths.check_output_dir`."""
    check_output_dir(Path(out), flag="--out", inputs=inputs, overwrite=overwrite)


def rank_for_error(spectrum: Tensor, target: float = KEEP_ERROR) -> int:
    """The smallest ``k`` whose truncation error ``sqrt(sum_{i>k} s_i^2 / sum_i s_i^2)`` is at most ``target``
    (Eckart-Young), from every singular value ``s`` of the matrix."""
    sq = spectrum.double().square()
    total = float(sq.sum())
    if total == 0:
        return 0
    tails = (total - sq.cumsum(0)).clamp_min(0)  # tails[k - 1]: the error energy at rank k
    ok = (tails <= target * target * total).nonzero()
    return int(ok[0]) + 1 if ok.numel() else int(sq.numel())


def rank_loss(rank: int, errors: dict[str, LowRank], pending: dict[str, Tensor]) -> dict | None:
    """When some module's write-back at ``rank`` loses more than :data:`LOSS_WARN`, the loss and the rank that
    keeps every module within :data:`KEEP_ERROR` (its singular values: the full SVD's, else ``svdvals`` of the
    ``pending`` matrices, the randomized modules above that error); ``None`` otherwise.

    Returns:
        ``{"rank", "max_rel_error", "worst_module", "overall_rel_error", "suggested_rank", "warning"}``.
    """
    summary = error_summary(errors)
    rel = summary["per_module_rel_error"]
    if not rel or summary["max_rel_error"] <= LOSS_WARN:
        return None
    need = [rank_for_error(low.spectrum) for low in errors.values() if low.spectrum is not None]
    need += [rank_for_error(torch.linalg.svdvals(d)) for d in pending.values()]
    suggested = max([rank, *need])
    worst = max(rel, key=rel.get)
    warning = (f"warning: rank {rank} loses {summary['max_rel_error']:.0%} of the merged update in {worst} "
               f"(relative Frobenius error of Delta W; {summary['overall_rel_error']:.0%} over all modules); "
               f"rank {suggested} keeps 99% (error <= {KEEP_ERROR:.0%} in every module): --adapter-rank {suggested}")
    return {"rank": rank, "max_rel_error": summary["max_rel_error"], "worst_module": worst,
            "overall_rel_error": summary["overall_rel_error"], "suggested_rank": suggested, "warning": warning}
