"""HALRP benchmark (the checks P1-P11 of results.md): HALRP vs finetune, ewc, l2, stl, gpm over 5 task orders.

Settings (all task-incremental, one head per task):
- ``pfmnist``: Permuted Fashion-MNIST, 10 tasks (every task permuted), a training subsample per task;
- ``mixed``: a 6-task mixed sequence in the spirit of Five-dataset (``scenario.dataset: mixed``): MNIST-5k,
  digits, Fashion-MNIST and fixed transformations of them (rotation, inversion).

Every (setting, network, method) is one ``clmerge.engine.orders.run_orders`` sweep into
``RUNS/<setting>_<net>/<method>/`` (each order an ordinary, resumable run directory; finished orders are
skipped), so re-running the same command resumes. The summary (Acc, BWT, MOPD, AOPD, relative size, time,
HALRP growth accounting) is written to ``OUT/results.json`` and ``OUT/results_<profile>.md``.

Examples::

    python benchmarks/halrp/run.py --smoke                       # seconds: tiny data, 2 orders, mlp
    python benchmarks/halrp/run.py --profile reduced --nets mlp  # the committed reduced run
    python benchmarks/halrp/run.py --profile full                # the full grid (mlp + lenet)

HALRP trains ``warmup_epochs + train.epochs`` epochs per task (warm-up + factor fine-tuning; task 0 gets the
same total), so HALRP's ``train.epochs`` is the baselines' minus ``warmup_epochs``: every method sees the same
number of epochs per task. The warm-up ablations (``halrp_warmup2``, ``halrp_warmup3``; P4) keep those
fine-tuning epochs and lengthen only the warm-up.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
METHODS = ["halrp", "finetune", "ewc", "l2", "stl", "gpm"]

PROFILES: dict[str, dict] = {
    # epochs: the baselines' epochs per task; train_per_task / per_class: training subsample; test_per_class
    "smoke": {"epochs": 1, "train_per_task": 200, "mixed_train_per_class": 20, "test_per_class": 10, "orders": 2,
              "batch_size": 32},
    "reduced": {"epochs": 3, "train_per_task": 2000, "mixed_train_per_class": 200, "test_per_class": 100,
                "orders": 5, "batch_size": 64},
    "full": {"epochs": 12, "train_per_task": 2000, "mixed_train_per_class": 300, "test_per_class": None,
             "orders": 5, "batch_size": 128},
}

MIXED_TASKS = [
    {"dataset": "mnist5k"},
    {"dataset": "digits"},
    {"dataset": "fashion_mnist"},
    {"dataset": "mnist5k", "transform": "rotation", "degrees": 90},
    {"dataset": "fashion_mnist", "transform": "invert"},
    {"dataset": "digits", "transform": "rotation", "degrees": 180},
]

# ablations / checks of the paper's claims (name -> (method, option overrides on top of METHOD_OPTIONS))
VARIANTS: dict[str, tuple[str, dict]] = {
    "halrp_noprune": ("halrp", {"prune": False}),  # P8: BWT exactly 0
    "halrp_noimp": ("halrp", {"importance": "none"}),  # P3: LRP reading 2 (ranks from sigma^2 alone)
    "halrp_flat": ("halrp", {"rank_method": "flat"}),  # P3: LRP reading 1 (upper_rank everywhere)
    "halrp_random": ("halrp", {"factor_init": "random"}),  # P3: Random LRP
    "halrp_alpha0.6": ("halrp", {"alpha": 0.6}),  # P5
    "halrp_total_budget": ("halrp", {"prune_budget": "total"}),  # P9: budget on the total growth
    "halrp_nonzero_count": ("halrp", {"prune_budget": "nonzero_count"}),  # P9: the pre-audit rule (old tables)
    # P4 (Table 6, n_r = 1..4): longer warm-ups on top of the same fine-tuning epochs as the default
    "halrp_warmup2": ("halrp", {"warmup_epochs": 2}),
    "halrp_warmup3": ("halrp", {"warmup_epochs": 3}),
}

METHOD_OPTIONS: dict[str, dict] = {
    # HALRP: the paper's Table 8 (App. F.3), P-MNIST row (lambda0 1e-6, lambda1 1e-3, alpha 0.9, n_r 1, q 0.4) + code switches
    "halrp": {"alpha": 0.9, "warmup_epochs": 1, "lambda_l1": 1e-6, "lambda_l2": 1e-3, "l2_half": True,
              "base_l2": True, "grad_multiplier": 10.0, "prune": True, "prune_q": 0.4},
    "finetune": {},
    "ewc": {"reg_lambda": 100.0},
    "l2": {"reg_lambda": 1.0},
    "stl": {},
    "gpm": {},
}


def _model(net: str) -> dict:
    if net == "mlp":
        return {"name": "mlp", "pretrained": False, "config": {"image_size": 28, "hidden": [256, 256]}}
    return {"name": "lenet", "pretrained": False,
            "config": {"mean": [0.1307] * 3, "std": [0.3081] * 3}}


def scenario_for(setting: str, prof: dict) -> dict:
    """The ``scenario`` section of a setting under a profile."""
    if setting == "pfmnist":
        return {"dataset": "fashion_mnist", "kind": "task_incremental", "n_tasks": 10, "seed": 0,
                "transform": "permutation", "permute_first_task": True, "train_per_task": prof["train_per_task"],
                "test_per_class": prof["test_per_class"], "val_fraction": 0.2}
    tasks = [{**t, "train_per_class": prof["mixed_train_per_class"]} for t in MIXED_TASKS]
    if prof["test_per_class"]:
        tasks = [{**t, "test_per_class": prof["test_per_class"]} for t in tasks]
    return {"dataset": "mixed", "kind": "task_incremental", "n_tasks": len(tasks), "seed": 0, "val_fraction": 0.2,
            "options": {"tasks": tasks}}


def config_for(setting: str, net: str, method: str, prof: dict) -> dict:
    """A plain config dict for one (setting, net, method or variant)."""
    method, extra = VARIANTS.get(method, (method, {}))
    opts = {**copy.deepcopy(METHOD_OPTIONS[method]), **extra}
    epochs = prof["epochs"]
    if method == "halrp":  # fine-tuning epochs: the baselines' minus the default warm-up (variants add warm-up)
        epochs = max(1, epochs - METHOD_OPTIONS["halrp"]["warmup_epochs"])
    return {"seed": 0, "scenario": scenario_for(setting, prof), "model": _model(net),
            "method": {"name": method, **opts}, "optim": {"name": "adam", "lr": 1e-3},
            "train": {"epochs": epochs, "batch_size": prof["batch_size"], "eval_batch_size": 500},
            "run": {"device": "cpu", "threads": 1, "progress": False, "report": False, "keep_checkpoints": 1}}


def relative_size(cfg, metrics_by_order: list[dict]) -> dict:
    """Parameters stored to serve all tasks / (one network + one head) - 1, and HALRP's growth accounting."""
    from clmerge.models import build_backbone

    m = cfg.model
    backbone = build_backbone(m.name, pretrained=False, config=m.config)
    n_body = sum(p.numel() for p in backbone.parameters())
    tasks = metrics_by_order[0]["task_sizes"]
    n_cls = 10
    n_head = backbone.feature_dim * n_cls + n_cls
    T = len(tasks)
    one = n_body + n_head
    name = cfg.method.name
    if name == "halrp":
        mm = [mt["method_metrics"] for mt in metrics_by_order]
        out = {"size": sum(x["growth"][-1] for x in mm) / len(mm)}
        if "growth_lowrank" in mm[0]:
            out["size_lowrank"] = sum(x["growth_lowrank"][-1] for x in mm) / len(mm)
        return out
    if name == "stl":
        return {"size": T - 1.0}
    return {"size": (T - 1) * n_head / one}


def run_one(setting: str, net: str, method: str, prof: dict, runs: Path) -> dict:
    """Run (or resume) one order sweep and return its summary row."""
    from clmerge.config import parse_config
    from clmerge.engine.orders import run_orders
    from clmerge.utils.io import read_json

    cfg = parse_config(config_for(setting, net, method, prof))
    out = runs / f"{setting}_{net}" / method
    t0 = time.time()
    summary = run_orders(cfg, out, prof["orders"], resume=True)
    per = [read_json(out / f"order_{r}" / "metrics.json") for r in range(prof["orders"])]
    row = {"setting": setting, "net": net, "method": method, "acc": summary["acc"], "acc_se": summary["acc_se"],
           "bwt": summary["bwt"], "mopd": summary["mopd"], "aopd": summary["aopd"],
           "time_s": sum(m["timings"]["total_s"] for m in per) / len(per), "wall_s_this_call": time.time() - t0,
           **relative_size(cfg, per)}
    if cfg.method.name == "halrp":
        row["budget"] = 1 - cfg.method_options().prune_q if cfg.method_options().prune else None
        row["ranks_last_task"] = per[0]["method_metrics"]["ranks"][-1]
        row["pruned_entries"] = per[0]["method_metrics"]["pruned_entries"]
    return row


def _fmt(v, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def markdown(rows: list[dict], profile: str, command: str) -> str:
    """The results table (one block per setting/network)."""
    lines = [f"# HALRP benchmark, profile `{profile}`", "", f"Command: `{command}`", "",
             f"Profile settings: `{json.dumps(PROFILES[profile])}`", ""]
    blocks: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        blocks.setdefault((r["setting"], r["net"]), []).append(r)
    for (setting, net), rs in blocks.items():
        lines += [f"## {setting} / {net}", "",
                  "| method | Acc | ±SE | BWT | MOPD | AOPD | rel. size | time/order (s) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rs:
            size = _fmt(r.get("size"), 3)
            if "size_lowrank" in r:
                size += f" (U'V' only {_fmt(r['size_lowrank'], 3)})"
            lines.append(f"| {r['method']} | {_fmt(r['acc'])} | {_fmt(r['acc_se'])} | {_fmt(r['bwt'])} | "
                         f"{_fmt(r['mopd'])} | {_fmt(r['aopd'])} | {size} | {_fmt(r['time_s'], 1)} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", choices=sorted(PROFILES), default="reduced")
    p.add_argument("--smoke", action="store_true", help="tiny run (profile smoke) into a temporary --runs dir")
    p.add_argument("--settings", nargs="+", default=["pfmnist", "mixed"], choices=["pfmnist", "mixed"])
    p.add_argument("--nets", nargs="+", default=["mlp", "lenet"], choices=["mlp", "lenet"])
    p.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS + list(VARIANTS))
    p.add_argument("--runs", type=Path, default=HERE / "runs", help="run directories (git-ignored)")
    p.add_argument("--out", type=Path, default=HERE, help="where results_<profile>.md/json go")
    a = p.parse_args(argv)
    if a.smoke:
        a.profile = "smoke"
        a.out = a.runs / "smoke"
    prof = PROFILES[a.profile]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    command = "python benchmarks/halrp/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
    res_json = a.out / f"results_{a.profile}.json"
    rows = json.loads(res_json.read_text())["rows"] if res_json.exists() else []
    for setting in a.settings:
        for net in a.nets:
            for method in a.methods:
                row = run_one(setting, net, method, prof, a.runs / a.profile)
                rows = [r for r in rows if (r["setting"], r["net"], r["method"]) != (setting, net, method)] + [row]
                print(json.dumps({k: row[k] for k in ("setting", "net", "method", "acc", "bwt", "mopd", "aopd",
                                                      "size", "time_s")}), flush=True)
                a.out.mkdir(parents=True, exist_ok=True)
                res_json.write_text(json.dumps({"profile": prof, "command": command, "rows": rows}, indent=1))
                (a.out / f"results_{a.profile}.md").write_text(markdown(rows, a.profile, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
