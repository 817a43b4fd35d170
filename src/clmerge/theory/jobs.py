"""The two kinds of job a study runs, as plain picklable functions (any backend can ship them).

* :func:`expert_job` fine-tunes one expert and returns its weights as safetensors bytes plus its own test
  results; it touches no file, so a worker on another machine needs nothing but the code and the data.
* :func:`merge_job` merges one point's experts with one method, evaluates the merged model on the union of
  the tasks' test sets and measures the terms of the bound (``theory.quantities``).

Both fix torch's thread count to the study's ``threads`` while they run, so the numbers are the same on
every backend (a different count changes float reduction order).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor, nn

from ..merging import merge
from ..merging.methods.adamerging import adamerging
from ..harness.merge_bench import BenchConfig, init_expert, load_task, loss_and_accuracy, parse_task, split_expert, train_expert
from . import quantities as q
from .spec import Point, StudySpec, canonical_method, expert_config

__all__ = ["expert_job", "merge_job", "stability_configs", "encode", "decode"]

Params = dict[str, Tensor]


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run with ``n`` intra-op threads, then restore."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def encode(params: Params) -> bytes:
    return st_save({k: v.detach().contiguous() for k, v in params.items()})


def decode(blob: bytes) -> Params:
    """Safetensors bytes -> tensors, keys sorted (``load`` returns them in no fixed order)."""
    d = st_load(blob)
    return {k: d[k] for k in sorted(d)}


@lru_cache(maxsize=64)
def _task_data(task: str, cfg_json: str) -> dict[str, tuple[Tensor, Tensor]]:
    return load_task(parse_task(task), BenchConfig(**json.loads(cfg_json)))


_DATA_FIELDS = ("max_train", "max_eval", "val_fraction", "seed", "data_ratio", "perturb", "data_options")


def task_data(task: str, cfg: BenchConfig) -> dict[str, tuple[Tensor, Tensor]]:
    """``load_task`` with a per-process cache keyed by the fields that shape the data (never modified)."""
    return _task_data(task, json.dumps({k: getattr(cfg, k) for k in _DATA_FIELDS}, sort_keys=True))


def _own_results(sd: Params, cfg: BenchConfig, data: dict) -> dict[str, float]:
    bb, hd = split_expert(sd)
    backbone, head = init_expert(cfg, hd["weight"].shape[0])
    backbone.load_state_dict(bb)
    head.load_state_dict(hd)
    x, y = data["test"]
    loss, correct = loss_and_accuracy(backbone, head, x, y)
    return {"test_loss": loss / len(y), "test_acc": 100.0 * correct / len(y)}


def expert_job(task: str, cfg: dict[str, Any], threads: int = 1) -> dict[str, Any]:
    """Fine-tune the expert of ``task`` under the bench config ``cfg``.

    Returns:
        ``{"params": safetensors bytes, "info": {"task", "n_train", "train_s", "test_loss", "test_acc"}}``.
    """
    with torch_threads(threads):
        bcfg = BenchConfig(**cfg)
        data = task_data(task, bcfg)
        t0 = time.perf_counter()
        sd = train_expert(bcfg, data)
        train_s = time.perf_counter() - t0
        info = {"task": task, "n_train": len(data["train"][1]), "train_s": train_s, **_own_results(sd, bcfg, data)}
        return {"params": encode(sd), "info": info}


def _merge(p: Point, base: Params, experts: list[Params], heads: list[nn.Module], backbone: nn.Module,
           data: list[dict]) -> tuple[Params, dict[str, Any]]:
    opts = {k: v for k, v in p.method.items() if k != "name"}
    name = canonical_method(p.method["name"])
    if name != "adamerging":  # study methods are named as in the merge registry
        return merge(name, base=base, experts=experts, **opts), {}
    # AdaMerging (task-wise by default) on task arithmetic, entropy on the unlabeled validation inputs.
    unlabeled = [[d["val"][0][i:i + 64] for i in range(0, len(d["val"][0]), 64)] for d in data]
    merged, lam = adamerging(base=base, experts=experts, model=backbone, unlabeled=unlabeled,
                             forward=lambda m, t, x: heads[t](m(x)), **opts)
    return merged, {"adamerging_lambda": lam.tolist()}


def _evaluate(backbone: nn.Module, params: Params, heads: list[nn.Module], data: list[dict]) -> dict[str, Any]:
    """Loss and accuracy pooled over the union of the tasks' test sets (each task through its own head)."""
    backbone.load_state_dict(params)
    losses, accs, tot_loss, tot_correct, tot_n = [], [], 0.0, 0, 0
    for h, d in zip(heads, data):
        x, y = d["test"]
        loss, correct = loss_and_accuracy(backbone, h, x, y)
        losses.append(loss / len(y))
        accs.append(100.0 * correct / len(y))
        tot_loss, tot_correct, tot_n = tot_loss + loss, tot_correct + correct, tot_n + len(y)
    return {"merged_loss": tot_loss / tot_n, "merged_acc": 100.0 * tot_correct / tot_n,
            "per_task_loss": losses, "per_task_acc": accs}


_BASE_FIELDS = ("backbone", "pretrained", "arch", "seed")


@lru_cache(maxsize=16)
def _task_gradient(task: str, key: str, m: int) -> tuple[Params, float]:
    """``(g_i, sigma_i^2)`` of ``task`` at the start of fine-tuning; cached per process, since every method
    and every setting that shares the data and the base shares it."""
    cfg = BenchConfig(**json.loads(key))
    x, y = task_data(task, cfg)["train"]
    backbone, head = init_expert(cfg, int(y.max()) + 1)
    return q.gradient_stats(backbone, head, x[:m], y[:m])


def _gradient_terms(spec: StudySpec, cfgs: list[BenchConfig], tasks: list[str]) -> dict[str, Any]:
    """``sigma_i^2`` and ``zeta_i^2`` at the start of fine-tuning (base backbone, seeded fresh head)."""
    stats = [_task_gradient(t, json.dumps({k: getattr(c, k) for k in _DATA_FIELDS + _BASE_FIELDS}, sort_keys=True),
                            spec.measure.noise_samples) for t, c in zip(tasks, cfgs)]
    return {"sigma2": [s2 for _, s2 in stats], "zeta2": q.heterogeneity([g for g, _ in stats])}


def _heterogeneity_terms(p: Point, tvs: list[Params]) -> dict[str, float]:
    before = q.dispersion(tvs)
    name, m = p.method["name"], p.method
    if name == "ties":
        after = q.dispersion(q.ties_operator(tvs, m["density"]))
    elif name == "dare":
        after = q.dispersion(q.dare_operator(tvs, m["drop_rate"], rescale=m["rescale"], seed=m["seed"]))
    else:
        after = before
    return {"het_before": before, "het_after": after}


def merge_job(point: dict[str, Any], spec: dict[str, Any], experts: list[dict], twins: list[dict] | None = None,
              refs: list[dict] | None = None, originals: list[dict] | None = None) -> dict[str, Any]:
    """Merge one point's experts with its method, evaluate, and measure the bound's terms.

    Args:
        point, spec: ``Point`` and ``StudySpec`` as dicts.
        experts: the experts (``expert_job``'s results), in the point's task order.
        twins: the L2-stability twins of expert 0 (:func:`stability_configs` order: draw-major, then the
            replaced index), if measured.
        refs: for ``kind="weighting"``: the same tasks' experts after the default number of steps.
        originals: the originals of the stability draws r >= 1 (draw 0's original is ``experts[0]``).

    Returns:
        The record of one results.jsonl line (without the driver's fields: point id, expert results).
    """
    p, s = Point(**point), StudySpec(**spec)
    with torch_threads(s.threads):
        t0 = time.perf_counter()
        cfgs = [cfg for _, cfg in p.expert_configs(s)]
        data = [task_data(t, c) for t, c in zip(p.tasks, cfgs)]
        backbone, _ = init_expert(cfgs[0], 2)
        base = {k: v.clone() for k, v in backbone.state_dict().items()}
        parts = [split_expert(decode(e["params"])) for e in experts]
        heads = []
        for _, hd in parts:
            h = nn.Linear(backbone.feature_dim, hd["weight"].shape[0])
            h.load_state_dict(hd)
            heads.append(h)
        bbs = [bb for bb, _ in parts]
        merged, extra = _merge(p, base, bbs, heads, backbone, data)
        t1 = time.perf_counter()
        rec: dict[str, Any] = {**_evaluate(backbone, merged, heads, data), **extra}
        t2 = time.perf_counter()
        tvs = q.task_vectors(base, bbs)
        rec |= _gradient_terms(s, cfgs, p.tasks) | _heterogeneity_terms(p, tvs)
        rec["n_train"] = [len(d["train"][1]) for d in data]
        rec["n_classes"] = [h.out_features for h in heads]  # chance loss ln C per task (clmerge advise)
        if twins:
            rec |= _stability_terms(bbs[0], originals or [], twins)
        if refs is not None:
            avg_tv = q.task_vectors(base, [merged])[0]
            ref_tvs = q.task_vectors(base, [split_expert(decode(e["params"]))[0] for e in refs])
            rec["implicit_weights"] = q.implicit_weights(avg_tv, ref_tvs)
            rec["displacement_share"] = q.displacement_share(tvs)
            rec["predicted_weights"] = q.predicted_weights(p.steps)
        rec["timings"] = {"merge_s": t1 - t0, "eval_s": t2 - t1, "measure_s": time.perf_counter() - t2}
        return rec


def _stability_terms(first: Params, originals: list[dict], twins: list[dict]) -> dict[str, Any]:
    """On-average L2 stability (Definition 2): the mean of ``||A(D) - A(D^(i))||^2`` over every (draw, index)
    pair, exact zeros included (a replaced sample that was never drawn leaves the run unchanged: a true zero of
    the expectation, not a failed measurement); the pairs and the count of zeros are kept for the report."""
    bases = [first] + [split_expert(decode(o["params"]))[0] for o in originals]
    per_draw = len(twins) // len(bases)
    dists = [q.squared_distance(bases[i // per_draw], split_expert(decode(t["params"]))[0])
             for i, t in enumerate(twins)]
    return {"stability_sq": float(np.mean(dists)), "stability_pairs": dists,
            "stability_zero": sum(d == 0.0 for d in dists)}


def stability_configs(spec: StudySpec, p: Point) -> list[tuple[BenchConfig, list[BenchConfig]]]:
    """Per stability draw r: the original's config (seed + 1000 r; r = 0 is the point's first expert) and
    its twins' configs, one per replaced training-sample index (``measure.stability_indices``)."""
    steps = p.steps[0] if isinstance(p.steps, list) else p.steps
    out = []
    for r in range(spec.measure.stability_seeds):
        pr = p.model_copy(update={"seed": p.seed + 1000 * r})
        out.append((expert_config(spec, pr, steps),
                    [expert_config(spec, pr, steps, perturb=j) for j in spec.measure.stability_indices]))
    return out
