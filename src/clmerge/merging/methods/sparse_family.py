"""The sparsification family: sparsify each task vector, optionally elect signs, combine. One kernel, six rows.

Every member is ``theta_0 + lambda * combine_t(sparsify(tau_t))``, ``tau_t = theta_t - theta_0``, with

- a **sparsifier** (:class:`Sparsifier`): TIES's magnitude trim, DARE's random drop (:mod:`.dare`), DELLA's
  MAGPRUNE (a drop less likely for larger magnitudes), or Model Breadcrumbs' band of magnitudes (outliers and
  small entries cut);
- a **combine**: consensus (TIES's sign election and disjoint merge, :func:`.ties.ties_from_task_vectors`) or
  linear (``theta_0 + lambda sum_t`` of the sparsified task vectors).

:data:`ROWS` holds one row per registered method (name, description, sparsifier, sign election on or off, the
merge it fixes), in the style of mergekit's generalized task arithmetic (its ``merge_methods/registry.py``: one
class, methods as rows); :func:`sparse_merge` runs a row. Each public function below keeps its own keyword
signature, defaults and docstring (the registry reads the hyperparameters and their help from them) and is one
call of :func:`sparse_merge`.

The shared math stays where it was: the trim (:mod:`.trim`, :mod:`.ties_kernels`), the TIES engine
(:mod:`.ties`) and DARE's drop (:mod:`.dare`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ...utils.device import cpu_draw
from .dare import dare_generator, dare_sum_blocks, dare_tensor
from .driver import map_keys, row_blocks
from .registry import register_merge
from .sources import open_models
from .ties import KeyTrimSpec, TaskVectorFn, plain_task_vectors, ties_from_task_vectors
from .trim import TIE_ALL, keep_count, kth_smallest, top_magnitude_mask, work_dtype

__all__ = ["ties", "dare", "della", "della_linear", "breadcrumbs", "breadcrumbs_ties", "sparse_merge", "ROWS",
           "Row", "Sparsifier", "magprune_tensor", "magprune_drop_probabilities", "breadcrumbs_mask", "band_spec"]

KeyFn = Callable[[str, Tensor, list[Tensor]], Tensor]  # one key's merge: (key, base, experts) -> merged


class Consensus(NamedTuple):
    """What a sparsifier hands the TIES engine: the task vectors (plain or already sparsified) and the
    magnitude trim on top (``density = 1``: none; ``key_spec``: each key's trim from that function)."""

    tv_fn: TaskVectorFn
    density: float
    trim_scope: str
    trim_rule: str
    key_spec: KeyTrimSpec | None = None


@dataclass(frozen=True)
class Sparsifier:
    """One way of sparsifying task vectors, for both combines; each takes the hyperparameters ``hp``."""

    name: str
    check: Callable[[dict[str, Any]], None]  # a one-line ValueError for a bad hyperparameter, before any read
    consensus: Callable[[dict[str, Any]], Consensus]  # the input of the sign election
    linear: Callable[[dict[str, Any]], KeyFn] | None  # one key's theta_0 + lambda sum_t sparse(tau_t)


@dataclass(frozen=True)
class Row:
    """A registered method of the family.

    ``consensus``: TIES's sign election and disjoint merge (``True``) or the linear sum (``False``); a string
    names the hyperparameter that chooses (``dare``'s ``combine``: ``"ties"`` or ``"task_arithmetic"``).
    ``merge_fn``: the disjoint merge of the election when it is not a hyperparameter of the method.
    """

    name: str
    description: str
    sparsifier: Sparsifier
    consensus: bool | str
    merge_fn: str = "mean"


# -- the sparsifiers ----------------------------------------------------------------------------------------

def _no_check(hp: dict[str, Any]) -> None:
    return None


MAGNITUDE = Sparsifier(
    "magnitude", _no_check,  # the engine checks density, trim_scope and trim_rule
    lambda hp: Consensus(plain_task_vectors, hp["density"], hp["trim_scope"], hp["trim_rule"]),
    None)


def _check_drop(hp: dict[str, Any]) -> None:
    if not 0.0 <= hp["drop_rate"] < 1.0:
        raise ValueError(f"drop_rate must be in [0, 1), got {hp['drop_rate']}")
    for p in hp.get("drop_rates") or ():
        if not 0.0 <= float(p) < 1.0:
            raise ValueError(f"drop_rates: every value must be in [0, 1), got {p}")
    if hp["rescale_rule"] not in ("paper", "l1"):
        raise ValueError(f"rescale_rule must be 'paper' or 'l1', got {hp['rescale_rule']!r}")


def l1_rescale_(masked: Tensor, before: float) -> Tensor:
    """``masked`` times ``before / |masked|_1`` in place (``before``: the L1 norm of the tensor before masking),
    unless either norm is below 1e-7: mergekit's ``rescale: true`` (``rescaled_masked_tensor`` in
    ``mergekit/sparsify.py``, L1 norm)."""
    after = float(masked.abs().sum())
    if before >= 1e-7 and after >= 1e-7:
        masked.mul_(before / after)
    return masked


def _dropped(hp: dict[str, Any]) -> TaskVectorFn:
    """DARE's dropped-and-rescaled task vectors of one key (the input of its TIES)."""
    drop_rate, rescale, seed = hp["drop_rate"], hp["rescale"], hp["seed"]
    l1 = rescale and hp["rescale_rule"] == "l1"
    rates = hp.get("drop_rates")  # one per expert (a recipe's per-model drop_rate), else drop_rate for all

    def dropped(key: str, b: Tensor, xs: list[Tensor], idx: list[int]) -> Tensor:
        # written into one preallocated stack, each row in place (no per-expert full-size temporaries); float32,
        # or float64 for float64 inputs (TIES's trim then counts on these very numbers)
        dt = work_dtype(b.dtype, *(x.dtype for x in xs))
        out, fb = torch.empty((len(xs), *b.shape), dtype=dt), b.to(dt)
        for row, x, t in zip(out, xs, idx):
            torch.sub(x.to(dt), fb, out=row)
            before = float(row.abs().sum()) if l1 else 0.0
            dare_tensor(row, drop_rate if rates is None else _one_each(rates, len(xs), t, "drop_rates"),
                        rescale=rescale and not l1, generator=dare_generator(seed, key, t), out=row)
            if l1:
                l1_rescale_(row, before)
        return out

    return dropped


def _one_each(values: Sequence[float], n: int, t: int, name: str) -> float:
    """``values[t]`` of a per-expert list, checked to hold one value per expert (``n``)."""
    if len(values) != n:
        raise ValueError(f"{name} needs one value per expert ({n}), got {len(values)}")
    return float(values[t])


def _dare_sum_per_expert(hp: dict[str, Any]) -> KeyFn:
    """``theta_0 + lambda sum_t w_t DARE_{p_t}(tau_t)`` of one key: each expert's own drop rate ``p_t``
    (``drop_rates``) and weight ``w_t`` (``weights``), one expert's whole tensor at a time (mergekit's
    ``dare_linear`` with per-model ``density`` and ``weight``)."""
    seed, rescale, scaling = hp["seed"], hp["rescale"], hp["scaling"]
    l1 = rescale and hp["rescale_rule"] == "l1"

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        n = len(xs)
        rates = [hp["drop_rate"]] * n if hp.get("drop_rates") is None else hp["drop_rates"]
        ws = [1.0] * n if hp.get("weights") is None else hp["weights"]
        dt = work_dtype(b.dtype, *(x.dtype for x in xs))
        fb = b.to(dt)
        acc = torch.zeros(fb.shape, dtype=dt)
        for t, x in enumerate(xs):
            tv = x.to(dt) - fb
            before = float(tv.abs().sum()) if l1 else 0.0
            dare_tensor(tv, _one_each(rates, n, t, "drop_rates"), rescale=rescale and not l1,
                        generator=dare_generator(seed, key, t), out=tv)
            if l1:
                l1_rescale_(tv, before)
            acc.add_(tv, alpha=_one_each(ws, n, t, "weights"))
        return acc.mul_(scaling).add_(fb).to(xs[0].dtype)

    return kernel


def _dare_sum(hp: dict[str, Any]) -> KeyFn:
    """``theta_0 + lambda sum_t DARE(tau_t)`` of one key."""
    if hp.get("drop_rates") is not None or hp.get("weights") is not None:
        return _dare_sum_per_expert(hp)
    drop_rate, seed = hp["drop_rate"], hp["seed"]
    l1 = hp["rescale"] and hp["rescale_rule"] == "l1"
    factor = hp["scaling"] / (1.0 - drop_rate) if hp["rescale"] and not l1 else hp["scaling"]

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        # sum_t m_t * tau_t accumulated in float32 (float64 for float64 inputs); the 1/(1-p) rescale
        # applied once at the end
        dt = work_dtype(b.dtype, *(x.dtype for x in xs))
        gens = [dare_generator(seed, key, t) for t in range(len(xs))]
        if l1:  # a whole-tensor norm per expert: one expert's masked task vector at a time
            fb = b.to(dt)
            acc = torch.zeros(fb.shape, dtype=dt)
            for x, g in zip(xs, gens):
                tv = x.to(dt) - fb
                before = float(tv.abs().sum())
                acc.add_(l1_rescale_(dare_tensor(tv, drop_rate, rescale=False, generator=g, out=tv), before))
            return acc.mul_(factor).add_(fb).to(xs[0].dtype)
        if b.device.type == "cpu":
            return dare_sum_blocks(b, xs, gens, drop_rate, factor, dt)
        acc, fb, tv = torch.zeros(b.shape, dtype=dt), b.to(dt), torch.empty(b.shape, dtype=dt)
        for x, g in zip(xs, gens):
            # the mask as 0/1 in the random draw's own buffer, and one fused multiply-add: the same numbers
            # as ``acc += (x - b) * (rand >= p)`` (a product with 0 or 1 is exact) with two passes fewer
            keep = cpu_draw(torch.rand, x.shape, generator=g, like=x).ge_(drop_rate).to(dt)
            acc.addcmul_(tv.copy_(x).sub_(fb), keep)  # x - b in place: a mixed-dtype sub allocates x's copy
            del keep  # before the next draw: two draws alive at once would raise the peak by one tensor
        return acc.mul_(factor).add_(b)

    return kernel


RANDOM_DROP = Sparsifier(
    "random drop", _check_drop,
    lambda hp: Consensus(_dropped(hp), hp["density"], hp["trim_scope"], hp["trim_rule"]),
    _dare_sum)


def magprune_drop_probabilities(tv: Tensor, density: float, epsilon: float, window: str = "paper") -> Tensor:
    """MAGPRUNE's drop probabilities (DELLA Sec. 3.1), row by row, shape of ``tv``.

    A row is ``tv[i]`` flattened for a tensor of 2+ dims (one output unit), the whole tensor for a 1-D one.
    In a row of ``n`` entries, ``r_i`` is the rank of ``|tau_i|`` in descending order (0 = largest; ties to the
    lower index) and ``p_i = p_min + epsilon * r_i / n`` with ``p_min = (1 - density) - epsilon (n - 1) / (2n)``,
    so the mean drop probability is ``1 - density`` and larger magnitudes are dropped less often.

    ``window="mergekit"``: ``p_i = (1 - density) - epsilon / 2 + epsilon * r_i / (n - 1)`` (the ranks spread over
    the whole window, ``0`` for a one-entry row): mergekit's ``della_magprune`` (``mergekit/sparsify.py``), whose
    keep probabilities run over ``[density - e, density + e]`` with ``e = epsilon / 2``.
    """
    if tv.numel() == 0:
        return torch.zeros(tv.shape, dtype=torch.float64)
    rows = tv.reshape(1, -1) if tv.dim() < 2 else tv.reshape(tv.shape[0], -1)
    n = rows.shape[1]
    order = torch.sort(rows.abs(), dim=1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(n).expand_as(order))
    if window == "mergekit":
        spread = ranks.double() / (n - 1) if n > 1 else torch.zeros(ranks.shape, dtype=torch.float64)
        return ((1.0 - density) - epsilon / 2 + epsilon * spread).reshape(tv.shape)
    p_min = (1.0 - density) - epsilon * (n - 1) / (2 * n)
    return (p_min + epsilon * ranks.double() / n).reshape(tv.shape)


def magprune_tensor(tv: Tensor, density: float, epsilon: float, *, generator: torch.Generator,
                    window: str = "paper", rescale: str = "paper") -> Tensor:
    """MAGPRUNE on one tensor: keep ``tau_i`` with probability ``1 - p_i``, rescale kept entries by
    ``1 / (1 - p_i)`` (DELLA Eq. for the rescale; ``E[result] = tau``). Uniform draws as in ``dare_tensor``, so
    ``epsilon = 0`` reproduces DARE with ``drop_rate = 1 - density`` exactly.

    ``window``: the drop probabilities (:func:`magprune_drop_probabilities`). ``rescale``: ``"paper"`` (above),
    ``"l1"`` (mergekit's ``rescale: true``: the kept entries, not rescaled one by one, times
    ``|tau|_1 / |kept|_1`` over the whole tensor, unless either norm is below 1e-7: ``rescaled_masked_tensor``
    in ``mergekit/sparsify.py``) or ``"none"`` (the kept entries as they are). With ``window="mergekit"``,
    ``density >= 1`` returns ``tv`` as it is (mergekit).

    Computed in blocks of rows (:func:`.driver.row_blocks`; the ranks are per row and the generator's draws
    run on from block to block): the numbers of one whole-tensor pass, with temporaries of one block."""
    if window == "mergekit" and density >= 1.0:
        return tv.clone()
    out = torch.empty_like(tv)
    for rows in row_blocks(tv):
        out[rows] = _magprune_block(tv[rows], density, epsilon, generator, window, rescale)
    if rescale == "l1":
        l1_rescale_(out, float(tv.abs().sum()))
    return out


def _magprune_block(tv: Tensor, density: float, epsilon: float, generator: torch.Generator, window: str = "paper",
                    rescale: str = "paper") -> Tensor:
    # compared in float32, as DARE compares its draws with a float32 drop rate
    p = magprune_drop_probabilities(tv, density, epsilon, window).to(torch.float32)
    keep = cpu_draw(torch.rand, tv.shape, generator=generator, like=tv) >= p
    return (tv * keep / (1.0 - p) if rescale == "paper" else tv * keep).to(tv.dtype)


def _check_magprune(hp: dict[str, Any]) -> None:
    """A one-line error unless ``density`` and ``epsilon`` give drop probabilities in [0, 1]."""
    density, epsilon = hp["density"], hp["epsilon"]
    if hp["window"] not in ("paper", "mergekit"):
        raise ValueError(f"window must be 'paper' or 'mergekit', got {hp['window']!r}")
    if hp["rescale"] not in ("paper", "l1", "none"):
        raise ValueError(f"rescale must be 'paper', 'l1' or 'none', got {hp['rescale']!r}")
    if hp["window"] == "mergekit" and density >= 1.0:
        return  # mergekit keeps the task vector as it is
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    if epsilon < 0.0 or epsilon / 2 > min(density, 1.0 - density):
        raise ValueError(f"epsilon must be in [0, 2 * min(density, 1 - density)] = "
                         f"[0, {2 * min(density, 1.0 - density)}], got {epsilon}")


def _pruned(hp: dict[str, Any]) -> TaskVectorFn:
    """MAGPRUNE'd task vectors of one key (the input of DELLA's sign election)."""
    density, epsilon, seed = hp["density"], hp["epsilon"], hp["seed"]
    opts = {"window": hp["window"], "rescale": hp["rescale"]}

    def pruned(key: str, b: Tensor, xs: list[Tensor], idx: list[int]) -> Tensor:
        dt = work_dtype(b.dtype, *(x.dtype for x in xs))  # float32; float64 for float64 inputs
        return torch.stack([magprune_tensor(x.to(dt) - b.to(dt), density, epsilon,
                                            generator=dare_generator(seed, key, t), **opts)
                            for x, t in zip(xs, idx)])

    return pruned


def _magprune_sum(hp: dict[str, Any]) -> KeyFn:
    """``theta_0 + lambda * sum_t MAGPRUNE(tau_t)`` of one key, in blocks of rows (:func:`.driver.row_blocks`):
    MAGPRUNE ranks within a row, and each expert's generator is drawn block after block, which gives the very
    numbers of one draw over the whole tensor. So the result is bit-identical to the whole-tensor sum, with
    temporaries (the sort's indices and ranks, the float64 probabilities) of one block instead of one tensor
    each. Returned in the experts' dtype."""
    density, epsilon, scaling, seed = hp["density"], hp["epsilon"], hp["scaling"], hp["seed"]
    window, rescale = hp["window"], hp["rescale"]

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        dt = work_dtype(b.dtype, *(x.dtype for x in xs))
        gens = [dare_generator(seed, key, t) for t in range(len(xs))]
        if rescale == "l1":  # a whole-tensor norm: one expert's whole tensor at a time
            fb = b.to(dt)
            acc = torch.zeros(fb.shape, dtype=dt)
            for x, gen in zip(xs, gens):
                acc.add_(magprune_tensor(x.to(dt) - fb, density, epsilon, generator=gen, window=window,
                                         rescale=rescale))
            return acc.mul_(scaling).add_(fb).to(xs[0].dtype)
        out = torch.empty(b.shape, dtype=xs[0].dtype)
        for rows in row_blocks(b):
            fb = b[rows].to(dt)
            acc = torch.zeros(fb.shape, dtype=dt)
            for x, gen in zip(xs, gens):
                acc.add_(magprune_tensor(x[rows].to(dt) - fb, density, epsilon, generator=gen, window=window,
                                         rescale=rescale))
            out[rows] = acc.mul_(scaling).add_(fb)
        return out

    return kernel


MAGPRUNE = Sparsifier(
    "magprune", _check_magprune,
    # the drop is the whole sparsification: no magnitude trim on top (density 1), per tensor
    lambda hp: Consensus(_pruned(hp), 1.0, "per_tensor", "exact"),
    _magprune_sum)


def breadcrumbs_mask(tv: Tensor, density: float, beta: float) -> Tensor:
    """The breadcrumbs mask of one layer's task vector: entries ranked ``n_top + 1 .. n_top + n_keep`` by
    magnitude, with ``n_top = round(beta * n)`` outliers and ``n_keep = round(density * n)`` kept (halves up).

    Ranking is by ``|tau|`` descending, ties to the lower flat index (the exact-density rule of ``merging.trim``).
    If ``n_top + n_keep > n`` the outlier cut shrinks so that ``n_keep`` entries are kept (as mergekit).
    """
    mag = tv.abs()
    n = mag.numel()
    n_keep = keep_count(density, n)
    n_top = min(keep_count(beta, n), n - n_keep)
    return top_magnitude_mask(mag, n_top + n_keep) & ~top_magnitude_mask(mag, n_top)


def top_spec(mag: Tensor, k: int) -> tuple[Tensor, int]:
    """:func:`.trim.top_magnitude_mask` ``(mag, k)`` as a threshold and a tie quota: the mask is ``mag > v``
    plus the first ``quota`` entries equal to ``v`` (``TIE_ALL``: all of them). All kept: ``(-inf,
    TIE_ALL)``; none: ``(nan, 0)`` (nothing compares above NaN)."""
    n = mag.numel()
    if k >= n:
        return mag.new_tensor(-math.inf), TIE_ALL
    if k <= 0:
        return mag.new_tensor(math.nan), 0
    v = kth_smallest(mag.reshape(-1), n - k + 1)
    return v, k - int(torch.count_nonzero(mag > v))


def band_spec(key: str, b: Tensor, xs: list[Tensor], density: float,
              beta: float) -> tuple[Tensor, list[int], tuple[Tensor, list[int]]]:
    """The breadcrumbs masks of one key for the streamed TIES kernel (:func:`.ties_kernels.ties_key_streamed`):
    the trim keeps the top ``n_top + n_keep`` magnitudes, the cut removes the top ``n_top`` (as
    :func:`breadcrumbs_mask`). One expert's magnitudes at a time, ``x - b`` in :func:`.trim.work_dtype` as the
    kernel computes them."""
    dt = work_dtype(b.dtype, *(x.dtype for x in xs))
    fb = b.to(dt)
    lo: list[tuple[Tensor, int]] = []
    hi: list[tuple[Tensor, int]] = []
    for x in xs:
        mag = torch.sub(x.to(dt), fb).abs_()
        n = mag.numel()
        n_keep = keep_count(density, n)
        n_top = min(keep_count(beta, n), n - n_keep)
        lo.append(top_spec(mag, n_top + n_keep))
        hi.append(top_spec(mag, n_top))
        del mag
    return (torch.stack([v for v, _ in lo]), [q for _, q in lo],
            (torch.stack([v for v, _ in hi]), [q for _, q in hi]))


def _check_band(hp: dict[str, Any]) -> None:
    if not 0.0 <= hp["density"] <= 1.0:
        raise ValueError(f"density must be in [0, 1], got {hp['density']}")
    if not 0.0 <= hp["beta"] <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {hp['beta']}")


def _band_consensus(hp: dict[str, Any]) -> Consensus:
    density, beta = hp["density"], hp["beta"]

    def spec(key: str, b: Tensor, xs: list[Tensor]) -> tuple[Tensor, list[int], tuple[Tensor, list[int]]]:
        return band_spec(key, b, xs, density, beta)

    # the masks as thresholds found one expert at a time, then TIES's streamed kernel: the numbers of masking
    # whole (T, *shape) stacks, without the stacks
    return Consensus(plain_task_vectors, 1.0, "per_tensor", "exact", spec)


def _band_sum(hp: dict[str, Any]) -> KeyFn:
    """``theta_0 + alpha sum_t m_t tau_t`` of one key, ``m_t`` the breadcrumbs mask."""
    density, beta, scaling = hp["density"], hp["beta"], hp["scaling"]

    def kernel(key: str, b: Tensor, xs: list[Tensor]) -> Tensor:
        dtype = work_dtype(b.dtype)
        b32 = b.to(dtype)
        acc = torch.zeros_like(b32)
        for x in xs:
            tv = x.to(dtype) - b32
            acc.add_(tv * breadcrumbs_mask(tv, density, beta))
        return acc.mul_(scaling).add_(b32)

    return kernel


BAND = Sparsifier("band", _check_band, _band_consensus, _band_sum)


# -- the rows and the one kernel ----------------------------------------------------------------------------

ROWS: dict[str, Row] = {r.name: r for r in (
    Row("ties", "trim small task-vector entries, elect a sign per entry, average the agreeing ones",
        MAGNITUDE, consensus=True),
    Row("dare", "randomly drop task-vector entries and rescale the rest, then task arithmetic or TIES",
        RANDOM_DROP, consensus="combine"),
    Row("della", "MAGPRUNE (drop small task-vector entries more often, rescale), then TIES's sign election and "
        "disjoint mean", MAGPRUNE, consensus=True),
    Row("della_linear", "MAGPRUNE (drop small task-vector entries more often, rescale), then the scaled sum of "
        "the task vectors (mergekit's della_linear)", MAGPRUNE, consensus=False),
    Row("breadcrumbs", "per layer, mask each task vector's top-beta outliers and small entries, then task "
        "arithmetic", BAND, consensus=False),
    Row("breadcrumbs_ties", "per layer, mask each task vector's top-beta outliers and small entries, then TIES's "
        "sign election (mergekit's breadcrumbs_ties)", BAND, consensus=True),
)}

_COMBINES = {"ties": True, "task_arithmetic": False}


def _elects(row: Row, hp: dict[str, Any]) -> bool:
    if isinstance(row.consensus, bool):
        return row.consensus
    choice = hp[row.consensus]
    if choice not in _COMBINES:
        raise ValueError(f"{row.consensus} must be 'task_arithmetic' or 'ties', got {choice!r}")
    return _COMBINES[choice]


def sparse_merge(name: str, base: Any, experts: Sequence[Any], **hp: Any) -> dict[str, Tensor]:
    """Run the row ``name`` of :data:`ROWS` with the hyperparameters ``hp`` (all of the method's, defaults
    filled in): check them, then the sparsifier's task vectors through TIES's sign election and disjoint merge
    (consensus rows), or each key's ``theta_0 + lambda sum_t`` of the sparsified task vectors (linear rows)."""
    row = ROWS[name]
    row.sparsifier.check(hp)
    models = open_models(base, experts)
    if _elects(row, hp):
        c = row.sparsifier.consensus(hp)
        return ties_from_task_vectors(models, c.tv_fn, density=c.density, scaling=hp["scaling"],
                                      trim_scope=c.trim_scope, merge_fn=hp.get("merge_fn", row.merge_fn),
                                      trim_rule=c.trim_rule, key_spec=c.key_spec,
                                      densities=hp.get("densities"), weights=hp.get("weights"))
    if row.sparsifier.linear is None:
        raise ValueError(f"{name}: the {row.sparsifier.name} sparsifier has no linear combine")
    return map_keys(models, row.sparsifier.linear(hp), needs_base=True)


def _registered(fn: Callable[..., dict[str, Tensor]]) -> Callable[..., dict[str, Tensor]]:
    """Register ``fn`` under its row (name and description from :data:`ROWS`)."""
    row = ROWS[fn.__name__]
    return register_merge(row.name, row.description)(fn)


# -- the registered methods: each one row of the kernel -----------------------------------------------------

@_registered
def ties(*, base: Any, experts: Sequence[Any], density: float = 0.2, scaling: float = 1.0,
         trim_scope: str = "global", merge_fn: str = "mean", trim_rule: str = "exact",
         densities: Sequence[float] | None = None, weights: Sequence[float] | None = None) -> dict[str, Tensor]:
    """TIES-merging, Yadav et al. 2023, Eq. / Alg. 1: ``theta_0 + lambda * tau_m``.

    1. trim: ``tau_hat_t`` keeps the top-``density`` magnitudes of ``tau_t`` (others set to 0);
    2. elect: ``gamma = sgn(sum_t tau_hat_t)``;
    3. disjoint mean: ``tau_m = mean_{t: sgn(tau_hat_t) = gamma} tau_hat_t``.

    Args:
        density: fraction of each task vector kept (paper's ``k``: 20%).
        scaling: ``lambda`` (paper: 1.0 works well; select on validation).
        trim_scope: ``"global"`` (top-k over the whole task vector: the TIES paper and FusionBench) or
            ``"per_tensor"`` (top-k within each tensor: mergekit).
        merge_fn: ``"mean"`` (paper), ``"sum"`` or ``"max"``.
        trim_rule: ``"exact"`` (keep exactly ``round(density*n)`` entries, ties broken by key order then flat
            index) or ``"threshold"`` (keep ``|tau| >= thr``, the TIES / FusionBench code); see ``merging.trim``.
        densities: one density per expert, each task vector trimmed at its own (a recipe's per-model
            ``density``; mergekit's per-model ``density``); replaces ``density``.
        weights: one weight per expert (a recipe's per-model ``weight``): each trimmed task vector times its
            weight before the sign election, and the agreeing entries' weighted sum over their weights' sum
            (``mean``), their weighted sum (``sum``) or the largest weighted magnitude (``max``): mergekit's
            per-model ``weight`` (``normalize: true`` is ``mean``). Unset: every weight 1.
    """
    return sparse_merge("ties", base, experts, density=density, scaling=scaling, trim_scope=trim_scope,
                        merge_fn=merge_fn, trim_rule=trim_rule, densities=densities, weights=weights)


@_registered
def dare(*, base: Any, experts: Sequence[Any], drop_rate: float = 0.5, rescale: bool = True, seed: int = 0,
         combine: str = "task_arithmetic", scaling: float = 0.3, density: float = 1.0,
         trim_scope: str = "global", trim_rule: str = "exact", merge_fn: str = "mean",
         rescale_rule: str = "paper", drop_rates: Sequence[float] | None = None,
         weights: Sequence[float] | None = None) -> dict[str, Tensor]:
    """DARE: ``tau~_t = m_t * tau_t / (1 - p)``, ``m_t ~ Bernoulli(1 - p)`` elementwise, then ``combine``.

    The drop is a random Bernoulli mask as in the paper (and mergekit): the number of dropped entries is
    ``p * n`` only on average, not exactly. ``density`` / ``trim_rule`` govern only TIES's magnitude trim.

    Args:
        drop_rate: ``p``, the fraction of entries dropped.
        rescale: divide the kept entries by ``1 - p`` (the paper; ``False`` is plain random pruning).
        seed: the random masks depend only on (seed, key, expert index).
        combine: ``"task_arithmetic"`` (``theta_0 + lambda sum_t tau~_t``) or ``"ties"``.
        scaling: ``lambda``.
        density, trim_scope, trim_rule: TIES's trim when ``combine="ties"`` (``density=1``: sign election
            only); see ``ties``.
        merge_fn: the merge of the entries that agree with the elected sign when ``combine="ties"``: ``"mean"``
            (TIES's disjoint mean), ``"sum"`` (mergekit's ``dare_ties``, whose ``normalize`` is false by
            default) or ``"max"``.
        rescale_rule: with ``rescale``, ``"paper"`` (each kept entry divided by ``1 - p``: unbiased, the DARE
            paper) or ``"l1"`` (the kept entries times the tensor's ``|tau|_1 / |kept|_1``: mergekit's
            ``rescale: true`` for ``dare_ties`` / ``dare_linear``; a mergekit config sets it).
        drop_rates: one drop rate per expert (a recipe's per-model ``drop_rate``; mergekit's per-model
            ``density`` is ``1 - p``); replaces ``drop_rate``.
        weights: one weight per expert (a recipe's per-model ``weight``; mergekit's per-model ``weight``):
            ``theta_0 + lambda sum_t w_t tau~_t`` (``task_arithmetic``), or, with ``combine="ties"``, the
            dropped task vectors weighted before the sign election as in ``ties``'s ``weights``. Unset: 1.
    """
    return sparse_merge("dare", base, experts, drop_rate=drop_rate, rescale=rescale, seed=seed, combine=combine,
                        scaling=scaling, density=density, trim_scope=trim_scope, trim_rule=trim_rule,
                        merge_fn=merge_fn, rescale_rule=rescale_rule, drop_rates=drop_rates, weights=weights)


@_registered
def della(*, base: Any, experts: Sequence[Any], density: float = 0.5, epsilon: float = 0.2, scaling: float = 1.0,
          seed: int = 0, window: str = "paper", rescale: str = "paper", merge_fn: str = "mean") -> dict[str, Tensor]:
    """DELLA-Merging, Deep et al. 2024: Drop (MAGPRUNE, :func:`magprune_drop_probabilities`), Elect
    (``gamma = sgn(sum_t tau~_t)``), Fuse (mean of the entries that agree with ``gamma``), then
    ``theta_0 + lambda * tau_m``.

    mergekit's ``della`` gives keep probabilities in ``[density - epsilon, density + epsilon]`` (a window of
    ``2 epsilon``, ranks scaled by ``n - 1``); the paper's ``epsilon``, used here, is the whole window width, so
    mergekit's ``epsilon = e`` is about ``epsilon = 2e`` here.

    Args:
        density: mean fraction kept, ``1 - p`` (p: the mean drop probability).
        epsilon: width of the window of drop probabilities around ``1 - density`` (0: DARE's uniform drop);
            needs ``epsilon / 2 <= density`` and ``epsilon / 2 <= 1 - density``.
        scaling: ``lambda`` applied to the merged task vector.
        seed: the random masks depend only on (seed, key, expert index), as DARE's.
        window: ``"paper"`` (drop probabilities ``p_min + epsilon r_i / n``) or ``"mergekit"`` (ranks spread over
            the whole window, ``r_i / (n - 1)``; density 1 keeps the task vector): see
            :func:`magprune_drop_probabilities`.
        rescale: ``"paper"`` (each kept entry times ``1 / (1 - p_i)``: unbiased, DELLA), ``"l1"`` (the kept
            entries times the tensor's ``|tau|_1 / |kept|_1``: mergekit's ``rescale: true``) or ``"none"``.
        merge_fn: ``"mean"`` (the paper's disjoint mean; mergekit's ``normalize: true``), ``"sum"`` or ``"max"``.
    """
    return sparse_merge("della", base, experts, density=density, epsilon=epsilon, scaling=scaling, seed=seed,
                        window=window, rescale=rescale, merge_fn=merge_fn)


@_registered
def della_linear(*, base: Any, experts: Sequence[Any], density: float = 0.5, epsilon: float = 0.2,
                 scaling: float = 1.0, seed: int = 0, window: str = "paper",
                 rescale: str = "paper") -> dict[str, Tensor]:
    """DELLA's Drop step (Deep et al. 2024, MAGPRUNE; see :func:`della`) with task arithmetic in place of the
    sign election: ``theta_0 + lambda * sum_t tau~_t`` (mergekit's ``della_linear``: no consensus, no
    normalisation). ``density = 1`` (with ``epsilon = 0``) is task arithmetic.

    Args:
        density: mean fraction kept, ``1 - p``.
        epsilon: width of the window of drop probabilities around ``1 - density`` (about twice mergekit's
            ``epsilon``, see :func:`della`).
        scaling: ``lambda`` (mergekit's per-model ``weight`` times its ``lambda``, both 1 by default).
        seed: the random masks depend only on (seed, key, expert index): the same masks as ``della``.
        window, rescale: as in :func:`della` (``"mergekit"``, ``"l1"``: mergekit's rule).
    """
    return sparse_merge("della_linear", base, experts, density=density, epsilon=epsilon, scaling=scaling,
                        seed=seed, window=window, rescale=rescale)


@_registered
def breadcrumbs(*, base: Any, experts: Sequence[Any], density: float = 0.1, beta: float = 0.01,
                scaling: float = 0.3) -> dict[str, Tensor]:
    """Model Breadcrumbs, Davari & Belilovsky 2023 (Sec. 3): ``theta = theta_0 + alpha * sum_t m_t * tau_t``
    where, in every layer, the mask ``m_t`` removes the top-``beta`` fraction of ``|tau_t|`` (outliers) and the
    smallest entries, keeping exactly ``round(density * n)`` entries (see :func:`breadcrumbs_mask`).

    ``beta = 0`` and ``density = 1`` is task arithmetic. mergekit's ``breadcrumbs`` calls ``beta`` ``gamma`` and
    counts with ``int()``: ``int(density*n)`` kept, ``int(gamma*n)`` outliers.

    Args:
        density: fraction of each layer's task vector kept (the rest of the bottom is masked).
        beta: fraction of each layer's largest-magnitude entries masked as outliers (mergekit's ``gamma``,
            default 0.01 there too).
        scaling: ``alpha``, the task-arithmetic coefficient (tune on validation data).
    """
    return sparse_merge("breadcrumbs", base, experts, density=density, beta=beta, scaling=scaling)


@_registered
def breadcrumbs_ties(*, base: Any, experts: Sequence[Any], density: float = 0.1, beta: float = 0.01,
                     scaling: float = 1.0, merge_fn: str = "sum") -> dict[str, Tensor]:
    """The breadcrumbs mask (Davari & Belilovsky 2023, :func:`breadcrumbs_mask`) in place of TIES's trim, then
    TIES's Elect and merge (Yadav et al. 2023): ``theta_0 + lambda * tau_m``, ``tau_m`` over the masked task
    vectors whose sign agrees with ``gamma = sgn(sum_t m_t tau_t)``.

    mergekit's ``breadcrumbs_ties`` sums the agreeing entries (its ``normalize`` is false by default), hence
    ``merge_fn="sum"``; ``"mean"`` is TIES's disjoint mean. With ``beta = 0`` this is ``ties`` with
    ``trim_scope="per_tensor"`` and the same density and ``merge_fn``. Zero sums take the model-wide majority
    sign, as ``ties`` (mergekit: ``+``).

    Args:
        density: fraction of each layer's task vector kept.
        beta: fraction of each layer's largest magnitudes masked as outliers (mergekit's ``gamma``, 0.01).
        scaling: ``lambda`` (mergekit's per-model ``weight``).
        merge_fn: ``"sum"`` (mergekit's default), ``"mean"`` (TIES's disjoint mean) or ``"max"``.
    """
    return sparse_merge("breadcrumbs_ties", base, experts, density=density, beta=beta, scaling=scaling,
                        merge_fn=merge_fn)
