"""Diagonal Fisher information from per-sample gradients.

F_theta = (1/N) sum_i (d/d theta log p(y_i | x_i; theta))^2, with y_i the true label (empirical Fisher, the
form LoRA-P&M Eq. 9 and EWC use) or a label drawn from the model's own prediction (``true`` Fisher).
Each per-sample gradient is the gradient of that sample's own loss. Sums accumulate in float64.

Two ways to form the per-sample gradients (``diagonal_fisher(method=...)``):

- ``"hooks"``: for weights and biases of ``nn.Linear`` modules only. One forward and one backward of the
  summed loss per batch; forward hooks keep each layer's input a (B, T, in) and the backward gives the
  gradient g (B, T, out) of the summed loss w.r.t. its output, which for sample b is the gradient of b's own
  loss (samples do not interact in eval mode). Sample b's weight gradient is then ``sum_t g[b,t] a[b,t]^T``
  (``einsum('bto,bti->boi')``, its bias gradient ``sum_t g[b,t]``), summed over calls if the layer runs
  several times. :class:`~clmerge.adapters.lora.LoRALinear` layers run in ``lowrank`` mode during the pass, so
  their ``base_layer`` is called as a module.
- ``"func"``: ``torch.func`` (``vmap`` over ``grad``), any parameter.
- ``"auto"`` (default): ``hooks`` when every name is such a Linear weight or bias, else ``func``.

``per_sample_loop_fisher`` is the naive reference (one backward per sample), kept for tests and the speed
benchmark.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from ..utils.precision import full_precision

__all__ = [
    "diagonal_fisher",
    "eager_attention",
    "linear_param_modules",
    "per_sample_grads",
    "per_sample_grads_linear",
    "per_sample_loop_fisher",
    "resolve_fisher_method",
    "squared_sum",
]

FISHER_METHODS = ("auto", "hooks", "func")


@contextmanager
def eager_attention(model: nn.Module) -> Iterator[None]:
    """Temporarily set ``config._attn_implementation = 'eager'`` on every HF submodule config (a shared
    config once), restoring the saved values on exit: SDPA has no vmap batching rule on CPU and falls back
    to a per-sample loop, which defeats vectorised per-sample gradients (used here and by ``methods.pm``)."""
    configs = {id(m.config): m.config for m in model.modules()
               if hasattr(getattr(m, "config", None), "_attn_implementation")}
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
    """Gradients of the per-sample NLL w.r.t. the named parameters, shape (B, *param.shape) each.

    Vectorised (``vmap(grad)``) for float inputs. Token-id inputs (text backbones: their forward cuts padding
    and transformers checks the attention mask, data-dependent control flow that vmap cannot trace) take one
    backward pass per sample instead: the same gradients, slower.
    """
    named = dict(model.named_parameters())
    missing = [n for n in names if n not in named]
    if missing:
        raise KeyError(f"per_sample_grads: model has no parameters {missing[:5]}")
    if not x.is_floating_point():
        return _looped_per_sample_grads(model, names, x, y, logits_fn=logits_fn)
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


def _looped_per_sample_grads(model: nn.Module, names: list[str], x: torch.Tensor, y: torch.Tensor, *,
                             logits_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
                             ) -> dict[str, torch.Tensor]:
    """``{name: (B, *shape)}`` gradients of each sample's NLL, one backward pass per sample."""
    named = dict(model.named_parameters())
    call = logits_fn or (lambda m, inp: m(inp))
    wanted = [named[n] for n in names]
    saved = [p.requires_grad for p in wanted]
    out: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    try:
        for p in wanted:
            p.requires_grad_(True)
        for j in range(len(x)):
            loss = _nll(call(model, x[j:j + 1]), y[j:j + 1])
            for n, g in zip(names, torch.autograd.grad(loss, wanted, allow_unused=True)):
                out[n].append(torch.zeros_like(named[n]) if g is None else g.detach())
    finally:
        for p, r in zip(wanted, saved):
            p.requires_grad_(r)
    return {n: torch.stack(gs) for n, gs in out.items()}


def linear_param_modules(model: nn.Module, names: list[str]) -> dict[str, tuple[nn.Linear, str]] | None:
    """``{name: (Linear module, "weight" | "bias")}`` if every name is a weight or bias of an ``nn.Linear``
    of ``model``, else None."""
    modules = dict(model.named_modules())
    out = {}
    for n in names:
        mod_name, _, attr = n.rpartition(".")
        mod = modules.get(mod_name)
        if not isinstance(mod, nn.Linear) or attr not in ("weight", "bias") or getattr(mod, attr) is None:
            return None
        out[n] = (mod, attr)
    return out


def resolve_fisher_method(model: nn.Module, names: list[str], method: str = "auto") -> str:
    """``hooks`` or ``func`` for ``method`` (``auto``: hooks when every name is a Linear weight or bias)."""
    if method not in FISHER_METHODS:
        raise ValueError(f"unknown Fisher method {method!r} (expected one of {FISHER_METHODS})")
    if method == "auto":
        return "hooks" if linear_param_modules(model, names) is not None else "func"
    if method == "hooks" and linear_param_modules(model, names) is None:
        raise ValueError("Fisher method 'hooks' needs every parameter to be the weight or bias of an nn.Linear")
    return method


@contextmanager
def _lowrank_lora(model: nn.Module) -> Iterator[None]:
    """Run every LoRALinear of ``model`` in ``lowrank`` mode (its base_layer called as a module)."""
    from ..adapters.lora import LoRALinear

    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    saved = [m.compute for m in layers]
    try:
        for m in layers:
            m.compute = "lowrank"
        yield
    finally:
        for m, c in zip(layers, saved):
            m.compute = c


def per_sample_grads_linear(model: nn.Module, names: list[str], x: torch.Tensor, y: torch.Tensor, *,
                            logits_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
                            ) -> dict[str, torch.Tensor]:
    """Per-sample NLL gradients w.r.t. Linear weights/biases from layer inputs and output gradients.

    Same result as :func:`per_sample_grads` (shape (B, *param.shape) each) for the parameters it supports,
    from one forward and one backward of the summed loss. Parameter ``requires_grad`` flags and ``.grad``
    are left untouched.
    """
    params = linear_param_modules(model, names)
    if params is None:
        raise ValueError("per_sample_grads_linear: every name must be the weight or bias of an nn.Linear")
    mods = {id(m): m for m, _ in params.values()}
    records: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {k: [] for k in mods}
    handles = []

    def hook(mod, inp, out):
        if not out.requires_grad:  # frozen layer with a frozen input: make its output a leaf to get its gradient
            out = out.detach().requires_grad_(True)
        records[id(mod)].append((inp[0].detach(), out))
        return out

    for m in mods.values():
        handles.append(m.register_forward_hook(hook))
    try:
        with torch.enable_grad(), _lowrank_lora(model):
            out = logits_fn(model, x) if logits_fn else model(x)
            loss = _nll(out, y)
    finally:
        for h in handles:
            h.remove()
    order = [(k, i) for k, recs in records.items() for i in range(len(recs))]
    if any(not records[k] for k in records):
        raise RuntimeError("per_sample_grads_linear: a Linear layer was not called in the forward pass")
    grads = torch.autograd.grad(loss, [records[k][i][1] for k, i in order], allow_unused=True)
    batch = x.shape[0]
    per_mod: dict[int, dict[str, torch.Tensor]] = {}
    for (k, i), g in zip(order, grads):
        a = records[k][i][0]
        if g is None:
            g = torch.zeros_like(records[k][i][1])
        a3 = a.reshape(batch, -1, a.shape[-1])
        g3 = g.reshape(batch, -1, g.shape[-1])
        acc = per_mod.setdefault(k, {})
        gw = torch.bmm(g3.transpose(1, 2), a3)  # (B, out, in) = einsum('bto,bti->boi')
        gb = g3.sum(1)
        acc["weight"] = gw if "weight" not in acc else acc["weight"] + gw
        acc["bias"] = gb if "bias" not in acc else acc["bias"] + gb
    return {n: per_mod[id(m)][attr] for n, (m, attr) in params.items()}


_SQ_CHUNK = 1 << 18  # float64 elements per chunk of squared_sum (2 MiB: stays in cache)
_SQ_ALIGN = 64  # chunk widths are multiples of this many columns (see squared_sum)


def squared_sum(g: torch.Tensor, *, chunk: int = _SQ_CHUNK) -> torch.Tensor:
    """``g.double().pow(2).sum(0)``, bit for bit, without the (B, ...) float64 temporaries.

    ``g`` is a stack of per-sample gradients (B, *shape). The reference expression makes two float64 copies of
    it (hundreds of MB for a 800 x 3200 layer) and is memory-bound; here the columns are processed in
    cache-sized slices. Each output entry is still the sum over the B rows in the order torch's outer-dimension
    sum uses: the slices are contiguous (B, w) blocks whose width w is a multiple of ``_SQ_ALIGN`` columns, so
    every column falls in the same vectorised or tail loop of the reduction kernel as in the full tensor
    (checked against the reference in tests/params/test_fisher_sumsq.py). Non-contiguous, small or non-CPU inputs use
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


@full_precision
def diagonal_fisher(model: nn.Module, names: list[str], batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *,
                    mode: str = "empirical", logits_fn=None, generator: torch.Generator | None = None,
                    max_samples: int | None = None, method: str = "auto") -> dict[str, torch.Tensor]:
    """Mean of squared per-sample gradients over ``batches`` (float64 sums, returned as float32).

    Args:
        names: parameter names of ``model`` to compute the Fisher for.
        batches: iterable of (x, y) with y already mapped to the logits that ``logits_fn`` returns.
        logits_fn: ``(model, x) -> logits`` (default ``model(x)``), e.g. to restrict to one task's outputs.
        max_samples: stop after this many samples.
        method: ``hooks``, ``func`` or ``auto`` (module docstring); the results agree to float rounding.
    """
    method = resolve_fisher_method(model, names, method)
    psg = per_sample_grads_linear if method == "hooks" else per_sample_grads
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
        g = psg(model, names, x, labels, logits_fn=logits_fn)
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
