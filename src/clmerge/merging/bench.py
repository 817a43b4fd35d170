"""The merging benchmark: experts fine-tuned from one tiny ViT on offline tasks, every method evaluated.

Tasks are offline image sets (MNIST-5k, scikit-learn digits, Fashion-MNIST when installed) under fixed
transformations (rotation, pixel permutation, inversion); each task has its own head. Experts are cached as
safetensors next to the JSON config whose SHA-256 names them, so a rerun with the same config trains nothing.
Every method's hyperparameters are chosen on a validation split carved from the training data; test data is
used only for the reported numbers. Run it with ``clmerge merge-bench`` (see ``benchmarks/merging/``).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..utils.io import atomic_write_text, load_tensors, save_tensors, write_json
from .registry import merge

__all__ = ["BenchTask", "BenchConfig", "SUITES", "DEFAULT_GRIDS", "run_benchmark", "expert_for_task", "train_expert",
           "init_expert", "expert_digest", "expert_path", "loss_and_accuracy", "parse_task", "split_expert"]


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


def parse_task(spec: str) -> BenchTask:
    """``"dataset:transform[:classes]"`` -> :class:`BenchTask` (``"digits"`` alone means the identity transform)."""
    d, _, rest = spec.partition(":")
    tr, _, classes = rest.partition(":")
    task = BenchTask(d, tr or "identity", classes or None)
    task.class_list()  # validate early
    return task


_t = parse_task


SUITES: dict[str, list[BenchTask]] = {
    "8": [_t(s) for s in ("mnist5k:identity", "mnist5k:rot90", "mnist5k:rot180", "mnist5k:invert", "mnist5k:perm1",
                          "digits:identity", "digits:rot90", "digits:invert")],
}
SUITES["14"] = SUITES["8"] + [_t(s) for s in ("mnist5k:rot270", "mnist5k:perm2", "digits:rot180", "digits:perm1",
                                              "fashion_mnist:rot90", "fashion_mnist:invert")]
# Eight tasks that share their input statistics: 5-way class splits of the three datasets (and of rotated
# MNIST-5k). Task vectors of such experts interfere less than those of unrelated input transformations.
SUITES["split8"] = [_t(s) for s in ("mnist5k:identity:0-4", "mnist5k:identity:5-9", "digits:identity:0-4",
                                    "digits:identity:5-9", "fashion_mnist:identity:0-4",
                                    "fashion_mnist:identity:5-9", "mnist5k:rot90:0-4", "mnist5k:rot90:5-9")]
SUITES["tiny"] = [_t(s) for s in ("digits:identity", "digits:rot90", "digits:invert")]

DEFAULT_GRIDS: dict[str, dict[str, list[Any]]] = {
    "weight_average": {},
    "task_arithmetic": {"scaling": [0.1, 0.2, 0.3, 0.5, 0.7, 1.0]},
    "ties": {"density": [0.1, 0.2], "scaling": [0.5, 1.0, 1.5]},
    "dare": {"drop_rate": [0.5, 0.9], "scaling": [0.2, 0.3, 0.5]},
    "consensus": {"k": [2], "scaling": [0.2, 0.3, 0.5, 0.7]},
    "low_rank_task_arithmetic": {"rank_ratio": [0.04, 0.08, 0.16, 0.32], "scaling": [0.3, 0.5, 1.0]},
    "cart": {"rank_ratio": [0.04, 0.08, 0.16, 0.32], "scaling": [0.5, 1.0, 1.5, 2.0, 3.0]},
}


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
    seed: int = 0
    # Added for the expert studies of clmerge.theory. They enter the expert's cache key only when they differ
    # from these defaults, so experts cached before these fields existed keep their names.
    steps: int | None = None  # a fixed number of optimizer steps (overrides ``epochs``)
    optimizer: str = "adamw"  # "sgd" (plain mini-batch SGD, the theory's setting), "adam" or "adamw"
    momentum: float = 0.0  # SGD only
    data_ratio: float = 1.0  # fraction of the (capped) training split used, the paper's alpha_i
    perturb: int | None = None  # replace training sample ``perturb`` by a held-out one (L2-stability twin)

    _NEW_DEFAULTS = {"steps": None, "optimizer": "adamw", "momentum": 0.0, "data_ratio": 1.0, "perturb": None}

    def expert_key(self, task: BenchTask) -> dict:
        keep = {k: v for k, v in asdict(self).items() if k not in ("suite", "max_eval")}
        keep = {k: v for k, v in keep.items() if k not in self._NEW_DEFAULTS or v != self._NEW_DEFAULTS[k]}
        task_d = {k: v for k, v in asdict(task).items() if k != "classes" or v is not None}
        return {"task": task_d, **keep}


def _transform(spec: str, x: Tensor) -> Tensor:
    if spec == "identity":
        return x
    if spec == "invert":
        return 1.0 - x
    if spec.startswith("rot"):
        from ..data import Rotation

        return Rotation(float(spec[3:]))(x)
    if spec.startswith("perm"):
        from ..data import PixelPermutation

        return PixelPermutation(int(spec[4:]), x.shape[-1] * x.shape[-2])(x)
    raise ValueError(f"unknown transform {spec!r}")


@functools.lru_cache(maxsize=8)
def _splits(dataset: str):
    """The data source's splits, built once per process (studies load the same tasks many times)."""
    from ..data import build_dataset

    return build_dataset(dataset)


def load_task(task: BenchTask, cfg: BenchConfig) -> dict[str, tuple[Tensor, Tensor]]:
    """``{"train", "val", "test"}`` -> ``(x, y)`` tensors for ``task`` (val carved from train with a fixed seed)."""
    splits = _splits(task.dataset)
    out = {}
    rng = np.random.default_rng(cfg.seed)
    tr = rng.permutation(len(splits.train))
    n_val = max(1, int(cfg.val_fraction * len(tr)))
    # test order shuffled too (fixed seed): a capped test set must not be the first, maybe one-class, rows
    parts = {"val": tr[:n_val], "train": tr[n_val:], "test": rng.permutation(len(splits.test))}
    source = {"val": splits.train, "train": splits.train, "test": splits.test}
    wanted = task.class_list()
    lut = None
    if wanted is not None:  # keep only the task's classes (in each part's order) and renumber them 0..k-1
        parts = {name: idx[np.isin(source[name].targets[idx], wanted)] for name, idx in parts.items()}
        lut = torch.full((int(max(splits.train.targets.max(), splits.test.targets.max())) + 1,), -1, dtype=torch.long)
        lut[torch.as_tensor(wanted)] = torch.arange(len(wanted))
    for name, idx in parts.items():
        src = source[name]
        cap = cfg.max_train if name == "train" else cfg.max_eval
        idx = idx[:cap] if cap else idx
        if name == "train" and cfg.data_ratio < 1.0:
            idx = idx[:max(1, int(round(cfg.data_ratio * len(idx))))]
        if name == "train" and cfg.perturb is not None:
            # Definition 1 of the theory spec: the j-th sample replaced by an independent draw z~_j (the
            # first validation sample, never a training sample).
            idx = idx.copy()
            idx[cfg.perturb % len(idx)] = parts["val"][0]
        x, y = src.get_batch(idx)
        y = torch.as_tensor(y, dtype=torch.long)
        out[name] = (_transform(task.transform, x.float()), y if lut is None else lut[y])
    return out


def build_base(cfg: BenchConfig) -> nn.Module:
    """The shared starting backbone (shipped weights, or a seeded random init)."""
    from ..models import build_backbone

    torch.manual_seed(cfg.seed)
    kw = {"pretrained": cfg.pretrained} | ({"config": cfg.arch} if cfg.arch else {})
    return build_backbone(cfg.backbone, **kw)


def _accuracy(backbone: nn.Module, head: nn.Module, x: Tensor, y: Tensor, bs: int = 256) -> float:
    backbone.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), bs):
            correct += int((head(backbone(x[i:i + bs])).argmax(-1) == y[i:i + bs]).sum())
    return 100.0 * correct / max(1, len(x))


def loss_and_accuracy(backbone: nn.Module, head: nn.Module, x: Tensor, y: Tensor, bs: int = 256) -> tuple[float, float]:
    """``(summed cross-entropy, number correct)`` of ``head(backbone(x))`` against ``y`` (sums, for pooling)."""
    backbone.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), bs):
            logits = head(backbone(x[i:i + bs]))
            loss += float(F.cross_entropy(logits.double(), y[i:i + bs], reduction="sum"))
            correct += int((logits.argmax(-1) == y[i:i + bs]).sum())
    return loss, correct


def expert_digest(task: BenchTask, cfg: BenchConfig) -> str:
    """SHA-256 of the JSON of everything that makes the expert of ``task`` (its cache identity)."""
    return hashlib.sha256(json.dumps(cfg.expert_key(task), sort_keys=True).encode()).hexdigest()


def expert_path(cache: Path, task: BenchTask, cfg: BenchConfig) -> Path:
    """Where the expert of ``task`` under ``cfg`` is cached (safetensors; its config JSON sits beside it)."""
    return cache / f"{task.name}-{expert_digest(task, cfg)[:16]}.safetensors"


def init_expert(cfg: BenchConfig, num_classes: int) -> tuple[nn.Module, nn.Module]:
    """The starting point of every expert: the shared base backbone and a seeded fresh head."""
    backbone = build_base(cfg)
    return backbone, nn.Linear(backbone.feature_dim, num_classes)


def _optimizer(cfg: BenchConfig, params: list) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r} (expected sgd, adam or adamw)")


def _batches(n: int, cfg: BenchConfig, g: torch.Generator):
    """Index batches: ``epochs`` passes, or exactly ``steps`` batches over repeated seeded permutations."""
    if cfg.steps is None:
        for _ in range(cfg.epochs):
            yield from torch.randperm(n, generator=g).split(cfg.batch_size)
        return
    done = 0
    while done < cfg.steps:
        for idx in torch.randperm(n, generator=g).split(cfg.batch_size):
            if done == cfg.steps:
                return
            yield idx
            done += 1


def train_expert(cfg: BenchConfig, data: dict) -> dict[str, Tensor]:
    """Fine-tune one expert from :func:`init_expert` on ``data["train"]``; keys ``backbone.*`` and ``head.*``."""
    x, y = data["train"]
    backbone, head = init_expert(cfg, int(y.max()) + 1)
    opt = _optimizer(cfg, list(backbone.parameters()) + list(head.parameters()))
    g = torch.Generator().manual_seed(cfg.seed)
    backbone.train()
    for idx in _batches(len(x), cfg, g):
        loss = F.cross_entropy(head(backbone(x[idx])), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {f"backbone.{k}": v for k, v in backbone.state_dict().items()} | \
           {f"head.{k}": v for k, v in head.state_dict().items()}


def split_expert(sd: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``(backbone params, head params)`` of a saved expert dict."""
    split = lambda p: {k[len(p):]: v for k, v in sd.items() if k.startswith(p)}  # noqa: E731
    return split("backbone."), split("head.")


def expert_for_task(task: BenchTask, cfg: BenchConfig, data: dict, cache: Path) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``(backbone params, head params)`` of the expert for ``task``: from the cache, or fine-tuned now."""
    path = expert_path(cache, task, cfg)
    if path.exists():
        sd = load_tensors(path)
    else:
        digest = expert_digest(task, cfg)
        sd = train_expert(cfg, data)
        save_tensors(path, sd, metadata={"sha256_of_config": digest})
        write_json(path.with_suffix(".json"), {"sha256": digest, "config": cfg.expert_key(task)})
    return split_expert(sd)


def _grid(space: dict[str, list[Any]]) -> list[dict[str, Any]]:
    keys = list(space)
    return [dict(zip(keys, vals)) for vals in itertools.product(*(space[k] for k in keys))] or [{}]


def _evaluate(backbone: nn.Module, params: dict[str, Tensor], heads: list[nn.Module], data: list[dict],
              split: str) -> list[float]:
    backbone.load_state_dict(params)
    return [_accuracy(backbone, h, *d[split]) for h, d in zip(heads, data)]


def run_benchmark(cfg: BenchConfig, out: Path, *, grids: dict[str, dict[str, list[Any]]] | None = None,
                  cache: Path | None = None, log=print, analysis: bool = True) -> dict:
    """Fine-tune (or load) the experts, search each method's grid on validation, report test accuracy.

    Writes ``out/results.json`` and ``out/results.md``; with ``analysis`` (and CART in the grids) also
    CART's rank-ratio curve, spectra and interference (``bench_analysis``) as PNG files embedded in the
    Markdown. Returns the results dict.
    """
    tasks = SUITES[cfg.suite]
    grids = DEFAULT_GRIDS if grids is None else grids
    cache = cache or out / "experts"
    data = [load_task(t, cfg) for t in tasks]
    base_model = build_base(cfg)
    base = {k: v.clone() for k, v in base_model.state_dict().items()}
    experts, heads = [], []
    for t, d in zip(tasks, data):
        log(f"expert {t.name}")
        bp, hp = expert_for_task(t, cfg, d, cache)
        head = nn.Linear(base_model.feature_dim, hp["weight"].shape[0])
        head.load_state_dict(hp)
        experts.append(bp)
        heads.append(head)
    individual = [_evaluate(base_model, e, [h], [d], "test")[0] for e, h, d in zip(experts, heads, data)]
    rows = {"pretrained": {"hp": {}, "test": _evaluate(base_model, base, heads, data, "test")},
            "individual": {"hp": {}, "test": individual}}
    curves: dict[str, list] = {}
    for method, space in grids.items():
        best, best_val, seen = None, -1.0, []
        for hp in _grid(space):
            merged = merge(method, base=base, experts=experts, **hp)
            val = float(np.mean(_evaluate(base_model, merged, heads, data, "val")))
            seen.append({"hp": hp, "val": val})
            if val > best_val:
                best, best_val = hp, val
        merged = merge(method, base=base, experts=experts, **best)
        rows[method] = {"hp": best, "val": best_val, "test": _evaluate(base_model, merged, heads, data, "test")}
        curves[method] = seen
        log(f"{method}: {best} val {best_val:.2f}")
    for r in rows.values():
        r["avg"] = float(np.mean(r["test"]))
        r["normalized"] = float(np.mean([a / max(i, 1e-9) for a, i in zip(r["test"], individual)])) * 100
    results = {"config": asdict(cfg), "tasks": [t.name for t in tasks], "rows": rows, "search": curves}
    if analysis and "cart" in grids:
        from .bench_analysis import analyse, write_plots

        log("analysis: rank-ratio curve, spectra, interference")
        mean_test = lambda p: float(np.mean(_evaluate(base_model, p, heads, data, "test")))  # noqa: E731
        results["analysis"] = analyse(base, experts, mean_test, rows)
        results["plots"] = write_plots(results["analysis"], rows, out)
    write_json(out / "results.json", results)
    atomic_write_text(out / "results.md", results_markdown(results))
    return results


def results_markdown(results: dict) -> str:
    """The results table: absolute test accuracy per task, average, normalized accuracy, chosen hyperparameters."""
    tasks = results["tasks"]
    head = "| method | " + " | ".join(tasks) + " | avg | normalized | hyperparameters (val-selected) |"
    lines = [head, "|" + "---|" * (len(tasks) + 4)]
    for name, r in results["rows"].items():
        cells = " | ".join(f"{a:.1f}" for a in r["test"])
        lines.append(f"| {name} | {cells} | {r['avg']:.1f} | {r['normalized']:.1f} | {r['hp'] or ''} |")
    text = "\n".join(lines) + "\n"
    if "analysis" in results:
        from .bench_analysis import analysis_markdown

        text += analysis_markdown(results["rows"], results["analysis"], results.get("plots", []))
    return text


def bench_command(out: Path, suite: str = "8", epochs: int = 5, lr: float = 1e-4, max_train: int | None = None,
                  max_eval: int | None = None, random_init: bool = False, methods: Sequence[str] | None = None) -> dict:
    """What ``clmerge merge-bench`` runs (kept free of typer so tests can call it)."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; known: {', '.join(SUITES)}")
    cfg = BenchConfig(suite=suite, epochs=epochs, lr=lr, max_train=max_train, max_eval=max_eval, pretrained=not random_init)
    grids = DEFAULT_GRIDS if not methods else {m: DEFAULT_GRIDS.get(m, {}) for m in methods}
    return run_benchmark(cfg, out, grids=grids)
