"""Magnitude trimming with an exact count: keep exactly ``round(density * n)`` entries.

Rule (``trim_rule="exact"``, the default of every magnitude-trimming method): with ``k = round(density * n)``
(halves rounded up) and ``v`` the ``k``-th largest magnitude, keep every entry with ``|x| > v``, then the
entries with ``|x| == v`` in a fixed order -- key order, then flat (row-major) index -- until exactly ``k`` are
kept. Low-precision deltas (bf16) tie at ``v`` by the thousand, so "keep ``|x| >= v``" can keep far more
than ``density`` (32.5% instead of 20% on a bf16 1.1B model).

``trim_rule="threshold"`` is the rule of the TIES and FusionBench code: ``v`` is the
``(n - floor(density * n))``-th smallest magnitude and every ``|x| >= v`` is kept (``floor(density*n) + 1``
entries when the magnitudes are distinct, more under ties).

``trim_scope="global"`` (the whole task vector) is the TIES paper's and FusionBench's scope;
``trim_scope="per_tensor"`` is mergekit's, which keeps ``max(1, int(density * n))`` entries per tensor by
``argsort`` (0.1.5; ties in the order the sort leaves them): ``round`` and ``int`` differ whenever the
fractional part of ``density * n`` is at least one half (``density=0.2, n=8``: 2 here, 1 in mergekit), and a
tensor whose count rounds to 0 is zeroed here where mergekit keeps one entry.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor

__all__ = ["Buffers", "TRIM_RULES", "TIE_ALL", "keep_count", "check_trim_rule", "add_ties",
           "top_magnitude_mask", "exact_trim_rows", "tensor_trim_spec", "allocate_tie_quotas", "kth_smallest",
           "kth_smallest_counts", "work_dtype", "input_dtype_arithmetic"]

TRIM_RULES = ("exact", "threshold")
# A tie quota meaning "every entry equal to the threshold is kept" (the threshold rule; or an exact quota
# that covers all of a key's ties).
TIE_ALL = -1


# whether the merge arithmetic runs in the inputs' own dtype (``compute_dtype`` bfloat16, float16 or input:
# :attr:`.sources.ModelSet.narrow`) instead of at least float32; set by :func:`input_dtype_arithmetic`
_IN_INPUT_DTYPE: ContextVar[bool] = ContextVar("clmerge_input_dtype_arithmetic", default=False)


@contextmanager
def input_dtype_arithmetic(on: bool) -> Iterator[None]:
    """Within the block, :func:`work_dtype` is the inputs' own dtype (no float32 floor) when ``on``.

    The merge driver (:func:`.driver.map_keys`) and the streaming pipeline set it from the inputs'
    :class:`~.sources.ModelSet` (its ``compute_dtype``): the one switch of the kernels that compute in
    :func:`work_dtype`."""
    token = _IN_INPUT_DTYPE.set(bool(on))
    try:
        yield
    finally:
        _IN_INPUT_DTYPE.reset(token)


def work_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype a kernel computes task vectors (and their sums) in: float32, or float64 when an input is
    float64; within :func:`input_dtype_arithmetic` the inputs' own dtype (bf16 stays bf16; mixed dtypes
    promote as torch promotes them).

    A count or threshold must be found on the same numbers it is applied to: a threshold found on
    ``x.float() - b.float()`` but applied to ``x - b`` rounded afterwards keeps a different number of entries
    on float64 inputs.
    """
    out = dtypes[0] if _IN_INPUT_DTYPE.get() and dtypes else torch.float32
    for d in dtypes:
        out = torch.promote_types(out, d)
    return out


class Buffers:
    """Flat work buffers kept from key to key of one merge, each grown to the largest key seen: a fresh
    full-size tensor per key costs its page faults (several times an elementwise pass over it)."""

    def __init__(self) -> None:
        self._bufs: dict[str, Tensor] = {}

    def get(self, name: str, n: int, dtype: torch.dtype, like: Tensor) -> Tensor:
        """A flat buffer of ``n`` entries (uninitialised) on ``like``'s device, the same memory on every call
        with ``name``."""
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != like.device:
            self._bufs.pop(name, None)  # freed before its successor is allocated
            buf = self._bufs[name] = like.new_empty(n, dtype=dtype)
        return buf[:n]


def check_trim_rule(trim_rule: str) -> None:
    """Raise a one-line error for an unknown ``trim_rule``."""
    if trim_rule not in TRIM_RULES:
        raise ValueError(f"trim_rule must be 'exact' or 'threshold', got {trim_rule!r}")


def keep_count(density: float, n: int) -> int:
    """``round(density * n)`` with halves rounded up, clipped to ``[0, n]``: the exact number of kept entries."""
    return max(0, min(n, math.floor(density * n + 0.5)))


def add_ties(keep: Tensor, mag: Tensor, v: Tensor | float, quota: int) -> Tensor:
    """Set in ``keep`` (contiguous, modified in place and returned) the first ``quota`` entries (flat order) of
    ``mag`` equal to ``v``; ``TIE_ALL``: all of them."""
    if quota == 0:
        return keep
    eq = mag == v
    if quota == TIE_ALL:
        return keep.logical_or_(eq)
    # the positions of the ties: a few thousand indices, cheaper than a running count over the whole tensor
    idx = eq.view(-1).nonzero().squeeze(1)[:quota]
    keep.view(-1)[idx] = True
    return keep


def kth_smallest(x: Tensor, k: int, *, sample: int = 1 << 16) -> Tensor:
    """The ``k``-th smallest (1-indexed) entry of the flat tensor ``x``: exactly ``x.kthvalue(k).values``.

    For large ``x`` a strided sample brackets the answer, two counting passes check that the bracket holds
    it, and ``kthvalue`` runs only on the few entries inside (an unlucky bracket falls back to ``kthvalue`` on
    everything). A few comparison passes instead of a full selection: several times faster on a model.
    """
    d = x.numel()
    if d <= 8 * sample:
        return x.kthvalue(k).values
    lo, hi = _sample_bracket(x, k, sample)
    below = int(torch.count_nonzero(x < lo))
    inside = x[(x >= lo) & (x <= hi)]
    if below < k <= below + inside.numel():
        return inside.kthvalue(k - below).values
    return x.kthvalue(k).values


def _sample_bracket(x: Tensor, k: int, sample: int) -> tuple[Tensor, Tensor]:
    """``(lo, hi)`` from a strided sample of the flat ``x``: the sample's quantiles ``6`` standard errors
    (plus ``4 / n``) either side of ``k / d``; they hold the ``k``-th smallest unless the sample misleads."""
    d = x.numel()
    s = x[:: d // sample]
    n, q = s.numel(), k / d
    margin = 6.0 * math.sqrt(q * (1.0 - q) / n) + 4.0 / n
    lo_i, hi_i = math.floor((q - margin) * n), math.ceil((q + margin) * n)
    lo = s.kthvalue(lo_i).values if lo_i >= 1 else x.new_tensor(-math.inf)
    hi = s.kthvalue(hi_i).values if hi_i <= n else x.new_tensor(math.inf)
    return lo, hi


def _count(x: Tensor, op, v: Tensor, mask: Tensor | None) -> int:
    """``count_nonzero(op(x, v))``, the comparison written into ``mask`` (a bool buffer of ``x``'s size)."""
    return int(torch.count_nonzero(op(x, v) if mask is None else op(x, v, out=mask)))


def kth_smallest_counts(x: Tensor, k: int, *, sample: int = 1 << 16,
                        mask: Tensor | None = None) -> tuple[Tensor, int, int]:
    """``(v, #{x > v}, #{x == v})`` with ``v = x.kthvalue(k).values`` of the flat ``x`` (exactly).

    The threshold and the two counts an exact trim needs. Low-precision task vectors tie by the thousand at
    the threshold: when the strided sample's own ``k / d`` quantile ``v0`` occurs more than once in it, ``v0``
    is tried first, three comparison passes that settle it (``#{x < v0} < k <= #{x <= v0}``). Otherwise, or if
    ``v0`` misses, the sample bracket of :func:`kth_smallest` is counted and ``kthvalue`` runs on the entries
    inside it. ``mask``: an optional bool buffer of ``x``'s size for the comparisons.
    """
    d = x.numel()
    if d > 8 * sample:
        s = x[:: d // sample]
        v0 = s.kthvalue(min(s.numel(), max(1, round(k / d * s.numel())))).values
        if _count(s, torch.eq, v0, None) > 1:
            below, upto = _count(x, torch.lt, v0, mask), _count(x, torch.le, v0, mask)
            if below < k <= upto:
                return v0, _count(x, torch.gt, v0, mask), upto - below
        lo, hi = _sample_bracket(x, k, sample)
        below, upto = _count(x, torch.lt, lo, mask), _count(x, torch.le, hi, mask)
        if below < k <= upto:
            if bool(lo == hi):  # every entry inside equals lo: no selection needed
                return lo, _count(x, torch.gt, hi, mask), upto - below
            inside = x[torch.ge(x, lo) & torch.le(x, hi)]
            v = inside.kthvalue(k - below).values
            return v, _count(x, torch.gt, hi, mask) + _count(inside, torch.gt, v, None), \
                _count(inside, torch.eq, v, None)
    v = x.kthvalue(k).values
    return v, _count(x, torch.gt, v, mask), _count(x, torch.eq, v, mask)


def _kth_largest(mag: Tensor, k: int) -> Tensor:
    return kth_smallest(mag.reshape(-1), mag.numel() - k + 1)


def top_magnitude_mask(mag: Tensor, k: int) -> Tensor:
    """Bool mask of the ``k`` largest entries of ``mag``; among equal values the earlier flat index wins."""
    n = mag.numel()
    if k >= n:
        return torch.ones(mag.shape, dtype=torch.bool)
    if k <= 0:
        return torch.zeros(mag.shape, dtype=torch.bool)
    v = _kth_largest(mag, k)
    keep = mag > v
    return add_ties(keep, mag, v, k - int(torch.count_nonzero(keep)))


def exact_trim_rows(tvs: Tensor, density: float) -> Tensor:
    """``tvs`` ``(T, *shape)`` with each row trimmed to its ``round(density * n)`` largest magnitudes (a new
    tensor; ties to the lower flat index)."""
    k = keep_count(density, tvs[0].numel())
    if k >= tvs[0].numel():
        return tvs.clone()
    out = torch.zeros_like(tvs)
    if k > 0:
        for t, v in enumerate(tvs):
            torch.mul(v, top_magnitude_mask(v.abs(), k), out=out[t])
    return out


def tensor_trim_spec(mags: Tensor, density: float, mask: Tensor | None = None) -> tuple[Tensor, list[int]]:
    """Per-row exact trim of ``mags`` ``(T, *shape)``: thresholds ``v_t`` ``(T,)`` and tie quotas.

    Row ``t`` keeps ``|x| > v_t`` plus the first ``quota_t`` entries equal to ``v_t`` (``TIE_ALL``: all).
    ``mask``: an optional bool buffer of one row's size for the counting passes.
    """
    n = mags[0].numel()
    k = keep_count(density, n)
    if k >= n:
        return torch.zeros(mags.shape[0], dtype=mags.dtype), [TIE_ALL] * mags.shape[0]
    if k == 0:
        return torch.full((mags.shape[0],), math.inf, dtype=mags.dtype), [0] * mags.shape[0]
    thr, quotas = [], []
    for m in mags:
        v, above, ties = kth_smallest_counts(m.reshape(-1), n - k + 1, mask=mask)
        quota = k - above
        thr.append(v)
        quotas.append(TIE_ALL if quota >= ties else quota)
    return torch.stack(thr), quotas


def allocate_tie_quotas(keys: Sequence[str], ties_per_key: Sequence[Sequence[int]],
                        needed: Sequence[int]) -> dict[str, list[int]]:
    """Hand each expert's quota of threshold-equal entries to the keys in key order.

    Args:
        keys: the keys, in the model's order.
        ties_per_key: ``ties_per_key[t][i]``: entries of key ``i`` of expert ``t`` equal to its threshold.
        needed: per expert, how many threshold-equal entries the whole model keeps (``k - #{|x| > v}``).

    Returns:
        ``{key: [quota per expert]}``; a key whose ties are all kept gets ``TIE_ALL``.
    """
    out: dict[str, list[int]] = {key: [] for key in keys}
    for t, counts in enumerate(ties_per_key):
        rem = int(needed[t])
        for key, c in zip(keys, counts):
            q = min(rem, int(c))
            out[key].append(TIE_ALL if q == c else q)
            rem -= q
    return out
