"""Building a continual run: the scenario, the model, the method, the head suite and the manifest, held in one
:class:`Run` that the loop of :mod:`clmerge.engine.run` passes from step to step."""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..utils.provenance import provenance
from ..config import ExperimentConfig
from ..data import build_dataset, build_scenario
from ..data.scenarios import Scenario, configure_loading
from ..methods import build_method, method_class
from ..methods.base import ContinualMethod
from ..models import ContinualClassifier, IncrementalHead, build_backbone
from .heads import HeadSuite, check_head_support
from .sinks import Sinks

__all__ = ["RunState", "Run", "resolve_device", "task_generator", "build_classifier", "prepare", "prepare_run",
           "build_heads", "head_variant_needs_features", "fresh_objects"]


@dataclass
class RunState:
    rows: list[list[float | None]] = field(default_factory=list)
    til_rows: list[list[float | None]] = field(default_factory=list)
    task_seconds: list[float] = field(default_factory=list)
    initial: list[float] | None = None
    events_lines: int = 0
    head_rows: dict[str, dict[str, list]] = field(default_factory=dict)  # shadow heads: {variant: rows, til_rows}
    head_val: dict[str, float] = field(default_factory=dict)  # final validation CIL accuracy per head variant
    warned_untrained: bool = False  # the train.adapt_tasks=0 warning was printed in this process (not saved)

    def to_meta(self) -> dict:
        return {"rows": self.rows, "til_rows": self.til_rows, "task_seconds": self.task_seconds,
                "initial": self.initial, "events_lines": self.events_lines, "head_rows": self.head_rows,
                "head_val": self.head_val}

@dataclass
class Run:
    """One run's objects, built once (:func:`prepare_run`) and handed to every step of the run
    (:func:`restore`, :func:`train_task`, :func:`evaluate_row`, :func:`final_metrics`).

    ``model``, ``method`` and ``heads`` may be replaced after a task: in a data-parallel run, the processes
    other than 0 load process 0's state into new objects (:func:`share_state`), built by ``fresh`` (default
    :func:`fresh_objects`)."""

    cfg: ExperimentConfig
    scenario: Scenario
    model: ContinualClassifier
    method: ContinualMethod
    out: Path
    device: torch.device
    heads: HeadSuite | None = None
    state: RunState = field(default_factory=RunState)
    sinks: Sinks | None = None  # run.log's sinks (process 0, opened after a resume restored events.jsonl)
    manifest: dict = field(default_factory=dict)
    fresh: Callable[[], tuple[ContinualClassifier, ContinualMethod, HeadSuite]] | None = None

def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)

def task_generator(seed: int, task: int) -> torch.Generator:
    """The per-task RNG; also reseeds torch's global RNG so dropout and ad-hoc draws repeat on resume."""
    s = (seed * 1_000_003 + task * 7919 + 17) % (2**63 - 1)
    torch.manual_seed(s)
    return torch.Generator().manual_seed(s)

def build_classifier(cfg: ExperimentConfig) -> ContinualClassifier:
    torch.manual_seed(cfg.seed)  # random-init backbones (pretrained: false) depend on the seed
    m = cfg.model
    backbone = build_backbone(m.name, pretrained=m.pretrained, source=m.source, config=m.config)
    return ContinualClassifier(backbone, IncrementalHead(backbone.feature_dim, bias=m.head_bias))

def prepare(cfg: ExperimentConfig, *, data_check: str = "refuse") -> tuple[Scenario, ContinualClassifier,
                                                                           ContinualMethod, dict]:
    """Build the scenario, the model and the method (with ``setup`` applied) and the run manifest.

    ``data_check``: ``"refuse"``: the method's options are checked against the scenario's training set (a
    replay buffer larger than it is a ConfigError) before the method is built; ``"fit"`` (a dry run, whose data
    is a small sample): they are cut to it where that changes nothing the run computes."""
    s = cfg.scenario
    model = build_classifier(cfg)
    image_size = s.image_size or getattr(model.backbone, "image_size", None)
    splits = build_dataset(s.dataset, data_root=s.data_root, image_size=image_size, seed=s.seed,
                           **_data_options(cfg, model))
    scenario = build_scenario(
        splits, kind=s.kind, n_tasks=s.n_tasks, seed=s.seed, shuffle_classes=s.shuffle_classes,
        class_order_rng=s.class_order_rng, class_order=s.class_order, classes_per_task=s.classes_per_task,
        transform=s.transform, rotations=s.rotations,
        permute_first_task=s.permute_first_task, train_per_class=s.train_per_class, test_per_class=s.test_per_class,
        train_per_task=s.train_per_task, val_fraction=s.val_fraction, task_order=s.task_order,
    )
    configure_loading(scenario, num_workers=cfg.train.num_workers, pin_memory=cfg.train.pin_memory,
                      fast_jpeg=cfg.train.fast_jpeg)
    options, cls = cfg.method_options(), method_class(cfg.method.name)
    n_train = sum(len(t.train) for t in scenario.tasks)
    if data_check == "fit":
        options = cls.fit_data(options, n_train)
    else:
        cls.check_data(options, n_train)
    method = build_method(cfg.method.name, options, seed=cfg.seed)
    method.setup(model)
    manifest = {
        **provenance(),  # clmerge_version, clmerge_commit, plugins (path, sha256): what --resume/export reload
        "python": sys.version.split()[0], "torch": torch.__version__,
        "platform": platform.platform(), "seed": cfg.seed, "scenario_seed": s.seed, "kind": scenario.kind,
        "dataset": s.dataset, "class_order": scenario.class_order, "class_names": list(scenario.class_names),
        "tasks": [t.describe() for t in scenario.tasks],
        "data": splits.fingerprint, "backbone": dict(getattr(model.backbone, "info", {})), "method": cfg.method.name,
        "trainable_params_after_setup": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    return scenario, model, method, manifest

def prepare_run(cfg: ExperimentConfig, out: str | Path, device: torch.device | str, *,
                heads: bool = True, data_check: str = "refuse") -> Run:
    """The :class:`Run` of ``cfg`` writing into ``out``: :func:`prepare`'s objects and, unless ``heads`` is
    False, the head suite (:func:`build_heads`)."""
    scenario, model, method, manifest = prepare(cfg, data_check=data_check)
    suite = build_heads(cfg, model, method) if heads else None
    return Run(cfg, scenario, model, method, Path(out), torch.device(device), suite, manifest=manifest)

def _data_options(cfg: ExperimentConfig, model: ContinualClassifier) -> dict:
    """``scenario.options``, plus the text backbone's own tokenizer for a text source that was not given one
    (``hf-text`` with ``model.source``: its tokenizer folder or hub id; the ``minilm-l6`` preset is the
    sources' default already)."""
    import inspect

    from ..data.base import DATASETS, check_source_options

    opts = dict(cfg.scenario.options)
    check_source_options(cfg.scenario.dataset, opts)
    source = getattr(model.backbone, "tokenizer_source", None)
    fn = DATASETS.get(cfg.scenario.dataset, (None,))[0]
    if (source and "tokenizer" not in opts and cfg.model.name != "minilm-l6" and fn is not None
            and "tokenizer" in inspect.signature(fn).parameters):
        opts["tokenizer"] = source
    return opts

def build_heads(cfg: ExperimentConfig, model: ContinualClassifier, method: ContinualMethod) -> HeadSuite:
    """The run's head suite; a feature-based head on a method without one shared backbone is a config error."""
    inference = method.inference_model()
    if head_variant_needs_features(cfg):
        check_head_support(cfg.head, cfg.method.name, inference)
    # the features the heads read are the inference model's (APER's are 2d wide: pretrained and adapted)
    dim = inference.head.in_features if isinstance(inference, ContinualClassifier) else model.head.in_features
    return HeadSuite(cfg.head, seed=cfg.seed, feature_dim=dim, head_bias=cfg.model.head_bias)

def head_variant_needs_features(cfg: ExperimentConfig) -> bool:
    h = cfg.head
    return h.compare or h.align or h.classifier != "linear"

def fresh_objects(cfg: ExperimentConfig) -> tuple[ContinualClassifier, ContinualMethod, HeadSuite]:
    """A new model, method (after ``setup``) and head suite of ``cfg``, as :func:`prepare` builds them."""
    model = build_classifier(cfg)
    method = build_method(cfg.method.name, cfg.method_options(), seed=cfg.seed)
    method.setup(model)
    return model, method, build_heads(cfg, model, method)
