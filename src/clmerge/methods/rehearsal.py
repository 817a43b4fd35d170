"""``er``, ``der`` and ``derpp``: rehearsal from a fixed-size reservoir buffer (docs/rehearsal.md).

- ER (Chaudhry et al. 2019, "On Tiny Episodic Memories in Continual Learning"; Riemer et al. 2019): each step
  minimises the mean cross-entropy over the current batch and a batch drawn from the buffer,
  L = CE([x; x_M], [y; y_M]).
- DER (Buzzega et al., NeurIPS 2020, "Dark Experience for General Continual Learning", its DER objective): the
  buffer also keeps the logits z the model gave each example when it was inserted;
  L = CE(f(x), y) + alpha * ||f(x') - z'||^2 (as a mean squared error) over a buffer batch (x', z').
- DER++ (ibid., its DER++ objective): L_DER + beta * CE(f(x''), y'') over a second, independent buffer batch.

As in Mammoth (``models/er.py``, ``der.py``, ``derpp.py``, ``utils/buffer.py``) the buffer is filled by
reservoir sampling over every training example, after the optimizer step, and the stored logits are those of
the step's own forward pass.

``head_convention`` says which head these losses see:

- ``mammoth`` (default, Mammoth's): the head has an output for every class of the scenario from the first task
  on (Mammoth builds its backbone with ``num_classes = N_CLASSES``); every cross-entropy covers all outputs, so
  the logits of classes not yet seen are pushed down; DER stores the logits over all classes and its MSE holds
  all of them. Evaluation takes the argmax over the classes seen so far, as clmerge always does (and Mammoth's
  ``utils/evaluate.py``).
- ``grow``: the head grows by one block per task; every cross-entropy covers the classes seen so far
  (``head.loss: seen``); DER stores the logits of the classes its head had and pads them as ``logit_padding``
  says when the head grows. Buffer batches are drawn without replacement. Draws and insertions use
generators seeded from the method seed and the step count, so a resumed run repeats them exactly.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from ..config import ConfigError
from ..models.losses import classification_loss
from .base import ContinualMethod, MethodOptions, grid_rate, register_method
from .reservoir import ReservoirBuffer

__all__ = ["ER", "DER", "DERpp", "ReplayOptions", "DEROptions", "DERppOptions", "replay_generator", "logit_mse"]

_INSERT, _DRAW_LOGITS, _DRAW_LABELS = 0, 1, 2  # generator streams per step
_LOCAL_WITH_MAMMOTH = ("head.loss={}: method.head_convention=mammoth trains one cross-entropy over every output "
                       "of the full head; use head.loss=seen or method.head_convention=grow")
# the grid re-run under the full-size head (head_convention mammoth, the default), Adam, split_mnist5k seed 0
_MAMMOTH_SELECTED = "selected under head_convention mammoth: validation CIL {}"


class ReplayOptions(MethodOptions):
    buffer_size: int = Field(200, ge=1, description="examples the buffer holds (Mammoth's --buffer_size; "
                                                    "the papers report 200, 500 and 5120)")
    minibatch_size: int | None = Field(None, ge=1, description="buffer examples per step (None: train.batch_size,"
                                                               " Mammoth's default)")
    train_backbone: bool = Field(True, description="train every backbone parameter (false: head only)")
    head_convention: Literal["mammoth", "grow"] = Field(
        "mammoth", description="'mammoth' (Mammoth's code): a head with every class of the scenario from task 1, "
                               "cross-entropy over all outputs, DER's logits stored over all classes; 'grow': the "
                               "head grows per task, cross-entropy over the seen classes, stored logits padded "
                               "(logit_padding)")


class DEROptions(ReplayOptions):
    alpha: float = Field(0.3, ge=0, description="logit-replay weight (Mammoth's best for seq-CIFAR-10 at "
                                                "buffer 200 and 500: 0.3)")
    logit_padding: Literal["zero", "mask"] = Field(
        "zero", description="head_convention 'grow' only: classes added after an example was stored: 'zero' "
                            "compares their logits with 0; 'mask' leaves them out of the MSE ('mammoth' stores every "
                            "class, so there is nothing to pad)")


class DERppOptions(DEROptions):
    alpha: float = Field(0.1, ge=0, description="logit-replay weight (Mammoth's best for seq-CIFAR-10 at "
                                                "buffer 200: 0.1; 0.2 at 500)")
    beta: float = Field(0.5, ge=0, description="label-replay weight (Mammoth's best for seq-CIFAR-10: 0.5)")


def replay_generator(seed: int, step: int, stream: int) -> torch.Generator:
    """The generator of one step's insertion (stream 0) or buffer draw (streams 1, 2)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step * 7919 + stream * 104_729 + 1) % (2**63 - 1))


def logit_mse(out: torch.Tensor, stored: torch.Tensor, width: torch.Tensor, padding: str) -> torch.Tensor:
    """DER's ||f(x') - z'||^2 as a mean. ``stored`` rows hold ``width`` real logits then zeros; ``out`` has at
    least as many columns. ``mask``: the mean over the real entries; ``zero``: over every column of ``out``."""
    if padding == "zero":
        return F.mse_loss(out.float(), F.pad(stored, (0, out.shape[1] - stored.shape[1])))
    mask = torch.arange(stored.shape[1], device=stored.device) < width[:, None]
    sq = (out[:, : stored.shape[1]].float() - stored).pow(2) * mask
    return sq.sum() / mask.sum()


class _Replay(ContinualMethod):
    """The buffer, its insertion after each step, its draws, its checkpoint and its memory report."""

    head_defaults: ClassVar[dict[str, Any]] = {"loss": "seen"}  # replayed classes need their logits in the CE
    keeps_logits: ClassVar[bool] = False

    @classmethod
    def check_data(cls, options: ReplayOptions, n_train: int) -> None:
        """A buffer larger than the training set could never fill, and is allocated in full at the first
        insertion (``buffer_size`` rows of every field): refused before anything is built."""
        if options.buffer_size > n_train:
            raise ConfigError(f"method.buffer_size={options.buffer_size}: larger than the {n_train} training "
                              f"examples of the scenario (at most {n_train}); the buffer could never fill")

    @classmethod
    def fit_data(cls, options: ReplayOptions, n_train: int) -> ReplayOptions:
        """A buffer of at least the stream's length stores every example at the same slot and draws the same
        rows whatever its size: cut to ``n_train`` (an epoch's stream), the run is the same without the
        allocation."""
        if options.buffer_size <= n_train:
            return options
        return options.model_copy(update={"buffer_size": max(1, n_train)})

    @classmethod
    def check_head(cls, options: ReplayOptions, head) -> None:
        """``mammoth`` trains one cross-entropy over every output: ``head.loss: local`` contradicts it."""
        if options.head_convention == "mammoth" and head.loss != "seen":
            raise ConfigError(_LOCAL_WITH_MAMMOTH.format(head.loss))

    def __init__(self, options: ReplayOptions, *, seed: int = 0) -> None:
        super().__init__(options, seed=seed)
        self.buffer = ReservoirBuffer(options.buffer_size)
        self.step = 0
        self._pending: dict[str, torch.Tensor] | None = None

    def setup(self, model) -> None:
        model.backbone.requires_grad_(self.options.train_backbone)

    @property
    def full_head(self) -> bool:
        """Whether the head has every class of the scenario from the first task (``head_convention: mammoth``)."""
        return self.options.head_convention == "mammoth"

    def begin_task(self, task, ctx) -> None:
        """``mammoth``: the head gets every class of the scenario at the first task (one block; later tasks add
        nothing). ``grow``: the base duty alone, one block per task."""
        if not self.full_head:
            return
        if ctx.head_loss != "seen":  # a config is refused when parsed (check_head); a hand-built context here
            raise ConfigError(_LOCAL_WITH_MAMMOTH.format(ctx.head_loss))
        if ctx.n_outputs is None:
            raise RuntimeError("method.head_convention=mammoth needs the scenario's output count (TaskContext."
                               "n_outputs), which this caller did not give")
        self.model.head.ensure_classes(ctx.n_outputs, generator=ctx.generator)

    def width(self, logits: torch.Tensor, ctx) -> int:
        """The outputs the cross-entropies cover: all of them (``mammoth``), or the classes seen so far."""
        return logits.shape[1] if self.full_head else ctx.task.class_range[1]

    def current_loss(self, logits: torch.Tensor, y: torch.Tensor, ctx, reduction: str = "mean") -> torch.Tensor:
        """The current batch's cross-entropy: over every output (``mammoth``), or as ``head.loss`` says."""
        if self.full_head:
            return F.cross_entropy(logits, y, reduction=reduction)
        return classification_loss(logits, y, ctx.task, ctx.head_loss, reduction=reduction)

    def draw(self, stream: int, batch_size: int) -> dict[str, torch.Tensor] | None:
        """A buffer batch for this step from ``stream`` (None while the buffer is empty)."""
        if len(self.buffer) == 0:
            return None
        n = self.options.minibatch_size or batch_size
        return self.buffer.sample(n, replay_generator(self.seed, self.step, stream))

    def _stash(self, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor, ctx) -> None:
        """What ``after_step`` inserts: the batch, and for DER its logits over every output (``mammoth``) or over
        the classes seen so far (``grow``)."""
        self.buffer.to(x.device)
        self._pending = {"x": x.detach(), "y": y.detach()}
        if self.keeps_logits:
            hi = self.width(logits, ctx)
            self._pending["logits"] = logits[:, :hi].detach().float()
            self._pending["width"] = torch.full((len(x),), hi, dtype=torch.long, device=x.device)

    def after_step(self, model, ctx) -> None:
        if self._pending is not None:
            self.buffer.add(replay_generator(self.seed, self.step, _INSERT), **self._pending)
        self._pending = None
        self.step += 1

    def end_task(self, task, ctx) -> None:
        b = self.buffer
        self.record("buffer_bytes", b.nbytes())
        self.record("buffer_items", len(b))
        ctx.log({"event": "replay_buffer", "task": task.index, "bytes": b.nbytes(), "items": len(b),
                 "seen": b.n_seen, "size": b.size})

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"buffer/{k}": v for k, v in self.buffer.fields.items()}

    def state_meta(self) -> dict:
        return {**super().state_meta(), "replay": {"n_seen": self.buffer.n_seen, "step": self.step}}

    def load_state(self, tensors, meta) -> None:
        super().load_state(tensors, meta)
        self.buffer.fields = {k[len("buffer/"):]: v for k, v in tensors.items() if k.startswith("buffer/")}
        self.buffer.n_seen = int(meta["replay"]["n_seen"])
        self.step = int(meta["replay"]["step"])


@register_method
class ER(_Replay):
    name = "er"
    description = "experience replay: current batch plus a reservoir-buffer batch in one cross-entropy"
    Options = ReplayOptions
    optim_defaults, optim_source = grid_rate(3e-4, _MAMMOTH_SELECTED.format("75.25 at 3e-4 against 68.50, 71.50 at "
                                                                            "1e-4, 1e-3 (1e-4 under grow)"))

    def loss(self, model, x, y, ctx) -> torch.Tensor:
        buf = self.draw(_DRAW_LOGITS, ctx.batch_size)
        self._stash(x, y, None, ctx)
        if buf is None:
            return self.current_loss(model(x), y, ctx)
        logits = model(torch.cat([x, buf["x"]]))
        cur = self.current_loss(logits[: len(x)], y, ctx, reduction="none")
        old = F.cross_entropy(logits[len(x):, : self.width(logits, ctx)], buf["y"], reduction="none")
        return torch.cat([cur, old]).mean()


@register_method
class DER(_Replay):
    name = "der"
    description = "dark experience replay: cross-entropy plus MSE to the logits stored with buffer examples"
    Options = DEROptions
    keeps_logits = True
    optim_defaults, optim_source = grid_rate(3e-4, _MAMMOTH_SELECTED.format("50.00 at 3e-4 against 42.00, 27.50 at "
                                                                            "1e-4, 1e-3 (1e-4 under grow)"))

    def loss(self, model, x, y, ctx) -> torch.Tensor:
        logits = model(x)
        loss = self.current_loss(logits, y, ctx)
        self._stash(x, y, logits, ctx)
        buf = self.draw(_DRAW_LOGITS, ctx.batch_size)
        if buf is not None:
            out = model(buf["x"])
            if self.full_head:  # every class stored: the plain mean over all outputs (Mammoth's der.py)
                mse = F.mse_loss(out.float(), buf["logits"])
            else:
                mse = logit_mse(out, buf["logits"], buf["width"], self.options.logit_padding)
            loss = loss + self.options.alpha * mse
        return loss + self.label_replay(model, ctx)

    def label_replay(self, model, ctx) -> torch.Tensor | float:
        return 0.0


@register_method
class DERpp(DER):
    name = "derpp"
    description = "DER++: DER plus cross-entropy on the labels of a second buffer batch"
    Options = DERppOptions
    optim_defaults, optim_source = grid_rate(3e-4, _MAMMOTH_SELECTED.format("73.25 at 3e-4 against 64.50, 61.00 at "
                                                                            "1e-4, 1e-3 (3e-4 under grow too)"))

    def label_replay(self, model, ctx) -> torch.Tensor | float:
        buf = self.draw(_DRAW_LABELS, ctx.batch_size)
        if buf is None:
            return 0.0
        out = model(buf["x"])
        return self.options.beta * F.cross_entropy(out[:, : self.width(out, ctx)], buf["y"])
