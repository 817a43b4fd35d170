"""The TIES engine (Yadav et al. 2023): trim, elect the sign, disjoint merge, over any task-vector transform.

Shared math, registers nothing: the sparsification family (:mod:`.sparse_family`: ``ties``, ``dare``, ``della``,
``breadcrumbs_ties``, ...) runs its consensus rows through :func:`ties_from_task_vectors`, and KnOTS and
TALL-mask + TIES call :func:`ties_tensor` on their own task vectors.

``density`` is the fraction of each task vector kept by magnitude over the **whole** task vector, as in the
original TIES code (``trim_scope="global"``). The global threshold of expert ``t`` is found from that expert's
magnitudes alone (one model's worth of numbers at a time), never from an N x d stack of all experts; the merge
itself then runs key by key. ``trim_scope="per_tensor"`` trims each tensor separately (no global pass), as
mergekit does. ``trim_rule`` picks how many entries survive: exactly ``round(density * n)`` (``"exact"``, the
default) or every ``|tau| >= thr`` (``"threshold"``, the TIES / FusionBench code); see :mod:`.trim`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ...utils.device import like_device, to_host
from .driver import bshape, map_keys
from .sources import ModelSet
from .ties_kernels import Work, fix_values, negative_choice, ties_key_streamed
from .trim import (TIE_ALL, Buffers, add_ties, allocate_tie_quotas, check_trim_rule, exact_trim_rows,
                   keep_count, kth_smallest, tensor_trim_spec, work_dtype,
                   input_dtype_arithmetic)

__all__ = ["ties_from_task_vectors", "plain_task_vectors", "per_tensor_trim_spec", "ties_tensor",
           "global_magnitude_thresholds", "global_trim", "magnitude_threshold", "kth_smallest", "TaskVectorFn",
           "KeyTrimSpec"]

# (key, base, experts, expert indices) -> task vectors of those experts for that key, shape (len, *shape)
_BLOCK = 1 << 20  # columns per block of the generic TIES election

TaskVectorFn = Callable[[str, Tensor, list[Tensor], list[int]], Tensor]


def plain_task_vectors(key: str, base: Tensor, experts: list[Tensor], idx: list[int]) -> Tensor:
    """``theta_t - theta_0``, shape ``(T, *shape)``, in float32 as the TIES reference code (float64 for float64
    inputs: :func:`.trim.work_dtype`)."""
    dt = work_dtype(base.dtype, *(e.dtype for e in experts))
    return torch.stack([e.to(dt) for e in experts]) - base.to(dt)


def magnitude_threshold(magnitudes: Tensor, density: float) -> Tensor:
    """The TIES trim threshold: the ``(d - floor(density*d))``-th smallest of ``magnitudes`` (flat).

    Entries ``>= threshold`` are kept, which is the rule of the TIES and FusionBench code (it keeps
    ``floor(density*d) + 1`` entries when values are distinct). ``density >= 1`` keeps everything.
    """
    d = magnitudes.numel()
    k = d - int(d * density)
    if density >= 1.0 or k <= 0:
        return torch.tensor(0.0, dtype=magnitudes.dtype)
    return kth_smallest(magnitudes.reshape(-1), k)


def global_magnitude_thresholds(models: ModelSet, density: float, tv_fn: TaskVectorFn) -> Tensor:
    """Per-expert global trim thresholds of the threshold rule (keep ``|tau| >= thr``), shape ``(T,)``: the
    ``(d - floor(density*d))``-th smallest magnitude of each whole task vector. See :func:`global_trim`."""
    return global_trim(models, density, tv_fn, "threshold")[0]


def global_trim(models: ModelSet, density: float, tv_fn: TaskVectorFn,
                trim_rule: str = "exact") -> tuple[Tensor, dict[str, list[int]] | None]:
    """The global-top-k pass of TIES: per-expert thresholds ``(T,)`` and, for ``trim_rule="exact"``, the
    per-key tie quotas (see :mod:`.trim`: keep ``|tau| > v_t`` plus ``quotas[key][t]`` entries equal to
    ``v_t``, in flat order; ``None``: keep ``|tau| >= v_t``). Never from an ``N x d`` stack of all experts.

    Plain task vectors (TIES): :func:`_streamed_thresholds`, one read of the models. Other transforms (DARE):
    expert by expert, the magnitudes of its whole task vector go into one flat float32 buffer (peak extra
    memory: one model) and the threshold is read off with :func:`kth_smallest`.
    """
    check_trim_rule(trim_rule)
    keys = [k for k in models.keys() if models.is_float(k)]
    num = models.num_experts
    total = sum(int(torch.Size(models.meta(k)[0]).numel()) for k in keys)
    dt = model_work_dtype(models, keys)
    kept = keep_count(density, total) if trim_rule == "exact" else int(total * density)
    if density >= 1.0 or kept >= total:
        return torch.zeros(num, dtype=dt), None
    if trim_rule == "exact" and kept == 0:
        return torch.full((num,), math.inf, dtype=dt), {key: [0] * num for key in keys}
    # the k-th smallest: exact rule, the kept-th largest; threshold rule, as the TIES code
    k = total - kept + (1 if trim_rule == "exact" else 0)
    want_ties = trim_rule == "exact"
    if tv_fn is plain_task_vectors:
        out, above, ties = _streamed_thresholds(models, keys, total, k, want_ties, dt)
    else:
        out, above, ties = torch.full((num,), math.nan, dtype=dt), [0] * num, [[] for _ in range(num)]
    buf = None
    for t in range(num):
        if not math.isnan(float(out[t])):
            continue
        buf = torch.empty(total, dtype=dt) if buf is None else buf
        pos, bounds = 0, [0]
        for key in keys:
            base, x = models.base.get(key), models.experts[t].get(key)
            # plain task vectors in the dtype of the streamed kernel, which computes x - b in ``dt``
            tv = x.to(dt) - base.to(dt) if tv_fn is plain_task_vectors else tv_fn(key, base, [x], [t])[0]
            buf[pos:pos + base.numel()] = tv.reshape(-1)
            pos += base.numel()
            bounds.append(pos)
        out[t] = kth_smallest(buf.abs_(), k)
        if want_ties:
            above[t] = int(torch.count_nonzero(buf > out[t]))
            ties[t] = [int(torch.count_nonzero(buf[i:j] == out[t])) for i, j in zip(bounds[:-1], bounds[1:])]
    if not want_ties:
        return out, None
    return out, allocate_tie_quotas(keys, ties, [kept - a for a in above])


def model_work_dtype(models: ModelSet, keys: list[str]) -> torch.dtype:
    """The dtype of a model-wide trim: :func:`.trim.work_dtype` over every key (float64 if any key is)."""
    return work_dtype(*(models.meta(k)[1] for k in keys))


def _streamed_thresholds(models: ModelSet, keys: list[str], total: int, k: int, want_ties: bool = False,
                         dt: torch.dtype = torch.float32, sample: int = 1 << 18,
                         chunk: int = 1 << 15) -> tuple[Tensor, list[int], list[list[int]]]:
    """Exact k-th smallest ``|theta_t - theta_0|`` of every expert from one streamed read of the models.

    A strided sample brackets each expert's answer; one pass over all keys (in cache-sized slices) counts the
    magnitudes below the bracket and up to its top, and keeps the few inside it; ``kthvalue`` on those gives
    the exact value. A bracket that closes on one value (low-precision task vectors: thousands of ties at the
    threshold) needs no kept entries: the counts settle it. Magnitudes are ``|x - b|`` computed in ``dt``,
    as the streamed kernel computes them. Experts whose bracket misses the answer get NaN (the caller falls
    back to the exact full selection).

    Returns ``(thresholds, above, ties)``; with ``want_ties``, ``above[t]`` counts the magnitudes ``> thr_t``
    and ``ties[t][i]`` those ``== thr_t`` in key ``i`` (the bracket holds them all, in key order).
    """
    lo, hi, inside = _sample_brackets(models, keys, total, k, dt, sample, chunk)
    below, upto, fill, starts = _bracket_pass(models, keys, lo, hi, inside, dt, chunk)
    num = models.num_experts
    out, above, ties = torch.full((num,), math.nan, dtype=dt), [0] * num, [[] for _ in range(num)]
    for t in range(num):
        n_below, n_upto = int(below[t].sum()), int(upto[t].sum())
        if not n_below < k <= n_upto:
            continue
        if bool(lo[t] == hi[t]):  # every magnitude inside the bracket equals lo
            out[t], above[t], ties[t] = lo[t], total - n_upto, (upto[t] - below[t]).tolist()
            continue
        vals = inside[t][:fill[t]]
        out[t] = vals.kthvalue(k - n_below).values
        if want_ties:
            above[t] = total - n_below - int(torch.count_nonzero(vals <= out[t]))
            ends = starts[t][1:] + [fill[t]]
            ties[t] = [int(torch.count_nonzero(vals[i:j] == out[t])) for i, j in zip(starts[t], ends)]
    return out, above, ties


def _sample_brackets(models: ModelSet, keys: list[str], total: int, k: int, dt: torch.dtype, sample: int,
                     chunk: int) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Per expert, the bracket ``[lo, hi]`` of the ``k``-th smallest magnitude from a strided sample of every
    key, and an empty buffer for the magnitudes inside it (sized to the sample's share, with slack; one slice
    when the bracket closes on one value)."""
    num, step = models.num_experts, max(1, total // sample)
    parts: list[list[Tensor]] = [[] for _ in range(num)]
    for key in keys:
        b = models.base.get(key).reshape(-1)[::step].to(dt)
        for t, src in enumerate(models.experts):
            parts[t].append((src.get(key).reshape(-1)[::step].to(dt) - b).abs())
    lo, hi = torch.empty(num, dtype=dt), torch.empty(num, dtype=dt)
    inside: list[Tensor] = []
    for t in range(num):
        s = torch.cat(parts[t])
        n, q = s.numel(), k / total
        margin = 6.0 * math.sqrt(q * (1.0 - q) / n) + 4.0 / n
        lo_i, hi_i = math.floor((q - margin) * n), math.ceil((q + margin) * n)
        lo[t] = s.kthvalue(lo_i).values if lo_i >= 1 else -math.inf
        hi[t] = s.kthvalue(hi_i).values if hi_i <= n else math.inf
        share = 0 if bool(lo[t] == hi[t]) else int(1.25 * total * (min(hi_i, n) - max(lo_i, 1) + 1) / n)
        inside.append(torch.empty(share + chunk, dtype=dt))  # grown in the rare case it is exceeded
        parts[t] = []
    return lo, hi, inside


def _bracket_pass(models: ModelSet, keys: list[str], lo: Tensor, hi: Tensor, inside: list[Tensor],
                  dt: torch.dtype, chunk: int) -> tuple[Tensor, Tensor, list[int], list[list[int]]]:
    """One streamed read of the models: per expert and key, the magnitudes ``< lo`` and ``<= hi`` (counts,
    ``(T, keys)``), and, for a bracket that does not close on one value, the magnitudes inside it written into
    ``inside`` (grown if needed): ``(below, upto, fill, starts)``, ``starts[t][i]`` where key ``i`` begins."""
    num = models.num_experts
    below, upto = (torch.zeros(num, len(keys), dtype=torch.int64) for _ in range(2))
    fill, starts = [0] * num, [[] for _ in range(num)]
    select = [t for t in range(num) if not bool(lo[t] == hi[t])]
    lo_c, hi_c = lo[:, None], hi[:, None]
    # work buffers allocated once: per-slice temporaries would churn (and grow) the malloc heap
    mag_buf, base_buf = torch.empty(num, chunk, dtype=dt), torch.empty(chunk, dtype=dt)
    lt_buf, le_buf = torch.empty(num, chunk, dtype=torch.bool), torch.empty(num, chunk, dtype=torch.bool)
    for j, key in enumerate(keys):
        b = models.base.get(key).reshape(-1)
        xs = [src.get(key).reshape(-1) for src in models.experts]
        for t in range(num):
            starts[t].append(fill[t])
        for i in range(0, b.numel(), chunk):
            n = min(chunk, b.numel() - i)
            mag, lt, le, fb = mag_buf[:, :n], lt_buf[:, :n], le_buf[:, :n], base_buf[:n].copy_(b[i:i + n])
            for t, x in enumerate(xs):
                torch.sub(x[i:i + n], fb, out=mag[t])
            mag.abs_()
            below[:, j] += torch.count_nonzero(torch.lt(mag, lo_c, out=lt), dim=1)
            upto[:, j] += torch.count_nonzero(torch.le(mag, hi_c, out=le), dim=1)
            if select:
                _keep_inside(mag, le.logical_xor_(lt), select, inside, fill)  # lo <= mag <= hi, as lo <= hi
    return below, upto, fill, starts


def _keep_inside(mag: Tensor, keep: Tensor, select: list[int], inside: list[Tensor], fill: list[int]) -> None:
    """Append ``mag[t][keep[t]]`` to ``inside[t]`` at ``fill[t]`` for the experts ``select``."""
    # into the preallocated buffers: small kept pieces (``mag[keep]``) between the per-slice temporaries
    # fragment the malloc heap, which then grows by about one read of every input
    for t, c in zip(select, torch.count_nonzero(keep[select], dim=1).tolist()):
        if c:
            if fill[t] + c > inside[t].numel():
                inside[t] = _grown(inside[t], fill[t], fill[t] + c)
            torch.masked_select(mag[t], keep[t], out=inside[t][fill[t]:fill[t] + c])
            fill[t] += c


def _grown(buf: Tensor, used: int, need: int) -> Tensor:
    """A larger copy of ``buf`` (its first ``used`` entries), with room for at least ``need`` entries."""
    new = torch.empty(max(need, 2 * buf.numel()), dtype=buf.dtype)
    new[:used] = buf[:used]
    return new


_DEVICE_CHUNK = 1 << 24  # entries per slice of the streamed TIES kernel on a GPU
_CPU_CHUNK = 1 << 17  # on the CPU: twice the driver's slices, fewer calls per entry (measured ~10 % faster)


def trim(tvs: Tensor, thresholds: Tensor, quotas: list[int] | None = None) -> Tensor:
    """``tau_hat_t``: entries of ``tvs[t]`` with ``|tau| >= thresholds[t]``, the rest set to 0; with
    ``quotas``, ``|tau| > thresholds[t]`` plus the first ``quotas[t]`` equal ones (``TIE_ALL``: all).

    ``hardshrink`` (keeps ``|x| > lambda``) at the largest float below the threshold: the same set as
    ``|x| >= threshold``, without a boolean mask.
    """
    if torch.promote_types(tvs.dtype, thresholds.dtype) != tvs.dtype:
        # model-wide float64 thresholds (a float64 key elsewhere) on a float32 key: compare exactly, in float64
        tvs = tvs.to(thresholds.dtype)
    if quotas is not None and any(q != TIE_ALL for q in quotas):
        thr = thresholds.to(tvs.dtype)
        out = []
        for v, th, q in zip(tvs, thr, quotas):
            m = v.abs()
            out.append(v * add_ties(m > th, m, th, q))
        return torch.stack(out)
    below = torch.nextafter(thresholds.to(tvs.dtype), tvs.new_tensor(-math.inf))
    return torch.stack([torch.nn.functional.hardshrink(v, float(lam)) for v, lam in zip(tvs, below)])


def ties_tensor(tvs: Tensor, thresholds: Tensor, *, merge_fn: str = "mean",
                zero_sign: Tensor | float | None = None, quotas: list[int] | None = None) -> Tensor:
    """TIES on one key: trim at ``thresholds``, elect the sign, merge the agreeing entries.

    Args:
        tvs: task vectors ``(T, *shape)`` (computed in their dtype: float32 like the TIES / FusionBench code).
        thresholds: ``(T,)``; entries with ``|tau| >= threshold`` survive the trim.
        merge_fn: ``"mean"`` (disjoint mean, the paper), ``"sum"`` or ``"max"`` (FusionBench options).
        zero_sign: the sign given to entries whose trimmed sum is exactly 0; ``None``: the majority sign of
            this tensor. The reference code uses the majority over the whole flattened model, which
            :func:`ties` passes in.
        quotas: exact trim (see :func:`trim`); ``None``: keep ``|tau| >= threshold``.

    Returns:
        The merged task vector ``tau_m``: ``gamma = sgn(sum_t tau_hat_t)``, then the mean over
        ``{t : sgn(tau_hat_t) = gamma}``.
    """
    return _ties_core(trim(tvs, thresholds, quotas), merge_fn, zero_sign)[0]


def _ties_core(trimmed: Tensor, merge_fn: str, zero_sign: Tensor | float | None,
               collect: bool = False) -> tuple[Tensor, float, tuple[Tensor, Tensor] | None]:
    """:func:`ties_tensor` plus the statistics of the election: ``(tau_m, sum of the elected signs before
    zeros are resolved, fix)``. With ``collect``, ``fix`` holds the flat positions of the ambiguous entries (a
    zero trimmed sum over nonzero values: both signs present) and their ``tau_m`` had ``gamma`` been -1
    (:func:`.ties_kernels.negative_choice`), so the caller can apply the model-wide majority sign later
    without a re-read.

    Written with few full-size operations: with ``p = tau_hat * gamma``, the agreeing entries are ``p > 0``,
    their sum is ``gamma * sum(max(p, 0))`` and their count ``count_nonzero(max(p, 0))``.
    """
    if merge_fn not in ("mean", "sum", "max"):
        raise ValueError(f"merge_fn must be 'mean', 'sum' or 'max', got {merge_fn!r}")
    total = trimmed.sum(0)
    sign = torch.sign(total)
    sign_sum = float(sign.sum())
    if zero_sign is None:
        zero_sign = math.copysign(1.0, sign_sum) if sign_sum != 0 else 0.0
    zero = total == 0
    fix = None
    if collect:
        pos = (zero & trimmed.ne(0).any(0)).reshape(-1).nonzero().squeeze(1)
        if pos.numel():  # gathered before the in-place steps below overwrite the negative entries
            fix = (pos, negative_choice(trimmed.reshape(trimmed.shape[0], -1)[:, pos], merge_fn))
    # a zero majority leaves gamma = 0, and the reference code then selects the negative entries
    pick = sign.masked_fill(zero, float(zero_sign) if float(zero_sign) != 0 else -1.0)
    sign.masked_fill_(zero, float(zero_sign))
    agreeing = trimmed.mul_(pick).clamp_(min=0)  # |tau_hat_t| where sgn(tau_hat_t) = gamma, else 0
    count = agreeing.sign().sum(0)  # number of agreeing entries (float; cheaper than count_nonzero)
    if merge_fn == "max":
        return agreeing.amax(0) * sign, sign_sum, fix
    out = agreeing.sum(0).mul_(pick)
    return (out / count.clamp(min=1) if merge_fn == "mean" else out), sign_sum, fix


def _trim_fns(models: ModelSet, tv_fn: TaskVectorFn, density: float, trim_scope: str, trim_rule: str,
              densities: list[float] | None = None):
    """``(global thresholds or None, global quotas or None, fn(key, tvs) -> trimmed tvs)`` for TIES.

    ``densities``: one density per expert (each expert trimmed at its own, as mergekit's per-model
    ``density``) in place of ``density``."""
    if densities is not None:
        return _trim_fns_per_expert(models, tv_fn, densities, trim_scope, trim_rule)
    if trim_scope == "global":
        glob, gq = global_trim(models, density, tv_fn, trim_rule)
        # the thresholds stay where they were found (the CPU); a kernel on a device compares there
        return glob, gq, lambda key, tvs: trim(tvs, like_device(glob, tvs), None if gq is None else gq[key])
    if trim_rule == "exact":
        return None, None, lambda key, tvs: exact_trim_rows(tvs, density)
    return None, None, lambda key, tvs: trim(tvs, torch.stack([magnitude_threshold(v.abs(), density) for v in tvs]))


def _trim_fns_per_expert(models: ModelSet, tv_fn: TaskVectorFn, densities: list[float], trim_scope: str,
                        trim_rule: str):
    """:func:`_trim_fns` with expert ``t`` trimmed at ``densities[t]``: the model-wide pass once per distinct
    density (its rows for the experts of that density), or each row of a key trimmed at its own."""
    if trim_scope == "global":
        glob, gq = None, None
        for d in sorted(set(densities)):
            thr, quotas = global_trim(models, d, tv_fn, trim_rule)
            rows = [t for t, dt in enumerate(densities) if dt == d]
            glob = thr.clone() if glob is None else glob
            glob[rows] = thr[rows]
            if quotas is not None:
                gq = gq if gq is not None else {}
                for key, q in quotas.items():
                    gq.setdefault(key, [TIE_ALL] * len(densities))
                    for t in rows:
                        gq[key][t] = q[t]
        if gq is not None:  # experts whose pass kept every tie (density 1) keep them in every key
            for key in models.keys():
                if models.is_float(key):
                    gq.setdefault(key, [TIE_ALL] * len(densities))
        return glob, gq, lambda key, tvs: trim(tvs, like_device(glob, tvs), None if gq is None else gq[key])
    if trim_rule == "exact":
        return None, None, lambda key, tvs: torch.cat([exact_trim_rows(tvs[t:t + 1], d)
                                                       for t, d in enumerate(densities)])
    return None, None, lambda key, tvs: trim(tvs, torch.stack([magnitude_threshold(v.abs(), d)
                                                               for v, d in zip(tvs, densities)]))


def _weighted_core(trimmed: Tensor, w: Tensor, merge_fn: str,
                   collect: bool = False) -> tuple[Tensor, float, tuple[Tensor, Tensor] | None]:
    """:func:`_ties_core` (zero sums given the sign +1) on weighted task vectors, ``trimmed`` ``(T, m)`` and
    ``w`` ``(T, 1)``: the sign is elected on ``sum_t w_t tau_hat_t``, and the agreeing entries
    ``{t : sgn(w_t tau_hat_t) = gamma}`` give ``sum_t w_t tau_hat_t`` (``sum``), that over ``sum_t w_t``
    (``mean``; a zero sum of weights divides by 1) or the largest ``|w_t tau_hat_t|`` times ``gamma`` (``max``):
    mergekit's per-model ``weight`` in its generalized task arithmetic with a sign consensus. Equal weights
    ``w`` give the ``mean`` of :func:`_ties_core`."""
    if merge_fn not in ("mean", "sum", "max"):
        raise ValueError(f"merge_fn must be 'mean', 'sum' or 'max', got {merge_fn!r}")
    weighted = trimmed * w
    total = weighted.sum(0)
    sign = torch.sign(total)
    sign_sum = float(sign.sum())
    zero = total == 0
    fix = None
    if collect:
        pos = (zero & weighted.ne(0).any(0)).nonzero().squeeze(1)
        if pos.numel():
            fix = (pos, _weighted_pick(weighted[:, pos], w, weighted.new_tensor(-1.0), merge_fn))
    return _weighted_pick(weighted, w, sign.masked_fill_(zero, 1.0), merge_fn), sign_sum, fix


def _weighted_pick(weighted: Tensor, w: Tensor, gamma: Tensor, merge_fn: str) -> Tensor:
    """``tau_m`` of weighted trimmed task vectors ``(T, m)`` for the elected signs ``gamma`` (see
    :func:`_weighted_core`)."""
    agree = (weighted * gamma) > 0
    if merge_fn == "max":
        return (weighted.abs() * agree).amax(0) * gamma
    num = (weighted * agree).sum(0)
    if merge_fn == "sum":
        return num
    den = (w * agree).sum(0)
    return num / torch.where(den == 0, torch.ones_like(den), den)


def _per_expert(values: Sequence[float] | None, num: int, name: str, lo: float | None) -> list[float] | None:
    """``values`` as a list of ``num`` floats (``None`` stays ``None``), or a one-line error; ``lo``: each must
    lie in ``(lo, 1]``."""
    if values is None:
        return None
    out = [float(v) for v in values]
    if len(out) != num:
        raise ValueError(f"{name} needs one value per expert ({num}), got {len(out)}")
    for v in out:
        if not math.isfinite(v) or (lo is not None and not lo < v <= 1.0):
            raise ValueError(f"{name}: every value must be {'in (0, 1]' if lo is not None else 'finite'}, got {v}")
    return out


def per_tensor_trim_spec(b: Tensor, xs: list[Tensor], density: float | Sequence[float], trim_rule: str,
                         bufs: Buffers | None = None, fb: Tensor | None = None) -> tuple[Tensor, list[int]]:
    """Per-expert trim thresholds ``(T,)`` and tie quotas of one key (``trim_scope="per_tensor"``), from one
    expert's magnitudes at a time, computed as the streamed kernel computes them (``x - b`` in
    :func:`.trim.work_dtype`, not ``x`` rounded first): the same kept set as :func:`.trim.exact_trim_rows`
    (exact) or ``|tau| >= magnitude_threshold`` (threshold).

    ``density``: one for every expert, or a sequence of one per expert. ``bufs``: work buffers reused across
    keys; ``fb``: the flat base already in the work dtype."""
    dens = [float(density)] * len(xs) if isinstance(density, (int, float)) else [float(d) for d in density]
    dt = work_dtype(b.dtype, *(x.dtype for x in xs))
    bufs = Buffers() if bufs is None else bufs
    fb = b.reshape(-1).to(dt) if fb is None else fb
    mag = bufs.get("mag", b.numel(), dt, b)
    mask = bufs.get("mask", b.numel(), torch.bool, b) if trim_rule == "exact" else None
    thr, quotas = [], []
    for x, d in zip(xs, dens):
        mag.copy_(x.reshape(-1)).sub_(fb).abs_()  # the numbers of x.to(dt) - fb, in the reused buffer
        if trim_rule == "exact":
            v, q = tensor_trim_spec(mag[None], d, mask)
            thr.append(v[0])
            quotas.append(q[0])
        else:
            thr.append(magnitude_threshold(mag, d))
            quotas.append(TIE_ALL)
    return torch.stack(thr), quotas


# (key, base, experts) -> (thresholds, quotas, cut or None) of a key's trim (see ties_key_streamed)
KeyTrimSpec = Callable[[str, Tensor, list[Tensor]], tuple[Tensor, list[int], tuple[Tensor, list[int]] | None]]


def ties_from_task_vectors(models: ModelSet, tv_fn: TaskVectorFn, *, density: float, scaling: float,
                           trim_scope: str, merge_fn: str, trim_rule: str = "exact",
                           key_spec: KeyTrimSpec | None = None, densities: Sequence[float] | None = None,
                           weights: Sequence[float] | None = None) -> dict[str, Tensor]:
    """The TIES pipeline over any task-vector transform (plain for TIES, dropped-and-rescaled for DARE).

    ``key_spec`` (with plain task vectors): each key's trim from this function instead of ``density``, and the
    streamed kernel (Model Breadcrumbs' band of magnitudes: a trim minus a cut of outliers).

    ``densities``: one density per expert in place of ``density`` (expert ``t`` trimmed at its own).
    ``weights``: one weight per expert, each trimmed task vector multiplied by its weight before the sign
    election, and the disjoint mean weighted (:func:`_weighted_core`); ``None`` (the default) is the unweighted
    merge, through the streamed kernel.

    Zero elected signs are resolved as the reference code does (the majority sign over the whole model): keys
    are merged with sign +1 first; for the entries where the choice matters (a zero trimmed sum over nonzero
    values) the value under sign -1 is kept aside (positions and values only), and written over the output
    once the majority is known: no second read of the inputs.
    """
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    if trim_scope not in ("global", "per_tensor"):
        raise ValueError(f"trim_scope must be 'global' or 'per_tensor', got {trim_scope!r}")
    check_trim_rule(trim_rule)
    if models.base is None:
        raise ValueError("TIES needs base= (the pretrained parameters)")
    densities = _per_expert(densities, models.num_experts, "densities", 0.0)
    weights = _per_expert(weights, models.num_experts, "weights", None)
    if key_spec is not None and (densities is not None or weights is not None):
        # a key_spec's trim runs only in the streamed kernel, which takes no weights
        raise ValueError("key_spec takes neither densities nor weights")
    with input_dtype_arithmetic(models.narrow):  # a model-wide trim's pass, in the kernels' work dtype
        glob, gq, trim_key = _trim_fns(models, tv_fn, density, trim_scope, trim_rule, densities)
    total, fixes = [0.0], {}
    keep_all = density >= 1.0 if densities is None else min(densities) >= 1.0

    def merged(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        tvs = tv_fn(key, b, xs, list(range(len(xs))))
        # density 1 keeps every entry under both rules: no trimmed copy of the (T, *shape) stack
        flat = (tvs if keep_all else trim_key(key, tvs)).reshape(len(xs), -1)
        del tvs
        dtype = work_dtype(b.dtype)
        fb, out = b.reshape(-1), torch.empty(b.shape, dtype=dtype)
        w = None if weights is None else torch.tensor(weights, dtype=flat.dtype, device=flat.device)[:, None]
        parts = []
        # the election is elementwise: column blocks keep its temporaries small on a large key
        for i in range(0, fb.numel(), _BLOCK):
            if w is None:
                tau, sign_sum, fix = _ties_core(flat[:, i:i + _BLOCK], merge_fn, 1.0, collect=True)
            else:
                tau, sign_sum, fix = _weighted_core(flat[:, i:i + _BLOCK], w, merge_fn, collect=True)
            total[0] += sign_sum
            fbi = fb[i:i + _BLOCK].to(dtype)
            if fix is not None:
                parts.append(fix_values(fix[0] + i, fix[1].to(dtype), fbi[fix[0]], scaling, merge_fn, xs[0].dtype))
            out.view(-1)[i:i + _BLOCK] = fbi + scaling * tau.to(dtype)
        if parts:  # kept on the CPU, where the merged tensors are patched
            fixes[key] = tuple(None if p[0] is None else to_host(torch.cat(p)) for p in zip(*parts))
        return out

    if key_spec is not None and tv_fn is not plain_task_vectors:
        raise ValueError("key_spec needs plain task vectors")
    if tv_fn is plain_task_vectors and merge_fn in ("mean", "sum", "max") and weights is None:
        # elementwise once each expert's threshold is known (model-wide, or this key's, found one expert at a
        # time): cache-sized slices in preallocated buffers, never a (T, *shape) stack of a large tensor
        works: dict[torch.dtype, Work] = {}  # one set of buffers per work dtype (float32; float64 inputs)
        all_ties = [TIE_ALL] * models.num_experts
        bufs = Buffers()  # full-size buffers (the base in the work dtype, magnitudes), reused key to key

        def merged(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:  # noqa: F811
            # the model-wide thresholds were found in glob's dtype: compare in it (a key_spec's thresholds are
            # in the work dtype of the key's tensors, as the per-tensor ones)
            dt = work_dtype(b.dtype, *(x.dtype for x in xs), *(() if glob is None else (glob.dtype,)))
            fb = bufs.get("base", b.numel(), dt, b).copy_(b.reshape(-1))
            cut = None
            if key_spec is not None:
                thr, quotas, cut = key_spec(key, b, xs)
            elif glob is None:
                thr, quotas = per_tensor_trim_spec(b, xs, density if densities is None else densities, trim_rule,
                                                   bufs, fb)
            else:
                thr, quotas = like_device(glob, b), (all_ties if gq is None else gq[key])
            if dt not in works:
                # a GPU gains nothing from cache-sized slices: 16M-entry ones keep its launches few
                works[dt] = Work(models.num_experts, _CPU_CHUNK if b.device.type == "cpu" else _DEVICE_CHUNK, dt)
            res, sign_sum, fix = ties_key_streamed(b, xs, thr, quotas, scaling, merge_fn, works[dt], fb, cut)
            total[0] += sign_sum
            if fix is not None:  # kept on the CPU, where the merged tensors are patched
                fixes[key] = tuple(None if f is None else to_host(f) for f in fix)
            return res

    out = map_keys(models, merged, needs_base=True)
    majority = math.copysign(1.0, total[0]) if total[0] != 0 else 0.0
    if majority != 1.0:  # the ambiguous entries take the model-wide majority sign (-1, or 0: see _ties_core)
        for key, (pos, if_negative, if_zero) in fixes.items():
            out[key].view(-1)[pos.long()] = if_zero if merge_fn == "max" and majority == 0.0 else if_negative
    return out
