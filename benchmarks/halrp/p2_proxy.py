"""Check P2 of results.md, a proxy of HALRP's Theorem 1 (Li et al., TKDE 2024), on permuted Fashion-MNIST.

Train a network on task 0 (the base), warm it up for one epoch on task 1 (W^free, new head), and for every
perturbed layer l and rank k replace W^free_l by R W_base S + B^(k) (the other layers stay free). Compare the
actual validation-loss increase with the Hessian-aware prediction 1/2 * c_l * g_l * sum_{i>k} sigma_{l,i}^2
(g_l as in the code: per-entry mean of squared mini-batch gradients; also the paper's sum). Report Spearman
correlations (over all (l, k) and across layers at fixed k), and the loss of the global alpha-cut against an
equal-rank allocation with the same number of U'/V' parameters. For convs the baseline is the full-rank
spatially-averaged residual (the increase is due to the truncation only).

    python benchmarks/halrp/p2_proxy.py --net lenet --out benchmarks/halrp/p2_lenet.json
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr
from torch import nn

from clmerge.data import build_dataset, build_scenario
from clmerge.models import build_backbone
from clmerge.methods.halrp import low_rank_perturbation as lrp

RANKS = [1, 2, 4, 8, 16, 32, 64]


def _data(n_train: int, seed: int):
    sp = build_dataset("fashion_mnist")
    sc = build_scenario(sp, kind="task_incremental", n_tasks=2, seed=seed, transform="permutation",
                        permute_first_task=True, train_per_task=n_train, test_per_class=50, val_fraction=0.2)
    return sc.tasks


def _net(name: str) -> nn.Module:
    if name == "mlp":
        return build_backbone("mlp", config={"image_size": 28, "hidden": [256, 256]})
    return build_backbone("lenet", config={"mean": [0.1307] * 3, "std": [0.3081] * 3})


def _train(model: nn.Module, task, epochs: int, seed: int) -> None:
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        for x, y in task.train.batches(64, shuffle=True, generator=g):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y - task.offset).backward()
            opt.step()


@torch.no_grad()
def _loss(model: nn.Module, data, offset: int) -> float:
    model.eval()
    tot, n = 0.0, 0
    for x, y in data.batches(500):
        tot += float(nn.functional.cross_entropy(model(x), y - offset, reduction="sum"))
        n += len(x)
    return tot / n


def _layers(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model[0].named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}


def _importance(model: nn.Module, data, offset: int) -> dict[str, tuple[float, float]]:
    """(mean, sum) of squared mini-batch gradients per layer, eval mode, true labels (Sec. 4.3, as the official code computes it)."""
    layers = _layers(model)
    acc = {n: [0.0, 0.0] for n in layers}
    nb = 0
    model.eval()
    for x, y in data.batches(64):
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y - offset).backward()
        for n, m in layers.items():
            g2 = m.weight.grad.double().pow(2)
            acc[n][0] += float(g2.mean()) * len(x)
            acc[n][1] += float(g2.sum()) * len(x)
        nb += 1
    return {n: (a[0] / nb, a[1] / nb) for n, a in acc.items()}


def _with_weights(free: nn.Module, weights: dict[str, torch.Tensor]) -> nn.Module:
    m = copy.deepcopy(free)
    layers = _layers(m)
    with torch.no_grad():
        for n, w in weights.items():
            layers[n].weight.copy_(w)
    return m


def _approx(info: dict, k: int | None) -> torch.Tensor:
    """R W_base S + B^(k) (k None: full-rank averaged residual), broadcast over conv kernel positions."""
    b = info["b"] if k is None else (lambda uv: uv[0] @ uv[1])(lrp.svd_factors(info["b"], k)[:2])
    w = lrp.scaled_base(info["w_base"].double(), info["r"], info["s"])
    w = w + (b[:, :, None, None] if w.dim() == 4 else b)
    return w.float()


def run(net: str, n_train: int, seed: int) -> dict:
    torch.manual_seed(seed)
    t0, t1 = _data(n_train, seed)
    body = _net(net)
    base = nn.Sequential(body, nn.Linear(body.feature_dim, 10))
    _train(base, t0, 3, seed)
    free = copy.deepcopy(base)
    free[1] = nn.Linear(base[0].feature_dim, 10)
    _train(free, t1, 1, seed + 1)
    g = _importance(free, t1.val, t1.offset)
    info = {}
    for (n, lb), lf in zip(_layers(base).items(), _layers(free).values()):
        wb, wf = lb.weight.detach(), lf.weight.detach()
        r, s = lrp.least_squares_scalings(wf, wb)
        b = lrp.residual_matrix(wf, wb, r, s)
        info[n] = {"w_base": wb, "r": r, "s": s, "b": b, "sigma": torch.linalg.svdvals(b),
                   "c": wb.shape[2] * wb.shape[3] if wb.dim() == 4 else 1}
    rows = []
    for n, d in info.items():
        ref = _loss(_with_weights(free, {n: _approx(d, None)}), t1.val, t1.offset)
        for k in [k for k in RANKS if k < len(d["sigma"])]:
            tail = float(d["sigma"][k:].double().pow(2).sum())
            actual = _loss(_with_weights(free, {n: _approx(d, k)}), t1.val, t1.offset) - ref
            rows.append({"layer": n, "k": k, "actual": actual, "pred_mean": 0.5 * d["c"] * g[n][0] * tail,
                         "pred_sum": 0.5 * d["c"] * g[n][1] * tail})
    out = {"net": net, "n_train": n_train, "seed": seed, "rows": rows,
           "spearman_all_mean": float(spearmanr([r["actual"] for r in rows], [r["pred_mean"] for r in rows])[0]),
           "spearman_all_sum": float(spearmanr([r["actual"] for r in rows], [r["pred_sum"] for r in rows])[0])}
    per_k = {}
    for k in RANKS:
        rk = [r for r in rows if r["k"] == k]
        if len(rk) >= 3:
            per_k[k] = {v: float(spearmanr([r["actual"] for r in rk], [r[f"pred_{v}"] for r in rk])[0])
                        for v in ("mean", "sum")}
    out["spearman_across_layers_at_k"] = per_k
    out["allocation"] = _allocation(free, info, g, t1)
    return out


def _allocation(free, info: dict, g: dict, task) -> dict:
    """Global alpha = 0.9 cut vs equal ranks with about the same U'/V' parameter count."""
    names = list(info)
    scores = lrp.component_scores([info[n]["sigma"] for n in names], [g[n][0] for n in names],
                                  [info[n]["c"] for n in names])
    ranks = lrp.global_rank_selection(scores, 0.9, upper_rank=100)
    dims = [sum(info[n]["b"].shape) for n in names]
    budget = sum(k * d for k, d in zip(ranks, dims))
    k_eq = max(1, round(budget / sum(dims)))
    eq = [min(k_eq, len(info[n]["sigma"])) for n in names]
    loss = lambda ks: _loss(_with_weights(free, {n: _approx(info[n], k) for n, k in zip(names, ks)}),  # noqa: E731
                            task.val, task.offset)
    full = _loss(_with_weights(free, {n: _approx(info[n], None) for n in names}), task.val, task.offset)
    return {"layers": names, "global_ranks": ranks, "equal_ranks": eq, "params_global": budget,
            "params_equal": sum(k * d for k, d in zip(eq, dims)), "loss_full_rank": full,
            "loss_global": loss(ranks), "loss_equal": loss(eq)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--net", choices=["mlp", "lenet"], default="lenet")
    p.add_argument("--n-train", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    res = run(a.net, a.n_train, a.seed)
    a.out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
