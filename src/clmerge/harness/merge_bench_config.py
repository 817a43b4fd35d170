"""The merging benchmark's two shared dataclasses: a task (:class:`BenchTask`) and the settings that make an
expert and its evaluation (:class:`BenchConfig`).

They live here, below both :mod:`.merge_bench_data` (which loads a task's data for a config) and
:mod:`.merge_bench_experts` (which trains an expert for a task and a config), so the imports run one way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["BenchTask", "BenchConfig", "HEAD_PROTOCOLS", "HEAD_INITS", "PROBE_WEIGHT_DECAY", "PROBE_STEPS"]


@dataclass(frozen=True)
class BenchTask:
    """One task: a data source, a fixed transformation (``identity``, ``rot<deg>``, ``perm<seed>``, ``invert``)
    and optionally a subset of its classes (``"0-4"`` or ``"0,2,4"``; labels renumbered from 0 in that order)."""

    dataset: str
    transform: str = "identity"
    classes: str | None = None

    @property
    def name(self) -> str:
        return f"{self.dataset}-{self.transform}" + (f"-c{self.classes}" if self.classes else "")

    @property
    def spec(self) -> str:
        """The ``dataset:transform[:classes]`` string that :func:`parse_task` reads back."""
        return f"{self.dataset}:{self.transform}" + (f":{self.classes}" if self.classes else "")

    def class_list(self) -> list[int] | None:
        if not self.classes:
            return None
        out: list[int] = []
        try:
            for part in self.classes.split(","):
                lo, _, hi = part.partition("-")
                out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
        except ValueError:
            raise ValueError(f"task {self.spec!r}: classes must look like '0-4' or '0,2,4'") from None
        if len(set(out)) != len(out) or len(out) < 2:
            raise ValueError(f"task {self.spec!r}: need at least 2 distinct classes, got {out}")
        return out



HEAD_PROTOCOLS = ("frozen", "cotrained")
HEAD_INITS = ("probe", "prototypes")
PROBE_WEIGHT_DECAY = 1e-3  # L2 on the probe's weights (mean cross-entropy scale); part of the expert's identity
PROBE_STEPS = 100  # L-BFGS iterations on the full (feature) training set


@dataclass
class BenchConfig:
    """Everything that makes an expert (hashed into its cache name) plus evaluation settings."""

    suite: str = "8"
    backbone: str = "vit-tiny-fmnist"
    pretrained: bool = True
    arch: dict = field(default_factory=dict)  # architecture overrides (random init only)
    epochs: int = 3
    lr: float = 1e-3
    batch_size: int = 64
    max_train: int | None = None
    val_fraction: float = 0.15
    max_eval: int | None = None
    seed: int = 0  # the data split, a random-init backbone, and (unless train_seed is set) the fine-tuning
    # Added for the expert studies of clmerge.theory. They enter the expert's cache key only when they differ
    # from these defaults, so experts cached before these fields existed keep their names.
    steps: int | None = None  # a fixed number of optimizer steps (overrides ``epochs``)
    optimizer: str = "adamw"  # "sgd" (plain mini-batch SGD, the theory's setting), "adam" or "adamw"
    momentum: float = 0.0  # SGD only
    data_ratio: float = 1.0  # fraction of the (capped) training split used, the paper's alpha_i
    perturb: int | None = None  # replace training sample ``perturb`` by a held-out one (L2-stability twin)
    # The head protocol (module docstring). A key without "heads" is a co-trained expert: every expert cached
    # before the frozen protocol existed was co-trained, so those names stay valid and never alias a frozen one.
    heads: str = "cotrained"
    head_init: str = "probe"  # frozen heads only
    train_seed: int | None = None  # the fine-tuning seed (batch order, co-trained head init); None: ``seed``
    # keyword options of the tasks' data source (e.g. wordnet_supersense's data_root, tokenizer, max_length);
    # empty: the source's defaults
    data_options: dict = field(default_factory=dict)

    _NEW_DEFAULTS = {"steps": None, "optimizer": "adamw", "momentum": 0.0, "data_ratio": 1.0, "perturb": None,
                     "heads": "cotrained", "train_seed": None, "data_options": {}}

    def __post_init__(self) -> None:
        if self.heads not in HEAD_PROTOCOLS:
            raise ValueError(f"heads {self.heads!r}: expected one of {', '.join(HEAD_PROTOCOLS)}")
        if self.head_init not in HEAD_INITS:
            raise ValueError(f"head_init {self.head_init!r}: expected one of {', '.join(HEAD_INITS)}")
        if self.train_seed == self.seed:  # the same expert as no train_seed: one cache name for it
            self.train_seed = None

    @property
    def fine_tune_seed(self) -> int:
        return self.seed if self.train_seed is None else self.train_seed

    def expert_key(self, task: BenchTask) -> dict:
        keep = {k: v for k, v in asdict(self).items() if k not in ("suite", "max_eval")}
        keep = {k: v for k, v in keep.items() if k not in self._NEW_DEFAULTS or v != self._NEW_DEFAULTS[k]}
        if self.heads == "frozen":  # how the head was fitted is part of the expert
            keep |= {"head_fit": {"probe_weight_decay": PROBE_WEIGHT_DECAY, "probe_steps": PROBE_STEPS}}
        else:
            keep.pop("head_init")
        task_d = {k: v for k, v in asdict(task).items() if k != "classes" or v is not None}
        return {"task": task_d, **keep}
