"""Diagonal Fisher information from per-sample gradients (``torch.func``: ``vmap`` over ``grad``).

F_theta = (1/N) sum_i (d/d theta log p(y_i | x_i; theta))^2, with y_i the true label (empirical Fisher, the
form LoRA-P&M Eq. 9 and EWC use) or a label drawn from the model's own prediction (``true`` Fisher).
Sums accumulate in float64. ``per_sample_loop_fisher`` is the naive reference (one backward per sample), kept
for tests and the speed benchmark.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

__all__ = ["per_sample_grads", "diagonal_fisher", "per_sample_loop_fisher", "eager_attention", "squared_sum"]


@contextmanager
def eager_attention(model: nn.Module) -> Iterator[None]:
    """Temporarily switch HF attention to the eager kernel: SDPA has no vmap batching rule on CPU and falls
    back to a per-sample loop, which defeats vectorised per-sample gradients."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")}
    saved = {k: c._attn_implementation for k, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = "eager"
        yield
    finally:
        for k, c in configs.items():
            c._attn_implementation = saved[k]

LogitFn = Callable[[torch.Tensor], torch.Tensor]


def _nll(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, y, reduction="sum")


def per_sample_grads(model: nn.Module, names: list[str], x: torch.Tensor, y: torch.Tensor, *,
                     logits_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Gradients of the per-sample NLL w.r.t. the named parameters, shape (B, *param.shape) each."""
    named = dict(model.named_parameters())
    missing = [n for n in names if n not in named]
    if missing:
        raise KeyError(f"per_sample_grads: model has no parameters {missing[:5]}")
    params = {n: named[n].detach() for n in names}
    frozen = {n: p.detach() for n, p in named.items() if n not in params}
    buffers = dict(model.named_buffers())
    call = logits_fn or (lambda m, inp: m(inp))

    class _Bound(nn.Module):  # lets logits_fn see the functional model
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, inp: torch.Tensor) -> torch.Tensor:
            return call(self.inner, inp)

    bound = _Bound(model)

    def loss_one(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        state = {**{f"inner.{k}": v for k, v in p.items()}, **{f"inner.{k}": v for k, v in frozen.items()},
                 **{f"inner.{k}": v for k, v in buffers.items()}}
        out = functional_call(bound, state, (xi.unsqueeze(0),))
        return _nll(out, yi.unsqueeze(0))

    with eager_attention(model):
        return vmap(grad(loss_one), in_dims=(None, 0, 0), randomness="different")(params, x, y)


_SQ_CHUNK = 1 << 18  # float64 elements per chunk of squared_sum (2 MiB: stays in cache)
_SQ_ALIGN = 64  # chunk widths are multiples of this many columns (see squared_sum)


def squared_sum(g: torch.Tensor, *, chunk: int = _SQ_CHUNK) -> torch.Tensor:
    """``g.double().pow(2).sum(0)``, bit for bit, without the (B, ...) float64 temporaries.

    ``g`` is a stack of per-sample gradients (B, *shape). The reference expression makes two float64 copies of
    it (hundreds of MB for a 800 x 3200 layer) and is memory-bound; here the columns are processed in
    cache-sized slices. Each output entry is still the sum over the B rows in the order torch's outer-dimension
    sum uses: the slices are contiguous (B, w) blocks whose width w is a multiple of ``_SQ_ALIGN`` columns, so
    every column falls in the same vectorised or tail loop of the reduction kernel as in the full tensor
    (checked against the reference in tests/test_fisher_sumsq.py). Non-contiguous, small or non-CPU inputs use
    the reference expression itself. (With several CPU threads the reference splits its columns across threads,
    which moves some columns into the tail loop; the chunks here are too small to be split, so the result is the
    one-thread reference's.)
    """
    if g.dim() < 2 or not g.is_contiguous() or g.device.type != "cpu":
        return g.double().pow(2).sum(0)
    flat = g.view(g.shape[0], -1)
    m = flat.shape[1]
    step = max(_SQ_ALIGN, (chunk // max(1, flat.shape[0])) // _SQ_ALIGN * _SQ_ALIGN)
    if m <= step:
        return g.double().pow(2).sum(0)
    out = torch.empty(m, dtype=torch.float64, device=g.device)
    for a in range(0, m, step):
        out[a:a + step] = flat[:, a:a + step].double().pow_(2).sum(0)
    return out.view(g.shape[1:])


def _labels(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str, generator, logits_fn) -> torch.Tensor:
    if mode == "empirical":
        return y
    if mode == "true":
        with torch.no_grad():
            logits = logits_fn(model, x) if logits_fn else model(x)
            return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)
    raise ValueError(f"unknown Fisher mode {mode!r} (expected 'empirical' or 'true')")


def diagonal_fisher(model: nn.Module, names: list[str], batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *,
                    mode: str = "empirical", logits_fn=None, generator: torch.Generator | None = None,
                    max_samples: int | None = None) -> dict[str, torch.Tensor]:
    """Mean of squared per-sample gradients over ``batches`` (float64 sums, returned as float32).

    Args:
        names: parameter names of ``model`` to compute the Fisher for.
        batches: iterable of (x, y) with y already mapped to the logits that ``logits_fn`` returns.
        logits_fn: ``(model, x) -> logits`` (default ``model(x)``), e.g. to restrict to one task's outputs.
        max_samples: stop after this many samples.
    """
    sums = {n: None for n in names}
    count = 0
    was_training = model.training
    model.eval()
    for x, y in batches:
        if max_samples is not None:
            x, y = x[: max_samples - count], y[: max_samples - count]
        if len(x) == 0:
            break
        labels = _labels(model, x, y, mode, generator, logits_fn)
        g = per_sample_grads(model, names, x, labels, logits_fn=logits_fn)
        for n in names:
            sq = squared_sum(g[n])  # == g[n].double().pow(2).sum(0), bit for bit
            sums[n] = sq if sums[n] is None else sums[n] + sq
        count += len(x)
        if max_samples is not None and count >= max_samples:
            break
    model.train(was_training)
    if count == 0:
        raise ValueError("diagonal_fisher: no samples")
    return {n: (s / count).float() for n, s in sums.items()}


def per_sample_loop_fisher(model: nn.Module, names: list[str], batches, *, logits_fn=None) -> dict[str, torch.Tensor]:
    """Reference: one forward/backward per sample (slow; for tests and benchmarks)."""
    named = dict(model.named_parameters())
    sums = {n: torch.zeros_like(named[n], dtype=torch.float64) for n in names}
    count = 0
    for x, y in batches:
        for i in range(len(x)):
            model.zero_grad(set_to_none=True)
            out = logits_fn(model, x[i : i + 1]) if logits_fn else model(x[i : i + 1])
            _nll(out, y[i : i + 1]).backward()
            for n in names:
                sums[n] += named[n].grad.double().pow(2)
            count += 1
    model.zero_grad(set_to_none=True)
    return {n: (s / count).float() for n, s in sums.items()}
