"""The continual-merging protocol of the merging benchmark (``clmerge merge-bench --continual``).

The bench's experts (the same fine-tuned experts and frozen heads as the ordinary bench, trained once and
cached) arrive one at a time in the suite's task order. After arrival ``t`` every method produces its current
merged model, and each task seen so far is evaluated on its test split: ``R[t][j]``, the accuracy on task
``j <= t`` after arrival ``t`` (entries above the diagonal are ``None``). Per method: the accuracy matrix, the
final average accuracy ``Acc = mean_j R[T-1][j]`` and ``BWT = mean_(j<T-1) (R[T-1][j] - R[j][j])``
(:mod:`clmerge.metrics`; OPCM's paper reports the same two numbers).

Methods (each keeps only a running state, never the list of earlier experts):

- ``opcm``: :mod:`clmerge.merging.methods.opcm` (running projected sum and task-vector norms);
- ``dop``: :mod:`clmerge.merging.methods.dop` (the previous merge);
- ``running_average``: task arithmetic with ``lambda = 1/t``, i.e. ``theta_0 + (1/t) sum_(i<=t) tau_i``;
- ``magmax``: the running maximum-magnitude task vector, ``theta_0 + lambda tau_MagMax`` (Marczak et al. 2024;
  ``lambda = 0.5``, the official default);
- ``pm_alpha``: the merge P&M performs after each task (Qiu et al. 2025, Eq. 8):
  ``theta^_t = theta^_(t-1) + alpha_t Delta_t`` with ``Delta_t = theta*_t - theta^_(t-1)`` and
  ``alpha_t = - sum_(i<=t) (theta^_(t-1) - theta*_i)^T F_i Delta_t / sum_(i<=t) Delta_t^T F_i Delta_t``,
  clipped to ``[0, 1]``, from running sums of the diagonal Fishers ``F_i`` of each expert on its own training
  data (:func:`clmerge.methods.pm.closed_form_alpha`). Here the experts were fine-tuned independently from
  ``theta_0``, not from ``theta^_(t-1)`` as in P&M's training, so only its merge rule is reused.

Hyperparameters are each method's published default (no validation search): OPCM ``alpha = 0.5``, DOP's
FusionBench config, MagMax ``lambda = 0.5``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ..merging.methods.dop import dop_fold
from ..merging.methods.lowrank import is_lowrank_param
from ..merging.methods.magmax import max_magnitude_fold
from ..merging.methods.opcm import opcm_fold, opcm_scale
from ..metrics import backward_transfer, final_accuracy, mean_se, validate_matrix
from ..utils.io import atomic_write_text, write_json
from .merge_bench_seeds import paired_verdict

__all__ = ["CONTINUAL_METHODS", "run_continual", "continual_markdown", "continual_summary", "make_merger",
           "FISHER_SAMPLES", "summarise_continual", "expert_fisher", "load_bench"]

CONTINUAL_METHODS = ("opcm", "running_average", "magmax", "pm_alpha", "dop")  # dop, the slowest, last
FISHER_SAMPLES = 256  # training samples per expert for P&M's diagonal Fisher (the bench's tasks have thousands)


def _float_keys(base: dict[str, Tensor]) -> list[str]:
    return [k for k, v in base.items() if v.is_floating_point()]


class _Merger:
    """A continual merge: ``add(expert)`` takes the next expert's parameters and returns the current merge."""

    def __init__(self, base: dict[str, Tensor]) -> None:
        self.base = {k: v.float() if v.is_floating_point() else v for k, v in base.items()}
        self.keys = _float_keys(base)
        self.t = 0

    def merged(self, task_vector: dict[str, Tensor]) -> dict[str, Tensor]:
        return {k: (self.base[k] + task_vector[k]) if k in task_vector else self.base[k] for k in self.base}

    def tau(self, expert: dict[str, Tensor], key: str) -> Tensor:
        return expert[key].float() - self.base[key]


class _RunningAverage(_Merger):
    def add(self, expert: dict[str, Tensor], **_: Any) -> dict[str, Tensor]:
        self.t += 1
        if self.t == 1:
            self.sum = {k: self.tau(expert, k) for k in self.keys}
        else:
            for k in self.keys:
                self.sum[k] += self.tau(expert, k)
        return self.merged({k: v / self.t for k, v in self.sum.items()})


class _MagMax(_Merger):
    def __init__(self, base: dict[str, Tensor], scaling: float = 0.5) -> None:
        super().__init__(base)
        self.scaling, self.run = scaling, {}

    def add(self, expert: dict[str, Tensor], **_: Any) -> dict[str, Tensor]:
        self.t += 1
        for k in self.keys:
            tau = self.tau(expert, k)
            self.run[k] = tau if self.t == 1 else max_magnitude_fold(self.run[k], tau)[0]
        return self.merged({k: self.scaling * v for k, v in self.run.items()})


class _OPCM(_Merger):
    def __init__(self, base: dict[str, Tensor], **options: Any) -> None:
        super().__init__(base)
        self.options, self.sum, self.tau_sq = options, {}, []

    def add(self, expert: dict[str, Tensor], **_: Any) -> dict[str, Tensor]:
        self.t += 1
        taus = {k: self.tau(expert, k) for k in self.keys}
        self.tau_sq.append(sum(float(v.double().pow(2).sum()) for v in taus.values()))
        self.sum = {k: opcm_fold(k, self.sum.get(k), taus[k], **self.options) for k in self.keys}
        scale = opcm_scale(sum(float(v.double().pow(2).sum()) for v in self.sum.values()), self.tau_sq)
        return self.merged({k: scale * v for k, v in self.sum.items()})


class _DOP(_Merger):
    def __init__(self, base: dict[str, Tensor], **options: Any) -> None:
        super().__init__(base)
        self.options, self.state = options, {}

    def add(self, expert: dict[str, Tensor], **_: Any) -> dict[str, Tensor]:
        self.t += 1
        self.state = {k: dop_fold(k, self.state.get(k), self.base[k], expert[k].float(), self.t, **self.options)
                      for k in self.keys}
        return {k: self.state.get(k, v) for k, v in self.base.items()}


class _PMAlpha(_Merger):
    """P&M's Eq. 8 merge with running sums ``S_F = sum F_i`` and ``S_Fu = sum F_i u_i`` (``u_i = tau_i``)."""

    def __init__(self, base: dict[str, Tensor]) -> None:
        super().__init__(base)
        self.merged_tv = {k: torch.zeros_like(self.base[k]) for k in self.keys}
        self.sum_f: dict[str, Tensor] = {}
        self.sum_fu: dict[str, Tensor] = {}
        self.alphas: list[float] = []

    def add(self, expert: dict[str, Tensor], *, fisher: dict[str, Tensor] | None = None, **_: Any) -> dict[str, Tensor]:
        from ..methods.pm import closed_form_alpha

        if fisher is None:
            raise ValueError("pm_alpha needs each expert's diagonal Fisher")
        self.t += 1
        taus = {k: self.tau(expert, k) for k in self.keys}
        delta = {k: taus[k] - self.merged_tv[k] for k in fisher}
        for k, f in fisher.items():
            f = f.double()
            self.sum_f[k] = self.sum_f[k] + f if k in self.sum_f else f
            fu = f * taus[k].double()
            self.sum_fu[k] = self.sum_fu[k] + fu if k in self.sum_fu else fu
        num, den = closed_form_alpha(delta, self.sum_f, self.sum_fu, {k: self.merged_tv[k] for k in fisher})
        alpha = min(1.0, max(0.0, -num / den)) if den > 0 else 1.0
        self.alphas.append(alpha)
        for k in self.keys:
            self.merged_tv[k] = self.merged_tv[k] + alpha * (taus[k] - self.merged_tv[k])
        return self.merged(self.merged_tv)


def make_merger(method: str, base: dict[str, Tensor], **options: Any) -> _Merger:
    """The continual merge ``method`` (one of :data:`CONTINUAL_METHODS`) starting from ``base``."""
    makers = {"opcm": _OPCM, "dop": _DOP, "running_average": _RunningAverage, "magmax": _MagMax,
              "pm_alpha": _PMAlpha}
    if method not in makers:
        raise ValueError(f"--method {method!r}: not a continual-merging method; known: {', '.join(makers)}")
    return makers[method](base, **options)


def expert_fisher(backbone: nn.Module, params: dict[str, Tensor], head: nn.Module, x: Tensor, y: Tensor,
                  samples: int = FISHER_SAMPLES) -> dict[str, Tensor]:
    """The diagonal empirical Fisher of the expert's weight matrices (P&M Eq. 9-10) on ``samples`` of its
    training data, with its own head; keys as in ``params``."""
    from ..params import diagonal_fisher

    backbone.load_state_dict(params)
    model = nn.Sequential(backbone, head)
    keys = [k for k, v in params.items() if v.is_floating_point() and is_lowrank_param(k, tuple(v.shape))]
    batches = ((x[i:i + 32], y[i:i + 32]) for i in range(0, min(len(x), samples), 32))
    fisher = diagonal_fisher(model, [f"0.{k}" for k in keys], batches, max_samples=samples)
    return {k[2:]: f for k, f in fisher.items()}


def continual_summary(R: list[list[float | None]]) -> dict[str, Any]:
    """The accuracy matrix with its final average accuracy and BWT (``None`` for one task)."""
    validate_matrix(R)
    return {"matrix": R, "final_acc": final_accuracy(R), "bwt": backward_transfer(R)}


def load_bench(cfg, cache: Path, log=print) -> dict[str, Any]:
    """The suite's data, the base backbone and the bench's (cached) experts with their heads."""
    from .merge_bench import SUITES, build_base, expert_for_task, head_accuracy, load_task
    from .merge_bench_experts import make_head

    tasks = SUITES[cfg.suite]
    data = [load_task(t, cfg) for t in tasks]
    model = build_base(cfg)
    bench = {"tasks": tasks, "data": data, "model": model, "experts": [], "heads": [], "individual": [],
             "base": {k: v.clone() for k, v in model.state_dict().items()}}
    for t, d in zip(tasks, data):
        log(f"expert {t.name}")
        params, head = expert_for_task(t, cfg, d, cache)
        bench["experts"].append(params)
        bench["heads"].append(make_head(head))
        model.load_state_dict(params)
        bench["individual"].append(head_accuracy(model, bench["heads"][-1], *d["test"]))
    return bench


def _matrix(merger: _Merger, bench: dict[str, Any], fishers: list | None, log, name: str) -> list[list[float | None]]:
    """Feed the experts to ``merger`` in order; after each, evaluate the merge on every task seen so far."""
    from .merge_bench import head_accuracy

    model, n, R = bench["model"], len(bench["experts"]), []
    for t, e in enumerate(bench["experts"]):
        model.load_state_dict(merger.add(e, fisher=None if fishers is None else fishers[t]))
        R.append([head_accuracy(model, bench["heads"][j], *bench["data"][j]["test"]) for j in range(t + 1)]
                 + [None] * (n - t - 1))
        log(f"{name}: after {bench['tasks'][t].name}: mean {np.mean(R[-1][:t + 1]):.2f}")
    return R


def run_continual(cfg, out: Path, *, methods: Sequence[str] | None = None, cache: Path | None = None, log=print,
                  fisher_samples: int = FISHER_SAMPLES, options: dict[str, dict[str, Any]] | None = None) -> dict:
    """Run the protocol (module docstring) for ``methods`` (default: all); write ``out/continual.json`` and
    ``out/continual.md``; return the results. ``options``: per-method keyword overrides (tests)."""
    methods, options = list(methods or CONTINUAL_METHODS), options or {}
    for m in methods:
        make_merger(m, {}, **options.get(m, {}))  # refuse an unknown name before any training
    bench = load_bench(cfg, cache or out / "experts", log)
    fishers = None
    if "pm_alpha" in methods:
        log("pm_alpha: diagonal Fisher of each expert")
        fishers = [expert_fisher(bench["model"], e, h, *d["train"], samples=fisher_samples)
                   for e, h, d in zip(bench["experts"], bench["heads"], bench["data"])]
    results = {"protocol": "continual", "config": asdict(cfg), "tasks": [t.name for t in bench["tasks"]],
               "individual": bench["individual"], "rows": {}, "fisher_samples": fisher_samples,
               "options": options}
    for m in methods:  # the results so far are written after each method (a long run keeps what it finished)
        merger = make_merger(m, bench["base"], **options.get(m, {}))
        results["rows"][m] = continual_summary(_matrix(merger, bench, fishers, log, m))
        if m == "pm_alpha":
            results["rows"][m]["alphas"] = merger.alphas
        write_json(out / "continual.json", results)
        atomic_write_text(out / "continual.md", continual_markdown(results))
    return results


def continual_markdown(results: dict) -> str:
    """Final accuracy and BWT per method, then each method's accuracy matrix."""
    from .merge_bench import protocol_line

    tasks, cfg = results["tasks"], results["config"]
    seed = cfg["seed"] if cfg.get("train_seed") is None else cfg["train_seed"]
    lines = ["Continual merging: experts arrive in the task order below; after each arrival the current merge is "
             "evaluated on every task seen so far. " + protocol_line(cfg) + f" Fine-tuning seed {seed}.", "",
             "| method | final avg accuracy | BWT |", "|---|---|---|"]
    for name, r in results["rows"].items():
        bwt = "n/a" if r["bwt"] is None else f"{r['bwt']:.1f}"
        lines.append(f"| {name} | {r['final_acc']:.1f} | {bwt} |")
    lines += ["", "Individual experts (test accuracy on their own task): "
              + ", ".join(f"{t} {a:.1f}" for t, a in zip(tasks, results["individual"]))]
    for name, r in results["rows"].items():
        lines += ["", f"Accuracy matrix of {name} (row: after arrival of; column: task):", "",
                  "| after | " + " | ".join(tasks) + " |", "|" + "---|" * (len(tasks) + 1)]
        for t, row in zip(tasks, r["matrix"]):
            lines.append(f"| {t} | " + " | ".join("" if a is None else f"{a:.1f}" for a in row) + " |")
    return "\n".join(lines) + "\n"


def summarise_continual(out: Path, runs: dict[int, dict]) -> dict:
    """Final accuracy and BWT of each method as mean ± standard error over the seeds' runs; written to
    ``out/continual.json`` and ``out/continual.md``."""
    seeds = list(runs)
    first = runs[seeds[0]]
    rows = {}
    for m in first["rows"]:
        acc = [runs[s]["rows"][m]["final_acc"] for s in seeds]
        bwt = [runs[s]["rows"][m]["bwt"] for s in seeds]
        rows[m] = {"final_acc": mean_se(acc), "bwt": None if None in bwt else mean_se(bwt),
                   "final_acc_per_seed": acc, "bwt_per_seed": bwt}
    summary = {"protocol": "continual", "seeds": seeds, "config": first["config"], "tasks": first["tasks"],
               "rows": rows}
    lines = [f"Continual merging over fine-tuning seeds {', '.join(map(str, seeds))} (mean ± standard error; "
             "per-seed matrices in seed<s>/continual.md).", "", "| method | final avg accuracy | BWT |", "|---|---|---|"]
    for m, r in rows.items():
        bwt = "n/a" if r["bwt"] is None else "{:.1f} ± {:.1f}".format(*r["bwt"])
        lines.append("| {} | {:.1f} ± {:.1f} | {} |".format(m, *r["final_acc"], bwt))
    if "opcm" in rows and "running_average" in rows:
        d = [runs[s]["rows"]["opcm"]["final_acc"] - runs[s]["rows"]["running_average"]["final_acc"] for s in seeds]
        summary["claims"] = {"opcm_minus_running_average": {"seeds": seeds, "per_seed": d, "mean_se": mean_se(d)}}
        lines += ["", "OPCM beats running averaging (final accuracy, paired same-seed difference): OPCM − running "
                  "average = {:+.1f} ± {:.1f} points (per seed {}): {}".format(
                      *mean_se(d), ", ".join(f"{x:+.1f}" for x in d), paired_verdict(mean_se(d)))]
    write_json(out / "continual.json", summary)
    atomic_write_text(out / "continual.md", "\n".join(lines) + "\n")
    return summary

