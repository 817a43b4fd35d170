"""The study spec (YAML -> pydantic) and its expansion into grid points.

A study fine-tunes experts from one base model on groups of tasks drawn from a suite, merges every group
with every listed method and records the merged model's loss on the union of the tasks' test sets. The grid
varies the expert hyperparameters of the scaling laws of Li, Tang et al. (arXiv:2601.21690, Sec. V-B): steps
``K``, learning rate ``eta``, batch size ``b``, data ratio ``alpha``, optimizer and the number of experts ``N``.

``design: one_at_a_time`` (the paper's protocol, Sec. V-A) varies one hyperparameter at a time around
``defaults``, which is what the one-variable laws need; ``design: full`` takes the Cartesian product.
Unknown keys anywhere are errors naming the nearest valid key.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..config import ConfigError, apply_overrides, nearest_hint, read_yaml_mapping, validate_strict
from ..harness.merge_bench import SUITES, BenchConfig, BenchTask, parse_task
from ..utils.threads import threads_problem

__all__ = ["StudySpec", "Point", "HYPERPARAMETERS", "load_study", "parse_study", "expand_points", "point_id",
           "OLD_METHOD_NAMES", "canonical_method"]

HYPERPARAMETERS = ("steps", "lr", "batch_size", "data_ratio", "optimizer", "n_experts")
# A study's methods are named as in the merge registry (``clmerge merges``). Old names, still accepted for one
# release with a warning: ``averaging`` (the paper's "simple averaging") is ``weight_average``.
OLD_METHOD_NAMES = {"averaging": "weight_average"}
_METHOD_OPTIONS: dict[str, dict[str, Any]] = {
    "weight_average": {},
    "task_arithmetic": {"scaling": 0.3},
    "ties": {"density": 0.2, "scaling": 1.0},
    "dare": {"drop_rate": 0.5, "scaling": 0.3, "rescale": True, "seed": 0},
    "adamerging": {"steps": 50, "lr": 1e-3, "init": 0.3, "granularity": "task"},
}


_warn = logging.getLogger("clmerge.theory").warning  # one line on stderr ("warning: ...")


def canonical_method(name: str) -> str:
    """The merge registry's name of a study method (an old name such as ``averaging`` translated)."""
    return OLD_METHOD_NAMES.get(name, name)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BaseSpec(_Strict):
    backbone: str = "vit-tiny-fmnist"
    pretrained: bool = Field(True, description="shipped weights; false builds a seeded random init")
    arch: dict[str, Any] = Field(default_factory=dict, description="architecture overrides (random init only)")


class DataSpec(_Strict):
    max_train: int | None = Field(512, ge=1, description="cap on each task's training split (before data_ratio)")
    max_eval: int | None = Field(256, ge=1, description="cap on each task's validation and test split")
    val_fraction: float = Field(0.15, gt=0, lt=1)
    options: dict[str, Any] = Field(default_factory=dict, description="keyword options of the tasks' data source "
                                    "(e.g. wordnet_supersense: data_root, max_length); empty: its defaults")


class Defaults(_Strict):
    steps: int = Field(40, ge=1)
    lr: float = Field(0.01, gt=0)
    batch_size: int = Field(32, ge=1)
    data_ratio: float = Field(1.0, gt=0, le=1)
    optimizer: Literal["sgd", "adam", "adamw"] = "sgd"
    momentum: float = Field(0.0, ge=0, lt=1)
    n_experts: int = Field(3, ge=1)


class Grid(_Strict):
    steps: list[int] = Field(default_factory=list)
    lr: list[float] = Field(default_factory=list)
    batch_size: list[int] = Field(default_factory=list)
    data_ratio: list[float] = Field(default_factory=list)
    optimizer: list[Literal["sgd", "adam", "adamw"]] = Field(default_factory=list)
    n_experts: list[int] = Field(default_factory=list)


class MeasureSpec(_Strict):
    noise_samples: int = Field(64, ge=2, description="samples per task for sigma_i^2 and zeta_i^2 at the base")
    stability: bool = Field(True, description="train one-sample-perturbed twins of each point's first expert")
    stability_indices: list[int] = Field(
        default_factory=lambda: [0, 1, 2], min_length=1,
        description="training-sample positions replaced, one twin each (Definition 2 averages over i); a twin "
        "whose sample was never drawn in the steps taken is identical to its original (distance exactly 0, "
        "counted and reported)")
    stability_seeds: int = Field(
        2, ge=1, description="independent (D, D^(i)) draws per point: draw r trains the original and its twins "
        "with seed + 1000 r (r = 0 is the point's own expert)")
    weighting_steps: list[int] = Field(
        default_factory=list, description="steps K_i of experts averaged to measure lambda_i = K_i / sum K_j "
        "(Eq. 14); empty: skip")


class StudySpec(_Strict):
    name: str = "study"
    base: BaseSpec = Field(default_factory=BaseSpec)
    suite: str | list[str] = Field("8", description="a merging-bench suite name or a list of dataset:transform")
    data: DataSpec = Field(default_factory=DataSpec)
    defaults: Defaults = Field(default_factory=Defaults)
    grid: Grid = Field(default_factory=Grid)
    design: Literal["one_at_a_time", "full"] = "one_at_a_time"
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    groups: int = Field(1, ge=1, description="random task groups per point (the paper uses 15)")
    group_seed: int = 0
    methods: list[dict[str, Any]] = Field(default_factory=lambda: [{"name": "weight_average"}], min_length=1)
    measure: MeasureSpec = Field(default_factory=MeasureSpec)
    threads: int = Field(1, ge=1, description="torch threads inside every job (fixed for identical numbers)")

    @field_validator("threads")
    @classmethod
    def _usable_threads(cls, v: int) -> int:
        problem = threads_problem(v)
        if problem is not None:  # a huge count crashes the OpenMP runtime in every job (utils.threads)
            raise ValueError(problem)
        return v

    @field_validator("methods")
    @classmethod
    def _check_methods(cls, methods: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for i, m in enumerate(methods):
            name = m.get("name")
            if name in OLD_METHOD_NAMES:
                _warn(f"warning: methods[{i}].name: {name!r} is an old name of {OLD_METHOD_NAMES[name]!r} (same merge); "
                      f"it is accepted for one more release")
                name = OLD_METHOD_NAMES[name]
            if name not in _METHOD_OPTIONS:
                hint = nearest_hint(str(name), list(_METHOD_OPTIONS))
                raise ValueError(f"methods[{i}].name: unknown method {name!r}{hint}")
            for key in m:
                if key != "name" and key not in _METHOD_OPTIONS[name]:
                    raise ValueError(f"methods[{i}]: unknown option {key!r} for {name}"
                                     f"{nearest_hint(key, list(_METHOD_OPTIONS[name]) or ['(none)'])}")
            out.append({"name": name, **_METHOD_OPTIONS[name], **{k: v for k, v in m.items() if k != "name"}})
        return out

    def tasks(self) -> list[BenchTask]:
        """The task pool that groups are drawn from."""
        if isinstance(self.suite, str):
            if self.suite not in SUITES:
                raise ConfigError(f"suite: unknown suite {self.suite!r}{nearest_hint(self.suite, list(SUITES))}")
            return list(SUITES[self.suite])
        return [parse_task(s) for s in self.suite]


class Point(BaseModel):
    """One merged point: a setting of every hyperparameter, a seed, a task group and a merge method."""

    model_config = ConfigDict(frozen=True)
    kind: Literal["grid", "weighting"] = "grid"
    steps: int | list[int]
    lr: float
    batch_size: int
    data_ratio: float
    optimizer: str
    momentum: float = 0.0
    n_experts: int
    seed: int
    group: int
    tasks: list[str]
    method: dict[str, Any]
    varied: str | None = Field(None, description="the hyperparameter this point varies (one_at_a_time)")

    @property
    def id(self) -> str:
        return point_id(self)

    def expert_configs(self, spec: StudySpec) -> list[tuple[BenchTask, BenchConfig]]:
        """``(task, config)`` of each expert, in group order."""
        steps = self.steps if isinstance(self.steps, list) else [self.steps] * len(self.tasks)
        return [(parse_task(t), expert_config(spec, self, k)) for t, k in zip(self.tasks, steps)]


def expert_config(spec: StudySpec, p: Point, steps: int, *, perturb: int | None = None) -> BenchConfig:
    """The bench config that makes one expert of ``p`` (everything that enters its cache key)."""
    return BenchConfig(suite="custom", backbone=spec.base.backbone, pretrained=spec.base.pretrained,
                       arch=dict(spec.base.arch), epochs=1, lr=p.lr, batch_size=p.batch_size,
                       max_train=spec.data.max_train, val_fraction=spec.data.val_fraction, max_eval=spec.data.max_eval,
                       seed=p.seed, steps=steps, optimizer=p.optimizer, momentum=p.momentum,
                       data_ratio=p.data_ratio, perturb=perturb, data_options=dict(spec.data.options))


def point_id(p: Point) -> str:
    """A stable 16-hex id of everything that defines the point (used by ``--resume``). ``weight_average`` is
    hashed under its old study name ``averaging``, so studies written before the rename keep their ids."""
    d = p.model_dump(exclude={"varied"})
    d["method"] = {**d["method"], "name": _OLD_NAME.get(d["method"]["name"], d["method"]["name"])}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


_OLD_NAME = {new: old for old, new in OLD_METHOD_NAMES.items()}


def task_group(pool: list[BenchTask], n: int, g: int, group_seed: int) -> list[str]:
    """Random task group ``g`` of size ``n`` (the same groups for every setting of the other hyperparameters)."""
    if n > len(pool):
        raise ConfigError(f"n_experts={n} exceeds the suite's {len(pool)} tasks")
    rng = np.random.default_rng([group_seed, n, g])
    return [pool[i].spec for i in sorted(rng.choice(len(pool), size=n, replace=False))]


def _settings(spec: StudySpec) -> list[tuple[dict[str, Any], str | None]]:
    base = spec.defaults.model_dump()
    grid = {k: v for k, v in spec.grid.model_dump().items() if v}
    if spec.design == "full":
        keys = list(grid)
        return [({**base, **dict(zip(keys, vals))}, None) for vals in itertools.product(*grid.values())]
    out, seen = [(base, None)], {json.dumps(base, sort_keys=True)}
    for key, values in grid.items():
        for v in values:
            s = {**base, key: v}
            tag = json.dumps(s, sort_keys=True)
            if tag not in seen:
                seen.add(tag)
                out.append((s, key))
    return out


def expand_points(spec: StudySpec) -> list[Point]:
    """Every merged point of the study: settings x seeds x task groups x methods (plus weighting points)."""
    pool = spec.tasks()
    points = []
    for setting, varied in _settings(spec):
        for seed in spec.seeds:
            for g in range(spec.groups):
                tasks = task_group(pool, setting["n_experts"], g, spec.group_seed)
                for m in spec.methods:
                    points.append(Point(**setting, seed=seed, group=g, tasks=tasks, method=m, varied=varied))
    ks = spec.measure.weighting_steps
    if ks:
        d = spec.defaults.model_dump() | {"n_experts": len(ks), "steps": list(ks)}
        for seed in spec.seeds:
            tasks = task_group(pool, len(ks), 0, spec.group_seed)
            points.append(Point(**d, kind="weighting", seed=seed, group=0, tasks=tasks, method={"name": "weight_average"}))
    return points


def parse_study(data: dict | None) -> StudySpec:
    """Validate a dict into a :class:`StudySpec` (unknown keys and bad values -> :class:`ConfigError`)."""
    spec = validate_strict(StudySpec, data)
    spec.tasks()
    return spec


def load_study(path: str | Path, overrides: list[str] | None = None) -> StudySpec:
    """Read a study YAML and apply ``dotted.key=value`` overrides (as ``clmerge run --set``)."""
    return parse_study(apply_overrides(read_yaml_mapping(path, "study spec"), overrides or []))
