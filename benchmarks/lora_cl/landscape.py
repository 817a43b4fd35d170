"""Weight-space landscapes of the LoRA continual-learning methods: SD-LoRA Fig. 4 and P&M Fig. 2.

Both figures use the first two tasks of the default benchmark (Split-MNIST-5k, 5 class-incremental tasks of
2 digits, shipped ``vit-tiny-fmnist`` backbone, the default optimiser, 5 epochs per task), trained with
clmerge's own methods and training loop (``prepare`` + ``fit`` + the method hooks, as ``clmerge run`` does);
only tasks 1 and 2 of the 5-task split are trained.

1. ``fig4_interpolation.png`` (SD-LoRA, Wu et al., ICLR 2025, Sec. 3.3, Finding 3). For ``sd_lora`` and ``seq_lora``: the backbone
   after task 1 (W_1) and after task 2 (W_2), every LoRA folded into the weights. Only the backbone is
   interpolated, W(lambda) = (1 - lambda) W_1 + lambda W_2 for lambda in {0, 0.1, ..., 1}; the head is the one
   after task 2. Accuracy on the TEST data of task 1 and task 2, class-incremental (argmax over the 4 classes
   seen; solid) and task-masked (argmax within the task's own 2 classes; dashed).

2. ``fig2_loss_plane.png`` (P&M, Qiu et al. 2025, Fig. 2). For ``pm`` (LoRA-P&M, task-vector perturbation) and ``pm``
   with ``perturbation: none`` (LoRA-M): after task 2, the plane theta = beta * theta^_1 + alpha * theta*_2,
   where theta^_1 is the merged backbone after task 1 and theta*_2 = theta^_1 + LoRA_2 is the backbone trained
   on task 2 before the merge (snapshotted between training and ``end_task``). The combination is taken over
   every floating backbone tensor (the paper's formula), so points off the line alpha + beta = 1 also rescale
   the frozen weights; the head is the one after task 2. Colour: the cross-entropy averaged over tasks 1 and 2
   on the held-out VALIDATION part of each task's training set (``scenario.val_fraction``; the test data if it
   is 0), in two flavours: task-masked (CE over the task's own logits, the per-task training loss that the
   closed-form alpha* of Eq. 8 approximates, since ``head.loss`` is ``local``) and class-incremental (CE over
   all 4 seen logits). Marked: the convex line alpha + beta = 1, alpha*_2 as logged by ``pm``
   (``method_metrics["alpha"]``, clipped to [0, 1]), the minimum of the loss along the line (a finer 1-D scan),
   and the two endpoints. The horizontal axis is alpha, the weight of the task-specific model theta*_2, the
   vertical axis beta, the weight of the previous merged model (the formula's naming; the paper's caption
   swaps the letters).

Outputs go to ``--out`` (default ``benchmarks/lora_cl/figures``): the two PNGs and ``landscape.json`` with
every number plotted plus summary fields; all written atomically. ``--smoke`` is a seconds-long setting
(random-init 2-block backbone, a few images and steps, a coarse grid) used by ``tests/theory/test_landscape.py``;
``--replot`` redraws the figures and recomputes the summaries from an existing ``landscape.json``.

    OMP_NUM_THREADS=1 nice -n 15 .venv/bin/python benchmarks/lora_cl/landscape.py
    .venv/bin/python benchmarks/lora_cl/landscape.py --smoke --out /tmp/landscape
    .venv/bin/python benchmarks/lora_cl/landscape.py --replot        # figures again, no training
"""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from clmerge.adapters.folded import folded_copy
from clmerge.config import ExperimentConfig, parse_config
from clmerge.engine.run import prepare, resolve_device, task_generator
from clmerge.engine.training import fit
from clmerge.merging.methods.analysis import interpolate
from clmerge.methods.base import TaskContext
from clmerge.utils.io import atomic_write_bytes, write_json

HERE = Path(__file__).resolve().parent
FIG4_METHODS: dict[str, dict] = {"sd_lora": {"name": "sd_lora"}, "seq_lora": {"name": "seq_lora"}}
FIG2_METHODS: dict[str, dict] = {"pm": {"name": "pm"}, "pm_m": {"name": "pm", "perturbation": "none"}}
FIG2_TITLES = {"pm": "LoRA-P&M (pm, task-vector perturbation)", "pm_m": "LoRA-M (pm, perturbation: none)"}
N_TRAINED = 2  # tasks trained (of the scenario's n_tasks)
NEAR_TOL = 0.1  # |argmin on the line - alpha*| counted as "near"
FLAT_TOL = 0.10  # flatness: width of the lambda-interval on the line within +10 % of the line minimum


# -- configuration and training ------------------------------------------------------------------------
def make_config(method: dict, *, seed: int, epochs: int, lr: float, val_fraction: float,
                smoke: bool) -> ExperimentConfig:
    """The default benchmark (``clmerge run`` with no arguments) with ``method``, a seed and a validation split."""
    scen = {"dataset": "mnist5k", "n_tasks": 5, "seed": seed, "val_fraction": val_fraction}
    train: dict = {"epochs": epochs, "batch_size": 64}
    model: dict = {"name": "vit-tiny-fmnist"}
    if smoke:
        scen.update(train_per_class=10, test_per_class=5)
        train = {"epochs": 1, "batch_size": 8, "max_steps_per_epoch": 2}
        model = {"name": "vit-tiny-fmnist", "pretrained": False, "config": {"num_hidden_layers": 2}}
    return parse_config({"seed": seed, "scenario": scen, "model": model, "method": dict(method),
                         "optim": {"name": "adam", "lr": lr}, "train": train,
                         "run": {"progress": False, "report": False, "threads": 1}})


def backbone_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The backbone's tensors with every LoRA component folded in (plain ``nn.Linear`` names), detached copies."""
    return {k: v.detach().clone() for k, v in folded_copy(model).backbone.state_dict().items()}


def train_two_tasks(cfg: ExperimentConfig) -> dict:
    """Train tasks 1 and 2 as ``clmerge run`` does; snapshot the folded backbone before and after each ``end_task``.

    Returns ``{"scenario", "method", "trained": [theta*_1, theta*_2], "after": [W_1, W_2], "net", "seconds"}``:
    ``trained[t]`` is the backbone right after training task t (current LoRA at scale 1, before any merge),
    ``after[t]`` the inference backbone after ``end_task`` (merged / folded), ``net`` the folded inference
    model after task 2 (its head is the head after task 2).
    """
    t0 = time.time()
    device = resolve_device(cfg.run.device)
    scenario, model, method, _ = prepare(cfg)
    model.to(device)
    trained, after = [], []
    for t in range(N_TRAINED):
        task = scenario.tasks[t]
        gen = task_generator(cfg.seed, t)
        ctx = TaskContext(task=task, seen_tasks=scenario.tasks[: t + 1], device=device, generator=gen,
                          head_loss=cfg.head.loss, batch_size=cfg.train.batch_size,
                          eval_batch_size=cfg.train.eval_batch_size, n_tasks=len(scenario))
        method.begin_task(task, ctx)
        model.to(device)
        lr = cfg.optim.first_task_lr if (t == 0 and cfg.optim.first_task_lr) else cfg.optim.lr
        fit(model, task.train, groups=method.parameter_groups(model),
            loss_fn=lambda m, x, y, c=ctx: method.loss(m, x, y, c), optim=cfg.optim, epochs=cfg.train.epochs,
            batch_size=cfg.train.batch_size, generator=gen, device=device, lr=lr,
            before_step=lambda m, c=ctx: method.before_step(m, c), after_step=lambda m, c=ctx: method.after_step(m, c),
            max_steps_per_epoch=cfg.train.max_steps_per_epoch, task_index=t)
        trained.append(backbone_state(model))
        method.end_task(task, ctx)
        after.append(backbone_state(method.inference_model()))
    net = folded_copy(method.inference_model()).to(device)
    return {"scenario": scenario, "method": method, "trained": trained, "after": after, "net": net,
            "device": device, "seconds": time.time() - t0}


# -- evaluation -------------------------------------------------------------------------------------------
def cached_batches(tasks, split: str, batch_size: int = 500) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each task's ``split`` as in-memory batches (loaded once, evaluated hundreds of times)."""
    out = []
    for task in tasks:
        data = getattr(task, split)
        if data is None or len(data) == 0:
            raise ValueError(f"task {task.index} has no {split} data")
        out.append(list(data.batches(batch_size)))
    return out


@torch.no_grad()
def evaluate(net, state: dict[str, torch.Tensor], tasks, batches, device) -> list[dict]:
    """Load ``state`` into ``net.backbone``; per task: CIL / TIL accuracy (%) and CIL / TIL mean cross-entropy."""
    net.backbone.load_state_dict(state, strict=True)
    net.eval()
    n_out = max(t.offset + t.n_classes for t in tasks)
    res = []
    for task, task_batches in zip(tasks, batches):
        lo, hi = task.class_range
        acc = til = ce = ce_til = 0.0
        n = 0
        for x, y in task_batches:
            x, y = x.to(device), y.to(device)
            logits = net(x)[:, :n_out].double()
            local = logits[:, lo:hi]
            acc += float((logits.argmax(-1) == y).sum())
            til += float((local.argmax(-1) + lo == y).sum())
            ce += float(F.cross_entropy(logits, y, reduction="sum"))
            ce_til += float(F.cross_entropy(local, y - lo, reduction="sum"))
            n += len(y)
        res.append({"acc": 100 * acc / n, "til_acc": 100 * til / n, "ce": ce / n, "ce_til": ce_til / n})
    return res


def combine(prev: dict[str, torch.Tensor], task: dict[str, torch.Tensor], alpha: float, beta: float):
    """``beta * prev + alpha * task`` for floating tensors (others from ``prev``); dtypes kept."""
    return {k: (beta * v.double() + alpha * task[k].double()).to(v.dtype) if v.is_floating_point() else v
            for k, v in prev.items()}


def grid(step: float, top: float) -> list[float]:
    return [round(i * step, 6) for i in range(round(top / step) + 1)]


# -- Fig. 4 -----------------------------------------------------------------------------------------------
def fig4_data(method: dict, a) -> dict:
    cfg = make_config(method, seed=a.seed, epochs=a.epochs, lr=a.lr, val_fraction=a.val_fraction, smoke=a.smoke)
    r = train_two_tasks(cfg)
    tasks = r["scenario"].tasks[:N_TRAINED]
    batches = cached_batches(tasks, "test")
    w1, w2 = r["after"]
    lambdas = grid(a.lambda_step, 1.0)
    curves: dict[str, list[float]] = {f"t{i + 1}_{k}": [] for i in range(N_TRAINED) for k in ("acc", "til_acc")}
    for lam in lambdas:
        for i, e in enumerate(evaluate(r["net"], interpolate(w1, w2, lam), tasks, batches, r["device"])):
            curves[f"t{i + 1}_acc"].append(e["acc"])
            curves[f"t{i + 1}_til_acc"].append(e["til_acc"])
    return {"method": method, "lambdas": lambdas, **curves, "train_seconds": round(r["seconds"], 2),
            "method_metrics": r["method"].metrics(),
            "relative_distance": _rel_distance(w1, w2)}


def _rel_distance(w1, w2) -> float:
    """||W_2 - W_1|| / ||W_1|| over the backbone (how far the interpolation moves the weights)."""
    num = sum(float((w2[k].double() - w1[k].double()).pow(2).sum()) for k in w1 if w1[k].is_floating_point())
    den = sum(float(w1[k].double().pow(2).sum()) for k in w1 if w1[k].is_floating_point())
    return float(np.sqrt(num / den))


# -- Fig. 2 -----------------------------------------------------------------------------------------------
def fig2_data(method: dict, a) -> dict:
    cfg = make_config(method, seed=a.seed, epochs=a.epochs, lr=a.lr, val_fraction=a.val_fraction, smoke=a.smoke)
    r = train_two_tasks(cfg)
    tasks = r["scenario"].tasks[:N_TRAINED]
    split = "val" if cfg.scenario.val_fraction > 0 else "test"
    batches = cached_batches(tasks, split)
    prev, star = r["after"][0], r["trained"][1]  # theta^_1 (merged after task 1), theta*_2 (before the merge)
    mm = r["method"].metrics()
    alpha_star, alpha_raw = float(mm["alpha"][-1]), float(mm["alpha_raw"][-1])
    # the merged model pm produced must be theta^_1 + alpha* (theta*_2 - theta^_1)
    expect = interpolate(prev, star, alpha_star)
    merge_err = max(float((expect[k].double() - r["after"][1][k].double()).abs().max()) for k in expect
                    if expect[k].is_floating_point())
    t0 = time.time()
    alphas = betas = grid(a.grid_step, a.grid_max)

    def point(al: float, be: float) -> list[dict]:
        return evaluate(r["net"], combine(prev, star, al, be), tasks, batches, r["device"])

    ce = np.zeros((len(betas), len(alphas)))
    ce_til = np.zeros_like(ce)
    for j, be in enumerate(betas):
        for i, al in enumerate(alphas):
            ev = point(al, be)
            ce[j, i] = np.mean([e["ce"] for e in ev])
            ce_til[j, i] = np.mean([e["ce_til"] for e in ev])
    lambdas = sorted(set(grid(a.line_step, 1.0)) | {alpha_star})
    line = {k: [] for k in ("ce", "ce_til", "t1_acc", "t2_acc", "t1_til_acc", "t2_til_acc")}
    for lam in lambdas:
        ev = point(lam, 1.0 - lam)
        line["ce"].append(float(np.mean([e["ce"] for e in ev])))
        line["ce_til"].append(float(np.mean([e["ce_til"] for e in ev])))
        for i, e in enumerate(ev):
            line[f"t{i + 1}_acc"].append(e["acc"])
            line[f"t{i + 1}_til_acc"].append(e["til_acc"])
    out = {"method": method, "split": split, "alphas": alphas, "betas": betas, "ce": ce.tolist(),
           "ce_til": ce_til.tolist(), "alpha_star": alpha_star, "alpha_star_raw": alpha_raw,
           "alpha_per_task": mm["alpha"], "merge_check_max_abs_diff": merge_err,
           "line": {"lambdas": lambdas, **line}, "train_seconds": round(r["seconds"], 2),
           "landscape_seconds": round(time.time() - t0, 2)}
    return summarize_fig2(out)


def summarize_fig2(d: dict) -> dict:
    """Add ``summary_ce_til`` and ``summary_ce`` (see :func:`line_summary`) to one Fig. 2 entry."""
    for key in ("ce_til", "ce"):
        d[f"summary_{key}"] = line_summary(d["line"]["lambdas"], d["line"][key], d["alpha_star"], d["alphas"],
                                           d["betas"], np.asarray(d[key]))
    return d


def line_summary(lambdas, values, alpha_star: float, alphas, betas, plane: np.ndarray) -> dict:
    """Where the loss is lowest on the convex line, vs alpha*; whether alpha* lies below both ends, flatness, valley."""
    v = np.asarray(values)
    lam = np.asarray(lambdas)
    k = int(np.argmin(v))
    at_star = float(v[int(np.argmin(np.abs(lam - alpha_star)))])
    within = lam[v <= v[k] * (1 + FLAT_TOL)]
    # valley: in each column alpha <= 1, is the lowest-loss beta on (or one grid step from) the line beta = 1 - alpha?
    step = betas[1] - betas[0] if len(betas) > 1 else 1.0
    cols = [i for i, al in enumerate(alphas) if al <= 1.0 + 1e-9]
    on = [abs(betas[int(np.argmin(plane[:, i]))] - (1.0 - alphas[i])) <= step + 1e-9 for i in cols]
    return {"line_min_lambda": float(lam[k]), "line_min": float(v[k]), "at_alpha_star": at_star,
            "excess_at_alpha_star": at_star / float(v[k]) - 1.0,
            "at_lambda0": float(v[0]), "at_lambda1": float(v[-1]),
            "abs_gap_min_vs_alpha_star": abs(float(lam[k]) - alpha_star),
            "min_near_alpha_star": abs(float(lam[k]) - alpha_star) <= NEAR_TOL + 1e-9,
            "alpha_star_below_both_ends": at_star < min(float(v[0]), float(v[-1])),
            "flat_width": float(within.max() - within.min()),
            "valley_fraction": float(np.mean(on)) if on else float("nan"),
            "plane_min": float(plane.min()),
            "plane_argmin_alpha_beta": [float(alphas[int(np.argmin(plane)) % plane.shape[1]]),
                                        float(betas[int(np.argmin(plane)) // plane.shape[1]])]}


# -- figures ----------------------------------------------------------------------------------------------
def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def plot_fig4(data: dict, setting: str) -> bytes:
    fig = _figure(10, 3.8)
    axes = fig.subplots(1, len(data), sharey=True)
    for ax, (label, d) in zip(np.atleast_1d(axes), data.items()):
        lam = d["lambdas"]
        for t, colour in ((1, "tab:blue"), (2, "tab:orange")):
            ax.plot(lam, d[f"t{t}_acc"], "-o", color=colour, ms=4, label=f"T{t} class-incremental")
            ax.plot(lam, d[f"t{t}_til_acc"], "--s", color=colour, ms=3, alpha=0.7, label=f"T{t} task-masked")
        ax.set_title(label, fontsize=10)
        ax.set_xlabel(r"$\lambda$  in  $W(\lambda) = (1-\lambda) W_1 + \lambda W_2$")
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel("test accuracy (%)")
    np.atleast_1d(axes)[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"SD-LoRA Fig. 4 protocol: backbone interpolation task 1 -> task 2, head after task 2\n{setting}",
                 fontsize=9)
    return _png(fig)


def plot_fig2(data: dict, setting: str) -> bytes:
    from matplotlib.colors import LogNorm

    keys = (("ce_til", "task-masked CE"), ("ce", "class-incremental CE"))
    fig = _figure(5.4 * len(data), 4.3 * len(keys) + 3.2)
    axes = np.asarray(fig.subplots(len(keys) + 1, len(data), squeeze=False,
                                   gridspec_kw={"height_ratios": [4.3] * len(keys) + [3.2]}))
    split = next(iter(data.values()))["split"]
    for col, (label, d) in enumerate(data.items()):
        al, be = np.asarray(d["alphas"]), np.asarray(d["betas"])
        for row, (key, name) in enumerate(keys):
            ax = axes[row, col]
            z = np.asarray(d[key])
            lo = max(float(z.min()), 1e-4)
            hi = max(float(np.quantile(z, 0.9)), lo * 1.01)
            levels = np.geomspace(lo, hi, 16)
            cs = ax.contourf(al, be, np.clip(z, lo, None), levels=levels, norm=LogNorm(lo, hi), cmap="viridis",
                             extend="max")
            ax.contour(al, be, np.clip(z, lo, None), levels=levels[::3], colors="k", linewidths=0.4, alpha=0.5)
            fig.colorbar(cs, ax=ax, format="%.2g", label=f"mean {name} over T1, T2 ({split})")
            ax.plot([0, 1], [1, 0], "w--", lw=1.5, label=r"convex line $\alpha+\beta=1$")
            s = d[f"summary_{key}"]
            a_star = d["alpha_star"]
            ax.plot([a_star], [1 - a_star], "r*", ms=14, mec="w",
                    label=rf"closed-form $\alpha^*_2$ = {a_star:.3f} (raw {d['alpha_star_raw']:.3f})")
            lm = s["line_min_lambda"]
            ax.plot([lm], [1 - lm], "o", mfc="none", mec="magenta", ms=11, mew=2,
                    label=f"min on the line, alpha = {lm:.2f}")
            ax.plot([0], [1], "ws", ms=6)
            ax.annotate(r"$\hat\theta_1$", (0, 1), textcoords="offset points", xytext=(5, 5), color="w")
            ax.plot([1], [0], "w^", ms=6)
            ax.annotate(r"$\theta^*_2$", (1, 0), textcoords="offset points", xytext=(5, 5), color="w")
            ax.set_xlabel(r"$\alpha$: weight of $\theta^*_2$ (trained on task 2, unmerged)")
            ax.set_ylabel(r"$\beta$: weight of $\hat\theta_1$ (merged after task 1)")
            ax.set_title(f"{FIG2_TITLES.get(label, label)}\n{name}", fontsize=9)
            ax.legend(fontsize=6.5, loc="upper right", framealpha=0.8)
        _plot_line(axes[len(keys), col], d, keys, split)
    fig.suptitle(r"P&M Fig. 2 protocol: $\theta = \beta\hat\theta_1 + \alpha\theta^*_2$ after task 2 "
                 f"(all backbone tensors; head after task 2)\n{setting}", fontsize=9)
    return _png(fig)


def _plot_line(ax, d: dict, keys, split: str) -> None:
    """The 1-D profile along alpha + beta = 1 (finer scan), both CE flavours (own y-axes), alpha* and minima."""
    lam = d["line"]["lambdas"]
    twin = ax.twinx()
    for a, (key, name), style in zip((ax, twin), keys, ("-", "--")):
        a.plot(lam, d["line"][key], style, color="k", marker=".", label=name)
        lm = d[f"summary_{key}"]["line_min_lambda"]
        a.plot([lm], [d[f"summary_{key}"]["line_min"]], "o", mfc="none", mec="magenta", ms=9, mew=2)
        a.set_ylabel(f"{name} ({split})", fontsize=8)
    ax.axvline(d["alpha_star"], color="r", lw=1.2, label=rf"$\alpha^*_2$ = {d['alpha_star']:.3f}")
    ax.set_xlabel(r"$\alpha$ on the convex line ($\beta = 1 - \alpha$)")
    ax.set_title("profile along the convex line (o: minimum)", fontsize=9)
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=7, loc="upper center")
    ax.grid(alpha=0.3)


# -- main -------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "figures", help="folder for the PNGs and landscape.json")
    ap.add_argument("--epochs", type=int, default=5, help="epochs per task (default benchmark: 5)")
    ap.add_argument("--seed", type=int, default=0, help="run and scenario seed")
    ap.add_argument("--lr", type=float, default=5e-3, help="Adam learning rate (default config: 5e-3)")
    ap.add_argument("--val-fraction", type=float, default=0.1,
                    help="held-out validation part of each task's train set (Fig. 2 is scored on it; 0: test)")
    ap.add_argument("--lambda-step", type=float, default=0.1, help="Fig. 4 interpolation step")
    ap.add_argument("--grid-step", type=float, default=0.1, help="Fig. 2 (alpha, beta) grid step")
    ap.add_argument("--grid-max", type=float, default=1.5, help="Fig. 2 grid spans [0, grid-max]^2")
    ap.add_argument("--line-step", type=float, default=0.05, help="Fig. 2 step of the 1-D scan along alpha+beta=1")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--smoke", action="store_true", help="tiny random-init setting for tests (seconds)")
    ap.add_argument("--replot", action="store_true", help="redraw the figures and summaries from <out>/landscape.json")
    a = ap.parse_args(argv)
    if a.smoke:
        a.epochs, a.lambda_step, a.grid_step, a.line_step = 1, 0.5, 0.5, 0.25
    return a


def setting_line(s: dict) -> str:
    if s["smoke"]:
        return "SMOKE (random-init 2-block ViT, a few images and steps): not evidence"
    return (f"Split-MNIST-5k tasks 1-2 (of 5), vit-tiny-fmnist, {s['epochs']} epochs, Adam lr {s['lr']:g}, "
            f"seed {s['seed']}")


def write_outputs(out: Path, result: dict) -> None:
    """Both PNGs and ``landscape.json`` (atomic writes)."""
    out.mkdir(parents=True, exist_ok=True)
    setting = setting_line(result["setting"])
    atomic_write_bytes(out / "fig4_interpolation.png", plot_fig4(result["fig4"], setting))
    atomic_write_bytes(out / "fig2_loss_plane.png", plot_fig2(result["fig2"], setting))
    write_json(out / "landscape.json", result)


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.replot:  # figures and summaries again from landscape.json, no training
        result = json.loads((a.out / "landscape.json").read_text())
        for d in result["fig2"].values():
            summarize_fig2(d)
        write_outputs(a.out, result)
        print_summary(result)
        return result
    torch.set_num_threads(a.threads)
    t_start = time.time()
    fig4 = {label: fig4_data(m, a) for label, m in FIG4_METHODS.items()}
    fig2 = {label: fig2_data(m, a) for label, m in FIG2_METHODS.items()}
    result = {
        "setting": {"smoke": a.smoke, "dataset": "mnist5k", "n_tasks": 5, "tasks_trained": N_TRAINED,
                    "backbone": "vit-tiny-fmnist" + (" (random init, 2 blocks)" if a.smoke else " (shipped)"),
                    "epochs": a.epochs, "lr": a.lr, "seed": a.seed, "val_fraction": a.val_fraction,
                    "fig4_split": "test", "fig2_split": next(iter(fig2.values()))["split"],
                    "fig2_combination": "all floating backbone tensors", "near_tolerance": NEAR_TOL,
                    "flat_tolerance": FLAT_TOL},
        "fig4": fig4, "fig2": fig2,
    }
    result["seconds"] = round(time.time() - t_start, 1)  # training and evaluation (figures excluded)
    write_outputs(a.out, result)
    print_summary(result)
    return result


def _at(d: dict, key: str, lam: float) -> float:
    return d[key][int(np.argmin(np.abs(np.asarray(d["lambdas"]) - lam)))]


def print_summary(r: dict) -> None:
    print(f"landscape ({'smoke' if r['setting']['smoke'] else 'full'} setting), {r['seconds']} s of training and "
          f"evaluation")
    print("fig4 test accuracy, class-incremental / task-masked, at lambda = 0 | 0.5 | 1:")
    for label, d in r["fig4"].items():
        for t in (1, 2):
            cells = " | ".join(f"{_at(d, f't{t}_acc', lam):5.1f} / {_at(d, f't{t}_til_acc', lam):5.1f}"
                               for lam in (0.0, 0.5, 1.0))
            print(f"  {label:8s} T{t}: {cells}")
    print(f"fig2 mean CE over T1, T2 ({r['setting']['fig2_split']}) along alpha + beta = 1:")
    for label, d in r["fig2"].items():
        print(f"  {label}: alpha*_2 = {d['alpha_star']:.3f} (raw {d['alpha_star_raw']:.3f})")
        for key, name in (("ce_til", "task-masked"), ("ce", "class-incr.")):
            s = d[f"summary_{key}"]
            print(f"    {name}: min at alpha {s['line_min_lambda']:.2f} "
                  f"({'within' if s['min_near_alpha_star'] else 'not within'} {NEAR_TOL} of alpha*), "
                  f"CE(alpha*) {100 * s['excess_at_alpha_star']:.1f} % above the min; CE at 0 / alpha* / 1 = "
                  f"{s['at_lambda0']:.3f} / {s['at_alpha_star']:.3f} / {s['at_lambda1']:.3f}; "
                  f"valley fraction {s['valley_fraction']:.2f}; width within +{100 * FLAT_TOL:.0f} % "
                  f"{s['flat_width']:.2f}")


if __name__ == "__main__":
    main()
