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

__all__ = ["build_optimizer", "build_scheduler", "fit", "loss_interval", "LOSS_POINTS"]

LOSS_POINTS = 40  # about this many step-loss records per fit call when no interval is given


def build_optimizer(groups: list[dict], cfg: OptimConfig, *, lr: float | None = None) -> torch.optim.Optimizer:
    """SGD / Adam / AdamW over parameter groups; a group named ``head`` gets ``cfg.head_lr`` if set."""
    lr = lr if lr is not None else cfg.lr
    groups = [dict(g) for g in groups if g["params"]]
    if not groups:
        raise ValueError("no trainable parameters: the method froze everything")
    for g in groups:
        if g.get("name") == "head" and cfg.head_lr is not None:
            g["lr"] = cfg.head_lr
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


class _StepLosses:
    """Sample-weighted mean training loss over each interval of ``every`` steps, logged as ``step`` events."""

    def __init__(self, log: Callable[[dict], None] | None, every: int, task: int | None, phase: str) -> None:
        self.log, self.every, self.task, self.phase = log, every, task, phase
        self.step, self.total, self.n, self.count = 0, 0.0, 0, 0

    def add(self, loss: float, batch: int, epoch: int, lr: float) -> None:
        self.step += 1
        self.total, self.n, self.count = self.total + loss * batch, self.n + batch, self.count + 1
        if self.count >= self.every:
            self.flush(epoch, lr)

    def flush(self, epoch: int, lr: float) -> None:
        if self.log is not None and self.count:
            self.log({"event": "step", "task": self.task, "phase": self.phase, "epoch": epoch, "step": self.step,
                      "steps": self.count, "loss": self.total / max(self.n, 1), "lr": lr})
        self.total, self.n, self.count = 0.0, 0, 0


def _optimizer_step(model: nn.Module, loss: torch.Tensor, opt: torch.optim.Optimizer, sched, params: list,
                    grad_clip: float | None, before_step: Callable[[nn.Module], None] | None,
                    after_step: Callable[[nn.Module], None] | None) -> None:
    """Backward, the method's hooks around the update, optional clipping, one optimizer and scheduler step."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if before_step is not None:
        before_step(model)
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    opt.step()
    sched.step()
    if after_step is not None:
        after_step(model)


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
) -> dict:
    """Train ``model`` on ``data`` (a ``TaskData``) for ``epochs``; return ``{"losses": [...], "seconds": s}``.

    ``log`` receives one ``epoch`` event per epoch (mean loss) and one ``step`` event per ``log_every``
    optimizer steps (mean loss over those steps; default: :func:`loss_interval`). With ``progress``, a bar
    per epoch on a terminal, else one line per epoch on stderr (:mod:`clmerge.utils.progress`).
    """
    opt = build_optimizer(groups, optim, lr=lr)
    steps = data.num_batches(batch_size)
    if max_steps_per_epoch is not None:
        steps = min(steps, max_steps_per_epoch)
    sched = build_scheduler(opt, optim, epochs, steps)
    params = [p for g in opt.param_groups for p in g["params"]]
    losses, t0 = [], time.time()
    step_losses = _StepLosses(log, loss_interval(epochs * steps, log_every), task_index, desc)
    model.train()
    for epoch in range(epochs):
        total, n, te = 0.0, 0, time.time()
        batches = data.batches(batch_size, shuffle=True, generator=generator, max_batches=steps)
        bar = Progress(batches, total=steps, desc=f"{desc} epoch {epoch + 1}/{epochs}", leave=False, enabled=progress)
        for x, y in bar:
            x, y = x.to(device), y.to(device)
            loss = loss_fn(model, x, y)
            if not torch.isfinite(loss):
                raise TrainingError(f"{desc}: loss is {loss.item()} at epoch {epoch + 1}; lower optim.lr?")
            _optimizer_step(model, loss, opt, sched, params, optim.grad_clip, before_step, after_step)
            value = float(loss.detach())
            total += value * len(x)
            n += len(x)
            step_losses.add(value, len(x), epoch + 1, opt.param_groups[0]["lr"])
        losses.append(total / max(n, 1))
        seconds = time.time() - te
        bar.line(f"{desc} epoch {epoch + 1}/{epochs} loss {losses[-1]:.4g} ({seconds:.1f} s)")
        if epoch == epochs - 1:
            step_losses.flush(epoch + 1, opt.param_groups[0]["lr"])  # the last, shorter interval
        if log is not None:
            log({"event": "epoch", "task": task_index, "phase": desc, "epoch": epoch + 1, "loss": losses[-1],
                 "lr": opt.param_groups[0]["lr"], "seconds": round(seconds, 3)})
    model.eval()
    return {"losses": losses, "seconds": time.time() - t0}
