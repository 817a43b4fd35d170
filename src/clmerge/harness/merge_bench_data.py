"""The merging benchmark's tasks: offline image or text sets, optionally transformed, split train/val/test.

Image tasks are offline image sets (MNIST-5k, scikit-learn digits, Fashion-MNIST when installed) under fixed
transformations (rotation, pixel permutation, inversion). Text tasks are class subsets of a text source
(``wordnet_supersense``) whose inputs are int64 token ids and attention masks ``(N, 2, L)``: they are kept as
they are and allow only the ``identity`` transform. Either kind may be restricted to a subset of classes.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import torch
from torch import Tensor

from .merge_bench_config import BenchConfig, BenchTask

__all__ = ["BenchTask", "SUITES", "SUITE_BACKBONES", "SUITE_CAPS", "TEXT6_GROUPS", "parse_task", "load_task"]


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

# Text: the 40 supersenses of wordnet_supersense (class ids in text_wordnet.DEFAULT_CLASSES order: nouns 0-24,
# verbs 25-39) cut into 6 tasks of semantically related supersenses, every class in exactly one task and no
# task mixing nouns and verbs. Related classes make each task a fine distinction (an act vs. a cognition vs. a
# communication) that a frozen sentence embedding separates less well than a coarse topic split, which leaves
# fine-tuning room to gain over the frozen head; disjoint classes make the six experts' tasks distinct.
TEXT6_GROUPS: dict[str, list[str]] = {
    "concrete": ["noun.animal", "noun.artifact", "noun.body", "noun.food", "noun.object", "noun.plant",
                 "noun.substance"],
    "abstract": ["noun.act", "noun.attribute", "noun.cognition", "noun.communication", "noun.feeling",
                 "noun.motive"],
    "happenings": ["noun.event", "noun.phenomenon", "noun.process", "noun.shape", "noun.state", "noun.time"],
    "social": ["noun.group", "noun.location", "noun.person", "noun.possession", "noun.quantity", "noun.relation"],
    "physical_verbs": ["verb.body", "verb.change", "verb.consumption", "verb.contact", "verb.creation",
                       "verb.motion", "verb.weather"],
    "mental_social_verbs": ["verb.cognition", "verb.communication", "verb.competition", "verb.emotion",
                            "verb.perception", "verb.possession", "verb.social", "verb.stative"],
}


def _text6() -> list[BenchTask]:
    from ..data.text_wordnet import DEFAULT_CLASSES

    return [BenchTask("wordnet_supersense", "identity", ",".join(str(DEFAULT_CLASSES.index(c)) for c in names))
            for names in TEXT6_GROUPS.values()]


SUITES["text6"] = _text6()
# Three small tasks for tests and dry runs (classes 0-3 also exist in a 4-class generated WordNet)
SUITES["text-tiny"] = [_t(s) for s in ("wordnet_supersense:identity:0-1", "wordnet_supersense:identity:2-3",
                                       "wordnet_supersense:identity:0,3")]
# The backbone a suite is meant for (``clmerge merge-bench --backbone`` overrides it; others: vit-tiny-fmnist)
SUITE_BACKBONES: dict[str, str] = {"text6": "minilm-l6", "text-tiny": "minilm-l6"}
# Default (max_train, max_eval) per task where a suite needs one: text6's cap makes one full fine-tuning of
# MiniLM 768 x 5 / 64 = 60 steps (5 epochs, batch 64): ~1 min on an idle core, 80-340 s measured on the loaded
# shared 2-core machine (benchmarks/merging/README.md, text suite).
SUITE_CAPS: dict[str, tuple[int | None, int | None]] = {"text6": (768, 400), "text-tiny": (64, 64)}


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
def _splits(dataset: str, options_json: str = "{}"):
    """The data source's splits, built once per process (studies load the same tasks many times).

    ``options_json``: the source's keyword options as JSON (``BenchConfig.data_options``; ``{}``: its defaults,
    e.g. wordnet_supersense's 40 classes tokenised with minilm-l6's tokenizer).
    """
    from ..data import build_dataset

    return build_dataset(dataset, **json.loads(options_json))


def _check_transform(task: BenchTask, x: Tensor) -> None:
    if not x.is_floating_point() and task.transform != "identity":
        raise ValueError(f"task {task.spec!r}: {task.dataset} is a text source (token ids); only the 'identity' "
                         f"transform applies, not {task.transform!r}")


def load_task(task: BenchTask, cfg: BenchConfig) -> dict[str, tuple[Tensor, Tensor]]:
    """``{"train", "val", "test"}`` -> ``(x, y)`` tensors for ``task`` (val carved from train with a fixed seed)."""
    splits = _splits(task.dataset, json.dumps(cfg.data_options, sort_keys=True))
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
            # Definition 1 of Li, Tang et al. (arXiv:2601.21690): the j-th sample replaced by an independent
            # draw z~_j (the first validation sample, never a training sample).
            idx = idx.copy()
            idx[cfg.perturb % len(idx)] = parts["val"][0]
        x, y = src.get_batch(idx)
        _check_transform(task, x)  # token ids (text) are kept as they are: only the identity applies
        x = _transform(task.transform, x.float()) if x.is_floating_point() else x
        y = torch.as_tensor(y, dtype=torch.long)
        out[name] = (x, y if lut is None else lut[y])
    return out
