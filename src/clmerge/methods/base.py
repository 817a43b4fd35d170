"""The method protocol (mammoth's hooks, minus the plumbing) and the method registry.

The engine owns the optimizer step, schedules, logging, evaluation and checkpoints. A method only says how
the model changes around a task (``setup``, ``begin_task``, ``end_task``), what is trained
(``parameter_groups``), what the loss is (``loss``), optionally what happens to gradients (``before_step``),
which model is evaluated (``inference_model``), and what it must remember across tasks (``state_tensors`` /
``state_meta``, saved in every checkpoint).

Hooks that change the model's *structure* (add LoRA components, grow the head) must be deterministic given
the task, because a resumed run rebuilds the structure from the checkpoint (see ``adapters.structure``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from ..config import set_method_registry
from ..data.scenarios import Task
from ..models.classifier import ContinualClassifier
from ..models.losses import classification_loss
from ..registry import Registry
from ..utils.precision import full_precision

__all__ = [
    "MethodOptions",
    "TaskContext",
    "ContinualMethod",
    "register_method",
    "available_methods",
    "method_options_model",
    "build_method",
    "method_class",
    "METHODS",
    "VALIDATION_GRID",
    "grid_rate",
]


class MethodOptions(BaseModel):
    """Base for a method's options: unknown keys are errors; every field documents its paper source."""

    # nan/inf are never meaningful option values: refused with the key
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


@dataclass
class TaskContext:
    """What a hook may use: the task, earlier tasks, device, RNG, the head loss mode, an event logger."""

    task: Task
    seen_tasks: list[Task]
    device: torch.device
    generator: torch.Generator
    head_loss: str = "local"
    batch_size: int = 64
    eval_batch_size: int = 500
    n_tasks: int | None = None  # length of the task sequence (InfLoRA's DualGPM threshold schedule)
    n_outputs: int | None = None  # head outputs of the whole scenario (a head sized for every class from task 1)
    log: Callable[[dict], None] = field(default=lambda event: None)
    fit: Callable[..., dict] | None = None  # engine.training.fit bound to this run (for warm-ups, inner loops)


class ContinualMethod:
    """Base class with default hooks. Subclasses set ``name``, ``description`` and ``Options``."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Options: ClassVar[type[MethodOptions]] = MethodOptions
    # ``head:`` keys this method sets unless the user sets them (a method owns its head: config.parse_config)
    head_defaults: ClassVar[dict[str, Any]] = {}
    # ``optim:`` keys this method trains with unless the config sets them (a method owns its rate, as it owns
    # its head: config.parse_config). A config that sets a key (a file, ``--set optim.lr=...``) always wins.
    optim_defaults: ClassVar[dict[str, Any]] = {}
    # where ``optim_defaults`` come from: "paper", "official code", or the validation grid that selected them
    # (shown by ``clmerge methods -v``); "" where the method declares none (simplecil, ranpac: they train nothing)
    optim_source: ClassVar[str] = ""
    # False: a statistics method; the model's linear head is never trained, so it cannot be the evaluated head
    trains_linear_head: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs) -> None:
        """Every method's ``begin_task`` and ``end_task`` run with autocast off: the statistics they compute
        (Fisher, alpha sums, covariances, SVD bases, importance, task-vector folds) stay fp32 whatever
        ``run.precision`` is and whoever calls them (:mod:`clmerge.utils.precision`).

        What the base hooks guarantee does not depend on a subclass calling ``super()``: an overriding
        ``setup`` finds ``self.model`` set already, and after an overriding ``begin_task`` the head covers the
        task's outputs (both no-ops for a subclass that does call ``super()``)."""
        super().__init_subclass__(**kwargs)
        for hook in ("begin_task", "end_task"):
            fn = cls.__dict__.get(hook)
            if fn is not None and not getattr(fn, "_full_precision", False):
                wrapped = full_precision(fn)
                wrapped._full_precision = True
                setattr(cls, hook, wrapped)
        _wrap_base_duties(cls)

    @classmethod
    def check_data(cls, options: MethodOptions, n_train: int) -> None:
        """Refuse options that cannot fit a scenario of ``n_train`` training examples (all tasks together),
        before the method is built or anything is allocated (``engine.setup.prepare``); raise a
        :class:`~clmerge.config.ConfigError` naming the key, its value and the limit. Default: nothing to
        check."""

    @classmethod
    def check_head(cls, options: MethodOptions, head) -> None:
        """Refuse ``head:`` values (``head``: the config's head section) that contradict the method's options,
        when the config is parsed, before anything is written: raise a :class:`~clmerge.config.ConfigError`
        naming both keys. Default: nothing to check."""

    @classmethod
    def fit_data(cls, options: MethodOptions, n_train: int) -> MethodOptions:
        """``options`` cut to a scenario of ``n_train`` training examples where that changes nothing the run
        computes (a dry run's small sample: a replay buffer holds at most the examples it sees). Default:
        ``options`` as they are."""
        return options

    def __init__(self, options: MethodOptions, *, seed: int = 0) -> None:
        self.options = options
        self.seed = seed
        self.model: ContinualClassifier | None = None
        self._metrics: dict[str, Any] = {}

    # -- structure ---------------------------------------------------------------------------------------
    def setup(self, model: ContinualClassifier) -> None:
        """Called once on the freshly built model (e.g. inject LoRA layers, freeze the backbone)."""
        self.model = model

    def begin_task(self, task: Task, ctx: TaskContext) -> None:
        """Default: grow the head to cover the task's outputs."""
        _grow_head(self, task, ctx)

    # -- training ----------------------------------------------------------------------------------------
    def parameter_groups(self, model: nn.Module) -> list[dict]:
        """Trainable parameters, the head in its own group (``optim.head_lr`` applies to it)."""
        head_ids = {id(p) for p in model.head.parameters()}
        body = [p for p in model.parameters() if p.requires_grad and id(p) not in head_ids]
        head = [p for p in model.head.parameters() if p.requires_grad]
        groups = [{"params": body, "name": "body"}] if body else []
        return groups + ([{"params": head, "name": "head"}] if head else [])

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, ctx: TaskContext) -> torch.Tensor:
        return classification_loss(model(x), y, ctx.task, ctx.head_loss)

    def before_step(self, model: nn.Module, ctx: TaskContext) -> None:
        """After ``backward``, before ``optimizer.step`` (gradient projection lives here)."""

    def after_step(self, model: nn.Module, ctx: TaskContext) -> None:
        """After ``optimizer.step``."""

    def first_step_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                        ctx: TaskContext) -> torch.Tensor | None:
        """A second loss of the batch that gets its own optimizer step, before the step on ``loss`` (None, the
        default: no such step). Both losses' gradients are taken at the parameters before either step
        (CL-LoRA's distillation step)."""
        return None

    def before_first_step(self, model: nn.Module, ctx: TaskContext) -> None:
        """After the backward of ``first_step_loss``, before its optimizer step."""

    def end_task(self, task: Task, ctx: TaskContext) -> None:
        """After training on ``task`` (Fisher estimates, merges, folding)."""

    def inference_model(self) -> nn.Module:
        return self.model

    # -- memory across tasks -------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def state_meta(self) -> dict:
        return {"metrics": self._metrics}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self._metrics = dict(meta.get("metrics", {}))

    def metrics(self) -> dict:
        """Method-specific values for ``metrics.json`` (e.g. P&M's alpha per task)."""
        return dict(self._metrics)

    def record(self, key: str, value: Any) -> None:
        """Append ``value`` to the list ``metrics()[key]``."""
        self._metrics.setdefault(key, []).append(value)


def _wrap_base_duties(cls: type[ContinualMethod]) -> None:
    """Wrap ``cls``'s own ``setup`` (bind the model first) and ``begin_task`` (grow the head after)."""
    setup, begin = cls.__dict__.get("setup"), cls.__dict__.get("begin_task")
    if setup is not None and not getattr(setup, "_binds_model", False):
        @functools.wraps(setup)
        def bound_setup(self, model, *args, **kwargs):
            self.model = model
            return setup(self, model, *args, **kwargs)

        bound_setup._binds_model = True
        cls.setup = bound_setup
    if begin is not None and not getattr(begin, "_grows_head", False):
        @functools.wraps(begin)
        def growing_begin(self, task, ctx, *args, **kwargs):
            out = begin(self, task, ctx, *args, **kwargs)
            _grow_head(self, task, ctx)
            return out

        growing_begin._grows_head = growing_begin._full_precision = True
        cls.begin_task = growing_begin


def _grow_head(method: ContinualMethod, task: Task, ctx: TaskContext) -> None:
    """The base ``begin_task``'s duty: the head covers ``task``'s outputs (idempotent)."""
    if getattr(method, "model", None) is None:
        raise RuntimeError(f"method {method.name!r}: no model; the engine calls setup(model) before begin_task")
    method.model.head.ensure_classes(task.offset + task.n_classes, generator=ctx.generator)


# ``optim_source`` of a rate the evidence grid selected on held-out validation data (10% of each task's training
# set, never test): class-incremental Split-MNIST-5k on the shipped backbone, Adam, 5 epochs, batch 64, the
# embedded default's protocol (benchmarks/lora_cl/results.md, the "lr" columns; run_evidence.py's grids)
VALIDATION_GRID = "validation grid (benchmarks/lora_cl/results.md, split_mnist5k)"


def grid_rate(lr: float, note: str = "") -> tuple[dict[str, Any], str]:
    """``(optim_defaults, optim_source)`` of a rate ``lr`` the validation grid selected (``note``: how)."""
    return {"lr": lr}, VALIDATION_GRID + (f"; {note}" if note else "")


METHODS: Registry = Registry("method", key="method.name")  # name -> ContinualMethod subclass
set_method_registry(METHODS)  # the config validates ``method:`` sections against these classes


def register_method(cls: type[ContinualMethod]) -> type[ContinualMethod]:
    """Class decorator: register ``cls`` under ``cls.name`` (duplicate names are an error)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    return METHODS.register(cls.name, cls, description=cls.description)


def available_methods() -> dict[str, str]:
    return METHODS.available()


def method_class(name: str) -> type[ContinualMethod]:
    """The registered class of method ``name`` (an unknown name is a usage error naming the nearest)."""
    return METHODS.get(name)


def method_options_model(name: str) -> type[MethodOptions]:
    return method_class(name).Options


def build_method(name: str, options: MethodOptions, *, seed: int = 0) -> ContinualMethod:
    method = METHODS.get(name)(options, seed=seed)
    if not hasattr(method, "_metrics"):
        raise TypeError(f"method {name!r}: {type(method).__name__}.__init__ must call "
                        "super().__init__(options, seed=seed)")
    return method
