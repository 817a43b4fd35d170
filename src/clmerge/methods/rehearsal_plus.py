"""``er_ace`` and ``xder``: two rehearsal methods built on ER's and DER++'s buffer (docs/classic_baselines.md).

- ER-ACE (Caccia et al., ICLR 2022, "New Insights on Reducing Abrupt Representation Change in Online Continual
  Learning"): ER with an asymmetric cross-entropy. From the second task on, the current batch's logits are
  masked to the classes present in the batch and the classes from the largest seen one upwards (Mammoth's
  ``models/er_ace.py``); the buffer batch keeps the full cross-entropy, and the two losses are added. The head
  is read as Mammoth's default cosine classifier (``classifier: cosine``; ``linear``: the linear head).
- X-DER (Boschini et al., TPAMI 2022, "Class-Incremental Continual Learning into the eXtended DER-verse"): DER++
  whose buffer is filled class-balanced at the end of each task, whose stored logits of past examples are
  rewritten with what the model says about the later heads (at the task boundary for every past example, and
  during a task online for the drawn ones), damped so that no rewritten logit exceeds ``gamma`` times the
  example's ground-truth logit, plus the future-heads margin constraint (Mammoth's ``models/xder.py``). The
  SimCLR consistency term on the future heads, its distance-preserving term and the batch-norm alignment are
  not implemented (docs/classic_baselines.md says where this differs).

Both reuse :class:`~clmerge.methods.rehearsal.ER`'s machinery: the reservoir buffer, its seeded draws, its
checkpoint and its memory report.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from ..config import ConfigError
from .base import grid_rate, register_method
from .rehearsal import ER, DERpp, DERppOptions, ReplayOptions, replay_generator

__all__ = ["ERACE", "ERACEOptions", "XDER", "XDEROptions", "ace_mask", "xder_damp", "cosine_logits",
           "CosineClassifier"]

_MASKED = -1e9  # Mammoth's masked logit (models/er_ace.py)
_DRAW_1, _DRAW_2, _END_TASK, _UPDATE = 1, 2, 3, 4  # generator streams (1, 2: DER++'s two buffer batches)


class ERACEOptions(ReplayOptions):
    task_free: bool = Field(False, description="mask and replay from the first task on (Mammoth's --task_free; "
                                               "default false: from the second task, as Mammoth's default)")
    classifier: Literal["cosine", "linear"] = Field(
        "cosine", description="'cosine': Mammoth's default classifier (--use_custom_classifier): scale 10 times the "
                              "cosine of features and head rows, no bias; 'linear': the library's linear head")


_COS_SCALE, _COS_EPS = 10.0, 1e-5  # Mammoth's CustomLinear (models/er_ace.py lines 15-33)


def cosine_logits(feats: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Mammoth's ``CustomLinear``: ``10 * cos(feats, rows of weight)``, each norm plus 1e-5, no bias."""
    f = feats / (torch.linalg.vector_norm(feats, dim=1, keepdim=True) + _COS_EPS)
    w = weight / (torch.linalg.vector_norm(weight, dim=1, keepdim=True) + _COS_EPS)
    return _COS_SCALE * f @ w.T


class CosineClassifier(nn.Module):
    """The model with its head read as Mammoth's cosine classifier (the head's biases unused)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.forward_features(x)

    def forward_head(self, feats: torch.Tensor) -> torch.Tensor:
        weight = torch.cat([b.weight for b in self.model.head.blocks])
        return cosine_logits(feats, weight.to(feats.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def ace_mask(n_outputs: int, present: torch.Tensor, seen_max: int) -> torch.Tensor:
    """ER-ACE's kept outputs: the classes ``present`` in the batch and every class from ``seen_max`` up."""
    keep = torch.zeros(n_outputs, dtype=torch.bool, device=present.device)
    keep[present] = True
    keep[seen_max:] = True
    return keep


@register_method
class ERACE(ER):
    name = "er_ace"
    description = "ER-ACE: experience replay with the asymmetric cross-entropy (current logits masked)"
    Options = ERACEOptions
    optim_defaults, optim_source = grid_rate(1e-4, "Adam, split_mnist5k seed 0: validation CIL 74.25 at 1e-4 "
                                                   "against 62.50, 74.00, 62.50 at 3e-5, 3e-4, 1e-3")

    def __init__(self, options: ERACEOptions, *, seed: int = 0) -> None:
        super().__init__(options, seed=seed)
        self.seen: list[int] = []  # classes seen in any training batch so far (Mammoth's seen_so_far)

    def _net(self, model) -> nn.Module:
        return CosineClassifier(model) if self.options.classifier == "cosine" else model

    def inference_model(self) -> nn.Module:
        return self._net(self.model)

    def loss(self, model, x, y, ctx) -> torch.Tensor:
        present = y.unique()
        self.seen = sorted(set(self.seen) | set(present.tolist()))
        net = self._net(model)
        logits = net(x)
        active = ctx.task.index > 0 or self.options.task_free
        if active:
            keep = ace_mask(logits.shape[1], present, max(self.seen))
            logits = logits.float().masked_fill(~keep, _MASKED)
        loss = self.current_loss(logits, y, ctx)
        self._stash(x, y, None, ctx)
        if active and len(self.buffer) > 0:
            buf = self.draw(_DRAW_1, ctx.batch_size)
            out = net(buf["x"])
            loss = loss + F.cross_entropy(out[:, : self.width(out, ctx)], buf["y"])
        return loss

    def state_meta(self) -> dict:
        meta = super().state_meta()
        meta["replay"]["seen"] = list(self.seen)
        return meta

    def load_state(self, tensors, meta) -> None:
        super().load_state(tensors, meta)
        self.seen = [int(c) for c in meta["replay"]["seen"]]


class XDEROptions(DERppOptions):
    alpha: float = Field(0.3, ge=0, description="logit-replay weight (Mammoth's best for seq-CIFAR-100 at "
                                                "buffer 500: 0.3)")
    beta: float = Field(0.8, ge=0, description="label-replay weight on the past heads (Mammoth's best for "
                                               "seq-CIFAR-100 at buffer 500: 0.8)")
    gamma: float = Field(0.85, ge=0, description="logit-update damping: a rewritten logit is at most gamma "
                                                  "times the example's ground-truth logit (Mammoth's --gamma)")
    constr_eta: float = Field(0.1, ge=0, description="weight of the past/future margin constraints "
                                                     "(Mammoth's --constr_eta)")
    constr_margin: float = Field(0.3, ge=0, description="margin of the constraints (Mammoth's --constr_margin)")
    future_constraint: bool = Field(True, description="future heads' max logit below the own head's by the "
                                                      "margin (Mammoth's --future_constraint, on by default)")
    past_constraint: bool = Field(False, description="current head's softmax max above the past heads' by the "
                                                     "margin (Mammoth's --past_constraint, off by default)")
    online_update: bool = Field(True, description="rewrite the future-head logits of drawn past examples during a "
                                                  "task, each with probability 1/(its draws this task)")
    head_convention: Literal["mammoth"] = Field(
        "mammoth", description="X-DER needs the future heads: only Mammoth's full-size head")


def _first_occurrences(idx: torch.Tensor) -> torch.Tensor:
    """True at the first occurrence of each slot in ``idx``."""
    seen: set[int] = set()
    keep = []
    for i in idx.tolist():
        keep.append(i not in seen)
        seen.add(i)
    return torch.tensor(keep, dtype=torch.bool)


def xder_damp(old: torch.Tensor, new: torch.Tensor, gt: torch.Tensor, lo: int, hi: int, gamma: float
              ) -> torch.Tensor:
    """Mammoth's ``update_logits``: ``old`` with its columns ``[lo, hi)`` replaced by ``new``'s, each row scaled by
    ``gamma * gt_logit / max`` where its max there exceeds its ground-truth logit in ``old``."""
    out = old.clone()
    part = new[:, lo:hi].clone()
    gt_val = old[torch.arange(len(gt), device=gt.device), gt]
    mx = part.max(1).values
    over = mx > gt_val
    part[over] = part[over] * (gamma * gt_val[over] / mx[over])[:, None]
    out[:, lo:hi] = part
    return out


@register_method
class XDER(DERpp):  # DER++'s buffer machinery; its loss and its buffer filling are X-DER's own
    name = "xder"
    description = "X-DER: DER++ with a class-balanced end-of-task buffer and future/past logit rewriting"
    Options = XDEROptions
    optim_defaults, optim_source = grid_rate(3e-4, "Adam, split_mnist5k seed 0: validation CIL 79.25 at 3e-4 "
                                                   "against 72.75, 62.00 at 1e-4, 1e-3")

    def __init__(self, options: XDEROptions, *, seed: int = 0) -> None:
        super().__init__(options, seed=seed)
        self.update_counter = torch.zeros(options.buffer_size)

    # -- class ranges ------------------------------------------------------------------------------------
    def _ranges(self, ctx, n_outputs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first and end output of each class's task (classes of tasks not seen yet: their own column)."""
        start, end = torch.arange(n_outputs), torch.arange(1, n_outputs + 1)
        prev = 0
        for t in ctx.seen_tasks:
            lo, hi = t.class_range
            if lo < prev:
                raise ConfigError("method.name=xder: class-incremental scenarios only (task "
                                  f"{t.index}'s outputs start at {lo}, inside an earlier task's)")
            start[lo:hi], end[lo:hi], prev = lo, hi, hi
        return start, end

    def _draw(self, stream: int, n: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A buffer batch and its slots (the reservoir buffer's draw, with the slots kept)."""
        idx = torch.randperm(len(self.buffer), generator=replay_generator(self.seed, self.step, stream))[:n]
        return idx, {k: v[idx.to(v.device)] for k, v in self.buffer.fields.items()}

    # -- training ----------------------------------------------------------------------------------------
    def loss(self, model, x, y, ctx) -> torch.Tensor:
        o = self.options
        lo, hi = ctx.task.class_range
        out = model(x)
        loss = F.cross_entropy(out[:, lo:hi], y - lo)  # the present head only (models/xder.py line 154)
        n_out = out.shape[1]
        buf_out = buf_y = None
        if len(self.buffer) > 0:
            n = o.minibatch_size or ctx.batch_size
            idx1, b1 = self._draw(_DRAW_1, n)
            out1 = model(b1["x"])
            loss = loss + o.alpha * F.mse_loss(out1.float(), b1["logits"])
            idx2, b2 = self._draw(_DRAW_2, n)
            out2 = model(b2["x"])
            if lo > 0:
                loss = loss + o.beta * F.cross_entropy(out2[:, :lo], b2["y"])
            idx = torch.cat([idx1, idx2])
            first = _first_occurrences(idx)  # the two batches' duplicates removed (lines 183-200)
            idx, buf_y = idx[first], torch.cat([b1["y"], b2["y"]])[first.to(b1["y"].device)]
            buf_out = torch.cat([out1, out2])[first.to(out1.device)]
            buf_logits = torch.cat([b1["logits"], b2["logits"]])[first.to(b1["logits"].device)]
            if o.online_update:
                self._online_update(idx, buf_y, buf_out.detach().float(), buf_logits, lo, n_out)
        if o.future_constraint and hi < n_out:
            bad, good = out[:, hi:], out[:, lo:hi]
            bad_max, good_max = bad.max(1).values, good.max(1).values
            if buf_out is not None:
                start, end = self._ranges(ctx, n_out)
                cols = torch.arange(n_out, device=buf_out.device)
                s, e = start.to(buf_out.device)[buf_y], end.to(buf_out.device)[buf_y]
                own = (cols >= s[:, None]) & (cols < e[:, None])
                bad_max = torch.cat([bad_max, buf_out[:, hi:].max(1).values])
                good_max = torch.cat([good_max, buf_out.masked_fill(~own, float("-inf")).max(1).values])
            gap = bad_max + o.constr_margin - good_max
            if (gap > 0).any():
                loss = loss + o.constr_eta * gap[gap > 0].mean()
        if o.past_constraint and lo > 0:
            p = F.softmax(out[:, :hi].float(), 1)
            gap = p[:, :lo].max(1).values.detach() + o.constr_margin - p[:, lo:hi].max(1).values
            if (gap > 0).any():
                loss = loss + o.constr_eta * gap[gap > 0].mean()
        return loss

    @torch.no_grad()
    def _online_update(self, idx, buf_y, buf_out, buf_logits, lo: int, n_out: int) -> None:
        """models/xder.py lines 202-213: a drawn past example's logits of the current and later heads are
        rewritten with probability 1 / (its draws this task)."""
        past = (buf_y < lo).cpu()
        cnt = self.update_counter
        cnt[idx[past]] += 1
        u = torch.rand(int(past.sum()), generator=replay_generator(self.seed, self.step, _UPDATE))
        chosen = past.clone()
        chosen[past] = u * cnt[idx[past]] < 1
        if chosen.any():
            dev = buf_logits.device
            new = xder_damp(buf_logits[chosen.to(dev)], buf_out[chosen.to(buf_out.device)],
                            buf_y[chosen.to(buf_y.device)], lo, n_out, self.options.gamma)
            store = self.buffer.fields["logits"]
            store[idx[chosen].to(store.device)] = new.to(store.device)

    # -- the buffer at the task boundary -------------------------------------------------------------------
    @torch.no_grad()
    def end_task(self, task, ctx) -> None:
        """models/xder.py lines 59-130: cut the past classes to an equal share, add the task's examples
        class-balanced (their past-head logits damped), rewrite the current and later heads' logits of every past
        example."""
        model, o = self.model, self.options
        lo, hi = task.class_range
        cpt = task.n_classes
        was = model.training
        model.eval()
        device = next(model.parameters()).device
        gen = replay_generator(self.seed, self.step, _END_TASK)
        if task.index > 0 and len(self.buffer):
            per_class = o.buffer_size // hi
            old = {k: v[: len(self.buffer)] for k, v in self.buffer.fields.items()}
            self.buffer = type(self.buffer)(o.buffer_size)
            for c in old["y"].unique().tolist():
                rows = (old["y"] == c).nonzero().flatten()[:per_class]
                self.buffer.add(gen, **{k: v[rows.to(v.device)] for k, v in old.items()})
        room = o.buffer_size - self.buffer.n_seen
        quota = torch.full((cpt,), room // cpt, dtype=torch.long)
        quota[torch.randperm(cpt, generator=gen)[: room - (room // cpt) * cpt]] += 1
        for x, y in task.train.batches(ctx.batch_size, shuffle=True, generator=gen):
            if bool((quota == 0).all()):
                break
            x, y = x.to(device), y.to(device)
            logits = model(x).float()
            if task.index > 0:
                logits = xder_damp(logits, logits, y, 0, lo, o.gamma)
            take = torch.zeros(len(y), dtype=torch.bool)
            for j, c in enumerate((y - lo).tolist()):
                if quota[c] > 0:
                    take[j], quota[c] = True, quota[c] - 1
            if take.any():
                t = take.to(device)
                self.buffer.add(gen, x=x[t], y=y[t], logits=logits[t])
        if task.index > 0:
            n = len(self.buffer)
            f = self.buffer.fields
            outs = torch.cat([model(f["x"][s: min(s + ctx.batch_size, n)]).float()
                              for s in range(0, n, ctx.batch_size)])
            past = f["y"][:n] < lo
            if past.any():
                f["logits"][:n][past] = xder_damp(f["logits"][:n][past], outs[past.to(outs.device)],
                                                  f["y"][:n][past], lo, outs.shape[1], o.gamma)
        self.update_counter = torch.zeros(o.buffer_size)
        model.train(was)
        super().end_task(task, ctx)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {**super().state_tensors(), "xder/update_counter": self.update_counter}

    def load_state(self, tensors, meta) -> None:
        super().load_state({k: v for k, v in tensors.items() if not k.startswith("xder/")}, meta)
        self.update_counter = tensors["xder/update_counter"].detach().cpu().clone()
