"""The training loop of one task (also used by methods for inner loops such as HALRP's warm-up)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import nn
from ..config import OptimConfig
from ..errors import TrainingError
from ..utils.progress import Progress
from . import distributed
from ..utils.precision import autocast, grad_scaler

__all__ = ["build_optimizer", "build_scheduler", "fit", "loss_interval", "LOSS_POINTS"]

LOSS_POINTS = 40  # about this many step-loss records per fit call when no interval is given


def build_optimizer(groups: list[dict], cfg: OptimConfig, *, lr: float | None = None) -> torch.optim.Optimizer:
    """SGD / Adam / AdamW over parameter groups; a group named ``head`` gets ``cfg.head_lr`` if set, a group
    with ``lr_scale`` that fraction of the head's lr (``cfg.head_lr``, else ``lr``: SLCA's slow backbone)."""
    lr = lr if lr is not None else cfg.lr
    groups = [dict(g) for g in groups if g["params"]]
    if not groups:
        raise ValueError("no trainable parameters: the method froze everything")
    head_lr = cfg.head_lr if cfg.head_lr is not None else lr
    for g in groups:
        if g.get("name") == "head" and cfg.head_lr is not None:
            g["lr"] = cfg.head_lr
        if "lr_scale" in g:
            g["lr"] = head_lr * g.pop("lr_scale")
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.name == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(groups, lr=lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def build_scheduler(opt: torch.optim.Optimizer, cfg: OptimConfig, epochs: int, steps_per_epoch: int):
    """Per-step LambdaLR: linear warm-up over ``warmup_epochs``, then constant / cosine / multistep."""
    total = max(1, epochs * steps_per_epoch)
    warm = cfg.warmup_epochs * steps_per_epoch

    def factor(step: int) -> float:
        w = min(1.0, (step + 1) / warm) if warm else 1.0
        if cfg.schedule == "cosine":
            return w * 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))
        if cfg.schedule == "multistep":
            epoch = step // max(1, steps_per_epoch)
            return w * cfg.gamma ** sum(epoch >= m for m in cfg.milestones)
        return w

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def loss_interval(total_steps: int, every: int | None = None) -> int:
    """Optimizer steps per ``step`` loss record: ``every`` if given, else enough for ~``LOSS_POINTS`` records.

    With ``every=None`` a call of ``total_steps`` steps gives between ``LOSS_POINTS / 2`` and ``LOSS_POINTS``
    records (fewer only when it has fewer steps than that).
    """
    if every is not None:
        return max(1, int(every))
    return max(1, math.ceil(total_steps / LOSS_POINTS))


class _LossSum:
    """Sample-weighted loss terms kept as device tensors and read once per interval: reading a GPU loss every
    step (``float(loss)``) would make the CPU wait for the GPU at every step. In a data-parallel run each
    process holds its share-weighted terms and the read sums them over processes."""

    def __init__(self, reduce: Callable[[float], float] | None) -> None:
        self.reduce, self.terms, self.n = reduce, [], 0

    def add(self, weighted: torch.Tensor, batch: int) -> None:
        self.terms.append(weighted)
        self.n += batch

    def read(self) -> tuple[float, int]:
        """``(mean loss, samples)`` of the terms since the last read (one device sync), then reset."""
        total = float(torch.stack(self.terms).sum()) if self.terms else 0.0
        if self.reduce is not None:
            total = self.reduce(total)
        n, self.terms, self.n = self.n, [], 0
        return total / max(n, 1), n


class _StepLosses:
    """Sample-weighted mean training loss over each interval of ``every`` steps, logged as ``step`` events."""

    def __init__(self, log: Callable[[dict], None] | None, every: int, task: int | None, phase: str,
                 reduce: Callable[[float], float] | None = None) -> None:
        self.log, self.every, self.task, self.phase = log, every, task, phase
        self.step, self.count, self.sum = 0, 0, _LossSum(reduce)

    def add(self, weighted: torch.Tensor, batch: int, epoch: int, lr: float, desc: str) -> None:
        self.step += 1
        self.count += 1
        self.sum.add(weighted, batch)
        if self.count >= self.every:
            self.flush(epoch, lr, desc)

    def flush(self, epoch: int, lr: float, desc: str) -> None:
        if not self.count:
            return
        loss, _ = self.sum.read()
        _check_finite(loss, desc, epoch, self.step - self.count + 1, self.step)
        if self.log is not None:
            self.log({"event": "step", "task": self.task, "phase": self.phase, "epoch": epoch, "step": self.step,
                      "steps": self.count, "loss": loss, "lr": lr})
        self.count = 0


def _check_finite(loss: float, desc: str, epoch: int, first: int, last: int) -> None:
    if not math.isfinite(loss):
        raise TrainingError(f"{desc}: loss is {loss} at epoch {epoch} (steps {first}-{last}); lower optim.lr?")


def _optimizer_step(model: nn.Module, loss: torch.Tensor, opt: torch.optim.Optimizer, sched, params: list,
                    grad_clip: float | None, before_step: Callable[[nn.Module], None] | None,
                    after_step: Callable[[nn.Module], None] | None, scaler: torch.amp.GradScaler | None = None,
                    sync: Callable[[list], None] | None = None, grads: dict | None = None) -> None:
    """Backward, gradient all-reduce (data-parallel runs), the method's hooks around the update, optional
    clipping, one optimizer and scheduler step. With an fp16 ``scaler`` the gradients are unscaled before the
    hooks and the clipping (they see true gradients) and a step with inf/nan gradients is skipped. ``grads``:
    gradients already taken (no backward)."""
    opt.zero_grad(set_to_none=True)
    scaled = scaler is not None and scaler.is_enabled()
    if grads is not None:  # taken before a first step changed the parameters (:func:`_first_step`; never fp16)
        for p, g in grads.items():
            p.grad = g
    elif scaled:
        scaler.scale(loss).backward()
    else:
        loss.backward()
    if sync is not None:
        sync(params)
    if scaled:
        scaler.unscale_(opt)
    _hook_and_clip(model, params, before_step, grad_clip)
    if scaled:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    sched.step()
    if after_step is not None:
        after_step(model)


def _hook_and_clip(model: nn.Module, params: list, hook: Callable[[nn.Module], None] | None,
                   grad_clip: float | None) -> None:
    """The method's gradient hook, then the optional norm clipping: what every update does before its step."""
    if hook is not None:
        hook(model)
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)


def _first_step(model: nn.Module, loss: torch.Tensor, first: torch.Tensor, opt: torch.optim.Optimizer,
                params: list, grad_clip: float | None, before_first: Callable[[nn.Module], None] | None,
                scaler, sync) -> dict:
    """A method's first step of a batch (``first_step_loss``): the batch loss's gradients are taken first, at
    the same parameters, then ``first`` gets its own backward, hook and optimizer step (no scheduler step: the
    batch still counts once). Returns the batch loss's gradients for the step after it."""
    if scaler is not None and scaler.is_enabled():
        raise TrainingError("a method with two optimizer steps per batch (first_step_loss) does not run with "
                            "run.precision=fp16; use bf16 or fp32")
    live = [p for p in params if p.requires_grad]
    taken = torch.autograd.grad(loss, live, allow_unused=True)
    opt.zero_grad(set_to_none=True)
    first.backward()
    if sync is not None:
        sync(params)
    _hook_and_clip(model, params, before_first, grad_clip)
    opt.step()
    return {p: g for p, g in zip(live, taken) if g is not None}


def fit(
    model: nn.Module,
    data,
    *,
    groups: list[dict],
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
    optim: OptimConfig,
    epochs: int,
    batch_size: int,
    generator: torch.Generator,
    device: torch.device,
    lr: float | None = None,
    before_step: Callable[[nn.Module], None] | None = None,
    after_step: Callable[[nn.Module], None] | None = None,
    max_steps_per_epoch: int | None = None,
    log: Callable[[dict], None] | None = None,
    desc: str = "train",
    progress: bool = False,
    task_index: int | None = None,
    log_every: int | None = None,
    precision: str = "fp32",
    first_loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None,
    before_first_step: Callable[[nn.Module], None] | None = None,
) -> dict:
    """Train ``model`` on ``data`` (a ``TaskData``) for ``epochs``; return ``{"losses": [...], "seconds": s}``.

    ``log`` receives one ``epoch`` event per epoch (mean loss) and one ``step`` event per ``log_every``
    optimizer steps (mean loss over those steps; default: :func:`loss_interval`). With ``progress``, a bar
    per epoch on a terminal, else one line per epoch on stderr (:mod:`clmerge.utils.progress`).

    ``precision`` (``run.precision``): the forward pass and the loss run under autocast for bf16/fp16, with a
    loss scaler for fp16 (:mod:`.precision`). In a data-parallel run (:mod:`.distributed`) each process
    takes its shard of every batch, its loss is weighted by its share of the batch and the gradients are summed
    over processes, so the update is that of the whole batch.
    """
    opt = build_optimizer(groups, optim, lr=lr)
    steps = data.num_batches(batch_size)
    if max_steps_per_epoch is not None:
        steps = min(steps, max_steps_per_epoch)
    sched = build_scheduler(opt, optim, epochs, steps)
    params = [p for g in opt.param_groups for p in g["params"]]
    losses, t0 = [], time.time()
    scaler, dp = grad_scaler(precision, device), distributed.active()
    reduce = dp.sum_scalar if dp is not None else None
    acc_dtype = torch.float32 if torch.device(device).type == "mps" else torch.float64  # (MPS has no float64)
    step_losses = _StepLosses(log, loss_interval(epochs * steps, log_every), task_index, desc, reduce)
    model.train()
    for epoch in range(epochs):
        epoch_sum, te = _LossSum(reduce), time.time()
        part = None if dp is None else (dp.rank, dp.world)
        batches = data.batches(batch_size, shuffle=True, generator=generator, max_batches=steps, part=part)
        bar = Progress(zip(data.batch_sizes(batch_size, steps), batches), total=steps,
                       desc=f"{desc} epoch {epoch + 1}/{epochs}", leave=False, enabled=progress)
        for n_batch, (x, y) in bar:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            first = None
            if len(x) == 0:  # an empty share: zero gradients, so that the all-reduce still matches
                loss = sum((p * 0).sum() for p in params)
            else:
                with autocast(precision, device):
                    loss = loss_fn(model, x, y)
                    first = first_loss_fn(model, x, y) if first_loss_fn is not None else None
            if dp is not None:  # this share's mean loss, weighted by its share: gradients then sum over ranks
                loss = loss * (len(x) / n_batch)
                first = None if first is None else first * (len(x) / n_batch)
            sync = dp.all_reduce_grads if dp is not None else None
            grads = None
            if len(x) and first is not None:
                grads = _first_step(model, loss, first, opt, params, optim.grad_clip, before_first_step, scaler,
                                    sync)
            _optimizer_step(model, loss, opt, sched, params, optim.grad_clip, before_step, after_step, scaler,
                            sync, grads)
            weighted = loss.detach().to(acc_dtype) * n_batch  # read once per interval, not per step
            epoch_sum.add(weighted, n_batch)
            step_losses.add(weighted, n_batch, epoch + 1, opt.param_groups[0]["lr"], desc)
        mean, _ = epoch_sum.read()
        _check_finite(mean, desc, epoch + 1, 1, steps)
        losses.append(mean)
        seconds = time.time() - te
        bar.line(f"{desc} epoch {epoch + 1}/{epochs} loss {losses[-1]:.4g} ({seconds:.1f} s)")
        if epoch == epochs - 1:
            step_losses.flush(epoch + 1, opt.param_groups[0]["lr"], desc)  # the last, shorter interval
        if log is not None:
            log({"event": "epoch", "task": task_index, "phase": desc, "epoch": epoch + 1, "loss": losses[-1],
                 "lr": opt.param_groups[0]["lr"], "seconds": round(seconds, 3)})
    model.eval()
    return {"losses": losses, "seconds": time.time() - t0}
