"""The streamed TIES kernel: one key of plain task vectors merged in cache-sized slices, plus the small
helpers for entries whose elected sign is settled only by the model-wide majority (see ``ties``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .trim import TIE_ALL, add_ties

__all__ = ["Work", "ties_key_streamed", "negative_choice", "fix_values", "sum_rows"]


def negative_choice(cols: Tensor, merge_fn: str) -> Tensor:
    """``tau_m`` of trimmed columns ``cols`` ``(T, m)`` with the elected sign -1 (the same arithmetic as
    :func:`.ties._ties_core`: sum of the agreeing magnitudes times the sign, over their count for the mean)."""
    agreeing = cols.neg().clamp_(min=0)
    if merge_fn == "max":
        return agreeing.amax(0).neg_()
    out = agreeing.sum(0).neg_()
    return out / agreeing.sign().sum(0).clamp(min=1) if merge_fn == "mean" else out


class Work:
    """Work buffers of the streamed TIES merge, allocated once per merge: per-slice temporaries would be
    allocated and freed ~10 times per slice, between kept outputs, and the malloc heap keeps growing."""

    def __init__(self, num: int, chunk: int, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.tv, self.tmp = torch.empty(num, chunk, dtype=dtype), torch.empty(num, chunk, dtype=dtype)
        # masks are 0/1 in the work dtype: comparisons into a float buffer and products with it run several
        # times faster on the CPU than bool masks (which take a type-promoting, unvectorised path)
        self.mask = torch.empty(num, chunk, dtype=dtype)
        self.total, self.sign, self.pick, self.count, self.res = (torch.empty(chunk, dtype=dtype) for _ in range(5))
        self.zero = torch.empty(chunk, dtype=dtype)
        self.flag = torch.empty(chunk, dtype=torch.bool)


ROW_SUM_MAX = 4  # up to this many experts a sum over them is the same numbers as torch.sum(x, 0)


def sum_rows(x: Tensor, out: Tensor) -> Tensor:
    """``torch.sum(x, 0, out=out)`` for ``x`` ``(T, n)``. A dim-0 reduction over a few rows is ~20x slower
    than adding the rows one by one on the CPU; up to :data:`ROW_SUM_MAX` rows torch sums them in row order
    too, so the row adds give the same numbers (tested), and more rows keep torch's own order. That holds in
    float32 and float64; a bf16 / fp16 sum (``compute_dtype`` bfloat16) is accumulated in float32 by torch and
    rounded once, where the row adds round each addition."""
    if x.shape[0] > ROW_SUM_MAX:
        return torch.sum(x, 0, out=out)
    out.copy_(x[0])
    for row in x[1:]:
        out.add_(row)
    return out


def _compare_spec(thr: Tensor, quotas: list[int], dtype: torch.dtype) -> tuple[Tensor, Tensor, list[int]]:
    """Per expert: the threshold in ``dtype``, the value to compare with (``>= v`` keeps all ties when the quota
    is :data:`TIE_ALL`; ``>=`` the next float above ``v``, i.e. ``> v``, when ties are rationed) and the ties
    still to keep."""
    thr_w = thr.to(dtype)
    up = torch.nextafter(thr_w, thr_w.new_tensor(math.inf))
    thr_c = torch.where(torch.tensor([q == TIE_ALL for q in quotas]), thr_w, up)
    return thr_w, thr_c, [q if q != TIE_ALL else 0 for q in quotas]


def _keep(mag: Tensor, thr_c: Tensor, thr: Tensor, rem: int, out: Tensor) -> int:
    """``out`` (0/1 in place) = ``mag >= thr_c``, plus the first ``rem`` entries equal to ``thr`` while a quota
    of ties runs; returns the quota left for the next slices. The slices before the quota runs out keep all their
    ties (``>= thr``); the ties are the mask's growth (sums of 0/1 entries, exact up to 2^24 entries a slice)."""
    torch.ge(mag, thr_c, out=out)
    if rem <= 0:
        return 0
    # counted in float64: a bf16 work dtype (compute_dtype: bfloat16) would round a count above 256
    above = float(out.sum(dtype=torch.float64))
    ties = int(float(torch.ge(mag, thr, out=out).sum(dtype=torch.float64)) - above)
    if ties > rem:  # the slice where it runs out: "> v" plus the first ``rem`` ties
        torch.ge(mag, thr_c, out=out)
        out.copy_(add_ties(out.bool(), mag, thr, rem))
    return max(0, rem - ties)


def ties_key_streamed(b: Tensor, xs: list[Tensor], thr: Tensor, quotas: list[int], scaling: float,
                      merge_fn: str, w: Work, fb: Tensor | None = None,
                      cut: tuple[Tensor, list[int]] | None = None) -> tuple[Tensor, float, tuple[Tensor, ...] | None]:
    """:func:`.ties._ties_core` with zero sums given the sign +1, on one key of plain task vectors, slice by slice in
    the buffers ``w`` (same arithmetic, in ``w.dtype``: float32, float64 for float64 inputs, or bf16 / fp16
    under ``compute_dtype`` bfloat16, float16 or input: :func:`.trim.work_dtype`). The task vectors
    are ``x - b`` computed in ``w.dtype``, the very numbers the thresholds ``thr`` were found on (see
    :func:`.ties.per_tensor_trim_spec`, :func:`.ties.global_trim`).

    ``fb``: the flat base already in ``w.dtype`` (else converted here).

    Returns ``(theta_0 + scaling * tau_m, sign sum, fix)``;
    ``fix`` (see :func:`fix_values`) covers the ambiguous entries, or is ``None``. ``quotas`` as in
    :func:`.ties.trim`. ``cut``: thresholds and quotas of the same form whose kept set (a subset of the trim's)
    is removed from it after the trim: the largest-magnitude outliers of Model Breadcrumbs."""
    out = torch.empty(b.shape, dtype=xs[0].dtype)
    # base in the work dtype: bf16 - bf16 into a float32 buffer would round the difference to bf16 first
    fb = b.reshape(-1).to(w.dtype) if fb is None else fb
    fo, fx = out.view(-1), [x.reshape(-1) for x in xs]
    thr32, thr_c, remaining = _compare_spec(thr, quotas, w.dtype)
    if cut is not None:
        cut_thr, cut_c, cut_rem = _compare_spec(*cut, w.dtype)
    sign_sum, fixes, chunk = 0.0, [], w.tv.shape[1]
    for i in range(0, fb.numel(), chunk):
        n = min(chunk, fb.numel() - i)
        tv, tmp, mask = w.tv[:, :n], w.tmp[:, :n], w.mask[:, :n]
        total, sign, pick, count, res = w.total[:n], w.sign[:n], w.pick[:n], w.count[:n], w.res[:n]
        zero = w.zero[:n]
        for t, x in enumerate(fx):
            torch.sub(x[i:i + n], fb[i:i + n], out=tv[t])
        torch.abs(tv, out=tmp)
        for t in range(len(fx)):
            remaining[t] = _keep(tmp[t], thr_c[t], thr32[t], remaining[t], mask[t])
        if cut is not None:  # the cut's kept set, in ``pick`` (free until the election), taken off the mask
            for t in range(len(fx)):
                cut_rem[t] = _keep(tmp[t], cut_c[t], cut_thr[t], cut_rem[t], pick)
                mask[t].sub_(pick)
        tv.mul_(mask)  # trimmed (a product with 1 or 0, as with a bool mask)
        torch.sign(sum_rows(tv, total), out=sign)
        sign_sum += float(sign.sum(dtype=torch.float64))  # exact whatever the work dtype
        torch.eq(total, 0, out=zero)  # 1 where the sum is zero; sign is 0 there, so sign + zero puts +1 there
        torch.add(sign, zero, out=pick)
        sign.add_(zero)
        tv.mul_(pick).clamp_(min=0)  # |tau_hat_t| where it agrees with the elected sign
        sum_rows(torch.sign(tv, out=tmp), count)  # counts of 0/1: exact in any order
        ambiguous = float(torch.dot(count, zero))  # > 0: some zero sum over nonzero entries (count >= 0)
        if ambiguous > 0 or ambiguous != ambiguous:  # NaN: decide entry by entry, as below
            # zero sum over nonzero entries: the value depends on the model-wide majority, known at the end;
            # the trimmed columns are formed again from the inputs (the buffer now holds only positives)
            # count * zero > 0: count > 0 where the sum is zero (False for NaN); ``res`` is free until below
            pos = torch.gt(torch.mul(count, zero, out=res), 0, out=w.flag[:n]).nonzero().squeeze(1)
            if pos.numel():  # index_select: a gather several times cheaper than advanced indexing
                fbp = fb[i:i + n].index_select(0, pos)
                cols = torch.stack([x[i:i + n].index_select(0, pos).to(w.dtype) for x in fx]).sub_(fbp)
                cols.mul_(mask.index_select(1, pos))
                fixes.append(fix_values(pos + i, negative_choice(cols, merge_fn), fbp, scaling, merge_fn,
                                        out.dtype))
        if merge_fn == "max":
            torch.amax(tv, 0, out=res).mul_(sign)
        else:
            sum_rows(tv, res).mul_(pick)
            if merge_fn == "mean":
                res.div_(count.clamp_(min=1))
        fo[i:i + n] = res.mul_(scaling).add_(fb[i:i + n])
    if not fixes:
        return out, sign_sum, None
    return out, sign_sum, tuple(None if parts[0] is None else torch.cat(parts) for parts in zip(*fixes))


def fix_values(pos: Tensor, tau_neg: Tensor, base_vals: Tensor, scaling: float, merge_fn: str,
                dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:
    """What an ambiguous entry's output becomes if the model-wide majority sign is -1 (and, for ``max``, 0):
    ``(positions as int32, theta_0 + scaling * tau_m in the output dtype, theta_0 there or None)``. Compact on
    purpose: bf16 task vectors cancel exactly in a few percent of the entries (2.4% at density 0.2)."""
    if_negative = (base_vals + scaling * tau_neg).to(dtype)
    return pos.to(torch.int32), if_negative, base_vals.to(dtype) if merge_fn == "max" else None
