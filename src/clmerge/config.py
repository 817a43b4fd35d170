"""Typed experiment configuration (pydantic), YAML I/O and ``--set dotted.key=value`` overrides.

Stable keys (a contract other tools rely on): ``scenario.dataset``, ``scenario.n_tasks``, ``scenario.kind``,
``scenario.seed``, ``model.name``, ``method.name``, ``seed``. Every other key has a default written out in the
resolved ``config.yaml`` of a run. An unknown or misspelled key is an error that names the key and the closest
valid one; types and ranges are checked before anything runs.

Method-specific options live under ``method:`` next to ``method.name`` and are validated against the options
model the method registers (see ``methods.base.register_method``). The config sits below the methods in the
package's layers, so it does not import them: ``clmerge.methods`` hands its registry to
:func:`set_method_registry` when it is imported, and the method-specific checks read the classes from there.
When nothing has imported the methods yet, the first check asks :func:`clmerge.registry.provided` for them (the
package's face names their provider), so :func:`load_config` works in a fresh interpreter whatever was imported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from difflib import get_close_matches
from pathlib import Path
from typing import Any, Literal, Protocol

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ConfigError, ConfigFileError, InputError, UsageError, clip
from .registry import provided
from .utils.yaml_io import YamlError, YamlLimitError, parse_assignment, read_yaml, read_yaml_mapping
from .utils.threads import threads_problem

__all__ = [
    "ConfigError",
    "ConfigFileError",
    "ExperimentConfig",
    "ScenarioConfig",
    "ModelConfig",
    "HeadConfig",
    "OptimConfig",
    "TrainConfig",
    "RunConfig",
    "MethodConfig",
    "load_config",
    "parse_config",
    "apply_overrides",
    "dump_config",
    "default_config",
    "validate_strict",
    "read_yaml_mapping",
    "StrictModel",
    "check_keys",
    "nearest_hint",
    "set_method_registry",
    "PAPER_DIR",
    "available_configs",
    "resolve_config_arg",
    "SEED_MIN",
    "SEED_MAX",
    "MAX_TASKS",
    "seed_problem",
]


class MethodSpec(Protocol):
    """What the config reads of a registered continual method class (``methods.base.ContinualMethod``)."""

    Options: type[BaseModel]  # the method's options model, validated from the ``method:`` section
    head_defaults: dict[str, Any]  # ``head:`` values the method runs with unless the config sets them
    optim_defaults: dict[str, Any]  # ``optim:`` values (its learning rate) unless the config sets them
    trains_linear_head: bool  # False: predicts from feature statistics, so a linear head is never trained


class MethodRegistry(Protocol):
    """The lookups the config needs of the method registry (a :class:`clmerge.registry.Registry`)."""

    def get(self, name: str, default: Any = ...) -> Any: ...

    def available(self) -> dict[str, str]: ...


_method_registry: list[MethodRegistry] = []  # set once, by ``clmerge.methods`` at import


def set_method_registry(registry: MethodRegistry) -> None:
    """Install the registry that names the continual methods (called by ``clmerge.methods`` at import)."""
    _method_registry[:] = [registry]


def _methods() -> MethodRegistry:
    if not _method_registry and (found := provided("method")) is not None:
        set_method_registry(found)  # the face's provider imports clmerge.methods (which also installs it)
    if not _method_registry:
        raise RuntimeError("no continual methods are registered: import clmerge.methods (or clmerge.engine) "
                           "before validating a config's method section")
    return _method_registry[0]


# Every seed key (``seed``, ``scenario.seed``, ``clmerge run --seeds``) takes an integer in [SEED_MIN, SEED_MAX]:
# the range every generator a run feeds accepts. numpy's legacy RandomState (scenario.class_order_rng=legacy_seed,
# the seeded task orders of ``--orders``) takes only [0, 2**32 - 1]; default_rng refuses negatives; torch's
# manual_seed takes [-2**63, 2**64) but the methods derive per-step seeds as ``seed * 1_000_003 + k``, which must
# stay inside it. [0, 2**32 - 1] satisfies them all, so a seed is refused when the config is validated instead
# of failing after the run started (docs/cli_errors.md).
SEED_MIN, SEED_MAX = 0, 2**32 - 1
# The most tasks a scenario may have: more than the classes of any benchmark clmerge ships (ImageNet's 1000,
# Omniglot's 1623), so a typo (``n_tasks=1000000000``) is refused at validation before a dataset is read or a
# task built. The exact bound (at most one task per class) is checked against the data when the run starts.
MAX_TASKS = 10_000


def seed_problem(value: object, key: str) -> str | None:
    """Why ``value`` is no valid seed for ``key`` (None: it is one); the message names the key, the value and
    the range."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{key}: a seed is an integer (got {clip(repr(value), 40)})"
    if not SEED_MIN <= value <= SEED_MAX:
        return (f"{key}={clip(value, 40)}: a seed must lie in [{SEED_MIN}, {SEED_MAX}] (2**32 - 1: the range "
                "every random generator of a run accepts)")
    return None


class StrictModel(BaseModel):
    """A config section: unknown keys, wrong types and nan/inf are refused (recipes and specs use it too)."""

    # nan/inf are never meaningful settings (an lr of inf diverges at the first step): refused with the key
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ScenarioConfig(StrictModel):
    dataset: str = "mnist5k"
    kind: Literal["class_incremental", "task_incremental", "domain_incremental"] = "class_incremental"
    n_tasks: int = Field(5, ge=1, le=MAX_TASKS, description=f"how many tasks (at most {MAX_TASKS:,}, and at most "
                         "one per class of a class split)")
    seed: int = Field(0, ge=SEED_MIN, le=SEED_MAX, description="the class order: which classes form which task (training randomness is "
                      "the top-level seed; docs/sweeps.md)")
    shuffle_classes: bool = Field(True, description="permute the class order with scenario.seed (else sorted)")
    class_order_rng: Literal["default_rng", "legacy_seed"] = Field(
        "default_rng", description="how scenario.seed permutes the classes: default_rng (numpy's Generator) or "
        "legacy_seed (np.random.seed(seed) then np.random.permutation, the class order of PILOT and PyCIL)")
    class_order: list[int] | None = Field(None, description="explicit class order; overrides shuffle_classes")
    classes_per_task: list[int] | None = Field(None, description="uneven splits: classes in each task")
    transform: Literal["none", "permutation", "rotation"] = Field(
        "none", description="per-task input transform (domain-incremental, or task-incremental permuted data)"
    )
    rotations: list[float] | None = Field(None, description="degrees per task for transform=rotation")
    permute_first_task: bool = Field(False, description="transform=permutation: permute task 0 too")
    train_per_class: int | None = Field(None, ge=1, description="subsample the training set per class")
    test_per_class: int | None = Field(None, ge=1, description="subsample the test set per class")
    train_per_task: int | None = Field(None, ge=1, description="domain/permuted tasks: training images per task")
    val_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="held-out validation part of each task's train set")
    data_root: str | None = Field(None, description="root of on-disk datasets (else $CLMERGE_DATA, ./data)")
    image_size: int | None = Field(None, ge=1, description="folder datasets: side after resize+crop (default: backbone's)")
    options: dict[str, Any] = Field(default_factory=dict, description="extra keyword options for the data source")
    task_order: list[int] | None = Field(
        None, description="present the tasks in this order (a permutation of 0..n_tasks-1; tasks keep their content)")
    task_orders: list[list[int]] | None = Field(
        None, description="a benchmark's listed task orders, used by `clmerge run --orders N` (seeded permutations "
        "beyond them)")


class ModelConfig(StrictModel):
    name: str = "vit-tiny-fmnist"
    pretrained: bool = True
    source: str | None = Field(None, description="local directory or hub id of the weights")
    config: dict[str, Any] = Field(default_factory=dict, description="architecture overrides (random-init builds)")
    head_bias: bool = True


class HeadConfig(StrictModel):
    loss: Literal["local", "seen"] = Field(
        "local",
        description="local: cross-entropy over the current task's logits only (SD-LoRA and InfLoRA code); "
        "seen: over all classes seen so far",
    )
    classifier: Literal["linear", "ncm", "ranpac"] = Field(
        "linear", description="the head that predicts at evaluation: linear (the trained head), ncm (nearest "
        "class mean of backbone features) or ranpac (random projection + ridge classifier, McDonnell et al. 2023)")
    align: bool = Field(False, description="SLCA classifier alignment of the linear head after each task "
                        "(pseudo-features from per-class Gaussians)")
    compare: bool = Field(False, description="also evaluate linear, linear+align, ncm and ranpac as shadow heads "
                          "(never fed back into training); metrics.json gets heads: {name: ...}")
    ncm_metric: Literal["cosine", "euclidean"] = Field("cosine", description="ncm: similarity to the class means")
    ranpac_dim: int = Field(2000, ge=1, description="ranpac: random projection width M of the head suite's RanPAC "
                            "head (head.compare's shadow head, any method's head.classifier: ranpac); the ranpac and "
                            "ranpac_rp methods default to the official M, 10000 (a float64 M x M Gram matrix: 800 MB "
                            "and 806 MB checkpoints per task at 10000, 32 MB at 2000)")
    align_epochs: int = Field(5, ge=1, description="align: epochs over pseudo-features (SLCA ca_epochs)")
    align_lr: float = Field(0.01, gt=0, description="align: SGD learning rate (0.01 in the official SLCA and "
                            "InfLoRA-CA code)")
    align_first_task: bool = Field(False, description="align: also after the first task (the official SLCA and "
                                   "InfLoRA-CA code align from the second task on)")
    align_samples: int = Field(256, ge=1, description="align: pseudo-features per class per epoch (SLCA)")
    align_weight_decay: float = Field(5e-4, ge=0, description="align: SGD weight decay (SLCA)")
    align_logit_norm: float | None = Field(0.1, gt=0, description="align: logit-normalisation temperature "
                                           "(SLCA 0.1); null trains on plain logits")
    align_mean_decay: bool = Field(True, description="align: SLCA's shrinking of older tasks' sampling means")
    align_cov: Literal["full", "lowrank", "diag"] = Field(
        "full", description="align: class covariance kept as full DxD, top-rank + diagonal, or diagonal")
    align_rank: int = Field(16, ge=1, description="align_cov=lowrank: eigenpairs kept per class")
    align_keep: Literal["discard", "persistent"] = Field(
        "discard", description="align: discard: every task end aligns a fresh copy of the model's trained head "
        "(the official SLCA code restores the unaligned head after each evaluation); persistent: the aligned "
        "old blocks are kept and aligned again at every later task (the official InfLoRA-CA code)")


class OptimConfig(StrictModel):
    name: Literal["sgd", "adam", "adamw"] = "adam"
    lr: float = Field(5e-3, gt=0)
    first_task_lr: float | None = Field(None, gt=0, description="a different lr for task 0 (SD-LoRA ImageNet-A)")
    head_lr: float | None = Field(None, gt=0, description="a different lr for the classifier head")
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    schedule: Literal["constant", "cosine", "multistep"] = "constant"
    milestones: list[int] = Field(default_factory=list, description="multistep: epochs at which lr *= gamma")
    gamma: float = Field(0.1, gt=0)
    warmup_epochs: int = Field(0, ge=0)
    grad_clip: float | None = Field(None, gt=0)


class TrainConfig(StrictModel):
    epochs: int = Field(5, ge=1)
    batch_size: int = Field(64, ge=1)
    eval_batch_size: int = Field(500, ge=1)
    max_steps_per_epoch: int | None = Field(None, ge=1, description="cap steps per epoch (dry runs)")
    num_workers: int = Field(0, ge=0, description="data-loading worker processes for on-disk image datasets (0: "
                             "decode in the training process)")
    pin_memory: bool = Field(False, description="page-locked host batches (faster copies to a GPU)")
    fast_jpeg: bool = Field(False, description="on-disk JPEGs: decode at a reduced size (PIL draft) when the "
                            "target is much smaller; changes pixels slightly (docs/data_loading.md)")
    adapt_tasks: int | None = Field(
        None, ge=0, description="train the backbone (every non-head parameter group) in the first N tasks only; "
        "later tasks train the head alone (RanPAC's and APER's first-session adaptation: N=1). null: every task")


class RunConfig(StrictModel):
    device: str = Field("cpu", description="cpu, cuda, cuda:N or auto")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads (default: torch's); at most "
                                "4 x the CPUs (utils.threads). Results can differ with the count (docs/threads.md)")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="training and evaluation forward passes: fp32, or autocast to bf16 / fp16 (fp16 with "
        "a loss scaler); end-of-task statistics stay fp32 (docs/scaling.md)")
    progress: bool = Field(True, description="progress bars on a terminal; one line per epoch and task otherwise")
    log_every_steps: int | None = Field(
        None, ge=1, description="record the mean training loss every N optimizer steps in events.jsonl (step "
        "events, plotted in the report); null: about 40 records per task")
    keep_checkpoints: int = Field(1, ge=1, description="how many per-task checkpoints to keep (newest)")
    report: bool = Field(True, description="write report.html at the end")
    eval_til: bool = Field(True, description="class-incremental: also report task-id-known accuracy")
    log: list[Literal["csv", "tensorboard", "wandb"]] = Field(
        default_factory=list, description="log sinks for every logged scalar besides events.jsonl: csv "
        "(OUT/scalars.csv), tensorboard (OUT/tensorboard; the tensorboard extra), wandb (offline; the wandb extra)")

    @field_validator("threads")
    @classmethod
    def _usable_threads(cls, v: int | None) -> int | None:
        problem = None if v is None else threads_problem(v)
        if problem is not None:  # a huge count crashes the OpenMP runtime (utils.threads)
            raise ValueError(problem)
        return v


class MethodConfig(BaseModel):
    """``name`` plus the method's own options (validated against the method's registered options model)."""

    model_config = ConfigDict(extra="allow")
    # The default is the method that scored best on validation data in the linear-head evidence grid
    # (benchmarks/lora_cl/results.md: class-incremental Split-MNIST-5k, 3 seeds).
    name: str = Field("inflora", description="the method (default: inflora, the best on validation data)")

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class ExperimentConfig(StrictModel):
    seed: int = Field(0, ge=SEED_MIN, le=SEED_MAX, description="training randomness: new parameters' initial values, batch order, dropout "
                      "(the class order is scenario.seed; docs/sweeps.md)")
    scenario: ScenarioConfig = Field(default_factory=ScenarioConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    head: HeadConfig = Field(default_factory=HeadConfig)
    method: MethodConfig = Field(default_factory=MethodConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _cross_field(self) -> "ExperimentConfig":
        s = self.scenario
        if s.classes_per_task is not None and len(s.classes_per_task) != s.n_tasks:
            raise ValueError(
                f"scenario.classes_per_task has {len(s.classes_per_task)} entries but scenario.n_tasks is {s.n_tasks}"
            )
        if s.rotations is not None and len(s.rotations) != s.n_tasks:
            raise ValueError(f"scenario.rotations has {len(s.rotations)} entries but scenario.n_tasks is {s.n_tasks}")
        if s.class_order is not None and s.n_tasks > len(s.class_order) and s.transform == "none":
            raise ValueError(f"scenario.n_tasks={s.n_tasks}: more tasks than the {len(s.class_order)} classes of "
                             f"scenario.class_order (at most {len(s.class_order)})")
        listed = [(f"task_orders[{i}]", o) for i, o in enumerate(s.task_orders or [])]
        for key, order in [("task_order", s.task_order)] + listed:
            if order is not None and sorted(order) != list(range(s.n_tasks)):
                raise ValueError(f"scenario.{key} {order} is not a permutation of 0..{s.n_tasks - 1}")
        h = self.head
        if h.align and h.classifier != "linear":
            raise ValueError(f"head.align=true retrains the linear head; it needs head.classifier=linear "
                             f"(got {h.classifier})")
        if s.kind == "domain_incremental" and (h.classifier != "linear" or h.align or h.compare):
            raise ValueError("head.classifier/align/compare: feature-based heads need a class- or "
                             "task-incremental scenario (scenario.kind is domain_incremental)")
        if s.kind == "domain_incremental" and s.transform == "none":
            raise ValueError("scenario.kind=domain_incremental needs scenario.transform (permutation or rotation)")
        return self

    def method_options(self):
        """The validated options object of the configured method."""
        return _methods().get(self.method.name).Options.model_validate(self.method.options())


# ----------------------------------------------------------------------------------------------------------
def nearest_hint(key: str, valid: list[str]) -> str:
    """The tail of an unknown-key message: the closest valid key, else the list of valid ones."""
    near = get_close_matches(str(key), valid, n=1, cutoff=0.5)  # YAML keys may be numbers
    return f" (did you mean {near[0]!r}?)" if near else f"; valid keys: {', '.join(valid)}"


def check_keys(data: Any, model: type[BaseModel], path: str) -> None:
    """Walk ``data`` against ``model``'s fields: unknown keys raise ConfigError with the nearest valid key."""
    if not isinstance(data, dict):
        return
    fields = model.model_fields
    for key, value in data.items():
        dotted = f"{path}{key}"
        if key not in fields:
            if model is MethodConfig:
                continue  # checked against the method's own options below
            raise ConfigError(f"unknown config key {clip(repr(dotted), 80)}{nearest_hint(key, list(fields))}")
        ann = fields[key].annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            check_keys(value, ann, dotted + ".")
    if model is MethodConfig:
        _check_method_keys(data, path)


def _check_method_keys(data: dict, path: str) -> None:
    methods = _methods()
    name = data.get("name", MethodConfig().name)
    if not isinstance(name, str) or name not in methods.available():
        raise ConfigError(f"{path}name: unknown method {clip(repr(name), 80)}"
                          f"{nearest_hint(name, list(methods.available()))}")
    opts = methods.get(name).Options
    for key in data:
        if key != "name" and key not in opts.model_fields:
            valid = list(opts.model_fields) or ["(this method has no options)"]
            raise ConfigError(f"unknown config key {clip(repr(f'{path}{key}'), 80)} for method {name!r}"
                              f"{nearest_hint(key, valid)}")


MAX_LISTED_ERRORS = 3  # validation errors named in one message; the rest are counted


def _format_validation(exc: ValidationError, prefix: str = "") -> str:
    """The first :data:`MAX_LISTED_ERRORS` errors, each naming its key and (clipped) the value given."""
    errors = exc.errors()
    lines = []
    for err in errors[:MAX_LISTED_ERRORS]:
        loc = clip(".".join(str(p) for p in err["loc"]) or "(root)", 80)
        shown = "input" in err and not isinstance(err["input"], dict)
        got = f" (got {clip(repr(err['input']), 60)})" if shown else ""
        lines.append(f"{prefix}{loc}: {err['msg']}{got}")
    more = len(errors) - MAX_LISTED_ERRORS
    return "; ".join(lines) + (f"; and {more} more" if more > 0 else "")


def validate_strict(model: type[BaseModel], data: dict | None) -> BaseModel:
    """Validate ``data`` into ``model``: unknown keys name the nearest valid key, bad values name their key."""
    data = dict(data or {})
    check_keys(data, model, "")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation(exc)) from None


def parse_config(data: dict | None) -> ExperimentConfig:
    """Validate a plain dict into an :class:`ExperimentConfig` (unknown keys and bad values -> ConfigError).

    The configured method's own head and optimizer defaults fill the ``head:`` and ``optim:`` keys that
    ``data`` leaves out (``optim_defaults``: the method's learning rate; a key the config sets always wins)."""
    cfg = validate_strict(ExperimentConfig, _with_method_defaults(data or {}))
    try:
        cfg.method_options()
    except ValidationError as exc:
        raise ConfigError(_format_validation(exc, prefix="method.")) from None
    _check_method_head(cfg)
    return cfg


def _with_method_defaults(data: dict) -> dict:
    """``data`` with the method's ``head_defaults`` under the ``head:`` keys and its ``optim_defaults`` under
    the ``optim:`` keys that ``data`` leaves out (the keys ``data`` sets win)."""
    method = data.get("method")
    name = method.get("name", MethodConfig().name) if isinstance(method, dict) else MethodConfig().name
    cls = _methods().get(name, None) if isinstance(name, str) else None
    if cls is None:
        return data  # an unknown method: reported by the validation
    out = dict(data)
    for section, defaults in (("head", cls.head_defaults), ("optim", getattr(cls, "optim_defaults", {}))):
        given = data.get(section, {})
        if defaults and isinstance(given, dict):  # a malformed section: reported by the validation
            out[section] = {**defaults, **given}
    return out


def _check_method_head(cfg: ExperimentConfig) -> None:
    """A statistics method never trains the linear head: evaluating it (or aligning it) is refused."""
    h, name = cfg.head, cfg.method.name
    cls = _methods().get(name)
    if hasattr(cls, "check_head"):  # the method's own rule on its head keys (e.g. rehearsal's head_convention)
        cls.check_head(cfg.method_options(), h)
    if cls.trains_linear_head or (h.classifier != "linear" and not h.compare):
        return
    key = "head.compare=true" if h.compare else "head.classifier=linear"
    raise ConfigError(f"{key}: method {name!r} trains no linear head (it predicts from feature statistics of "
                      "a frozen backbone); use head.classifier=ncm or ranpac with head.compare=false")


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``dotted.key=value`` strings to a nested dict (returns a new dict); values are read by the one
    ``key=value`` grammar of the command line (:func:`clmerge.utils.yaml_io.parse_assignment`)."""
    import copy

    out = copy.deepcopy(data)
    for item in overrides:
        try:
            key, value = parse_assignment(item, "--set", "dotted.key=value")
        except YamlLimitError as exc:  # an alias bomb on the command line: a bad value of this key
            raise ConfigError(str(exc)) from None
        except ValueError as exc:  # no '=' or no key
            raise ConfigError(str(exc)) from None
        parts = key.split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {clip(key, 80)}: {clip(repr(p), 40)} is not a section")
        node[parts[-1]] = value
    return out


# The embedded default experiment (``clmerge run`` without a config file) is the (method, head) pair that
# scored best on validation data in the head grid (benchmarks/lora_cl/results.md, validation ranking,
# 3 seeds): the pretrained backbone kept frozen with RanPAC's random-projection ridge head on its features,
# which is the ``ranpac_rp`` method (RanPAC without its first-session adaptation), at the grid's width 2000
# (the method's own default is the official 10000, which makes this job about 20x slower and its checkpoints
# 25x larger for +1.2 CIL points on split_mnist5k). It owns its head and its frozen backbone, so
# ``--set method.name=...`` switches to another method with that method's own defaults. A config file keeps
# the section defaults (InfLoRA, the linear head of the papers' code), so paper configs reproduce the papers.
EMBEDDED_DEFAULT: dict[str, Any] = {"method": {"name": "ranpac_rp"}, "head": {"ranpac_dim": 2000}}


def embedded_default(keys: Any = ()) -> dict:
    """A copy of :data:`EMBEDDED_DEFAULT` for a run that sets the dotted ``keys`` (``--set``, a sweep's ``set``
    and ``grid``): when they switch the method (``method.name``, or all of ``method``), the default job's own
    ``head:`` width is left out, so the switched method runs with its own defaults (``ranpac`` and ``ranpac_rp``
    at the official width)."""
    import copy

    data = copy.deepcopy(EMBEDDED_DEFAULT)
    if any(k in ("method", "method.name") for k in keys):
        data.pop("head")
    return data


PAPER_DIR = Path(__file__).resolve().parent / "configs" / "paper"  # the papers' configs shipped with clmerge
_SUFFIXES = (".yaml", ".yml")


def available_configs() -> dict[str, Path]:
    """Shipped config names (file stems), sorted, with their files."""
    return {p.stem: p for p in sorted(PAPER_DIR.glob("*.yaml"))}


def _is_path_arg(text: str) -> bool:
    """An argument written as a path: it holds a folder separator or ends in ``.yaml`` / ``.yml``."""
    return "/" in text or "\\" in text or text.endswith(_SUFFIXES) or text.startswith("~")


def resolve_config_arg(arg: str | Path, *, note: Callable[[str], None] | None = None) -> Path:
    """The file a ``clmerge run CONFIG`` argument (or a sweep's ``base:``) means. The rule:

    - an argument with a folder separator or a ``.yaml`` / ``.yml`` suffix is a path (``./NAME`` names a file
      of the current folder); a missing one is an input error, which names the shipped config when the
      path's stem is one;
    - a bare name (no separator, no suffix) is the shipped config of that name (``clmerge configs``). When a
      file or folder of that name also exists in the current folder, the shipped config is still the one
      used, and one line (``note``, default: a warning on stderr) says so and how to pick the file
      (``./NAME``);
    - a bare name that is no shipped config but an existing file of the current folder is read as that file
      (there is nothing else it could mean), with one line saying so;
    - any other bare name is a usage error naming the nearest shipped config.
    """
    note = note or _note
    text = str(arg)
    p = Path(arg)
    names = available_configs()
    if _is_path_arg(text):
        p = p.expanduser()
        if p.exists():
            return p
        also = f" (a shipped config has that name: `clmerge run {p.stem}`)" if p.stem in names else ""
        raise ConfigFileError(f"config file not found: {p}{also}")
    if text in names:
        if p.exists():
            note(f"config {text!r}: using the shipped config {text!r}, not the {'folder' if p.is_dir() else 'file'} "
                 f"{text!r} of the current folder (to use that, write ./{text})")
        return names[text]
    if p.is_file():
        note(f"config {text!r}: no shipped config has that name; reading the file ./{text} of the current folder")
        return p
    if p.exists():
        raise ConfigFileError(f"{p}: the config file is a folder, not a YAML file")
    near = get_close_matches(text, list(names), n=1, cutoff=0.6)
    hint = f"did you mean {near[0]!r}?" if near else "list them with `clmerge configs`"
    raise ConfigError(f"config {text!r}: no such file and no shipped config of that name ({hint})")


def _note(line: str) -> None:
    """One line on stderr (``warning: ...``), the way the engine's warnings print."""
    logging.getLogger("clmerge.config").warning("warning: %s", line)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, *,
                note: Callable[[str], None] | None = None) -> ExperimentConfig:
    """Read a YAML config (or the embedded default when ``path`` is None) and apply ``--set`` overrides.

    ``path`` is a file, or the name of a config shipped with clmerge (``clmerge configs`` lists them; the rule:
    :func:`resolve_config_arg`, whose one-line notes go to ``note``)."""
    keys = [o.split("=", 1)[0].strip() for o in overrides or []]
    data = (read_yaml_mapping(resolve_config_arg(path, note=note)) if path is not None
            else embedded_default(keys))
    data = apply_overrides(data, overrides or [])
    return parse_config(data)


def dump_config(cfg: ExperimentConfig) -> str:
    """The fully resolved config as YAML, every default written out (method options included)."""
    data = cfg.model_dump(mode="json")
    data["method"] = {"name": cfg.method.name, **cfg.method_options().model_dump(mode="json")}
    return yaml.safe_dump(data, sort_keys=False)


def default_config() -> ExperimentConfig:
    """The embedded default experiment that ``clmerge run`` runs with no arguments."""
    return load_config(None)
