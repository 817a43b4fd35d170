"""The merging benchmark as ``clmerge merge-bench`` runs it: one seed or several, checked arguments.

:func:`run_merge_bench` checks its arguments (each refusal names the command-line flag), runs one benchmark
per fine-tuning seed (:func:`clmerge.harness.merge_bench.run_benchmark`) and summarises over seeds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from ..errors import InputError
from ..utils.io import read_json

__all__ = ["run_merge_bench", "parse_seeds"]


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]`` (distinct integers, in order)."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds {text!r}: expected comma-separated integers such as 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {text!r}: expected distinct comma-separated integers such as 0,1,2")
    return seeds


def _done(out: Path, cfg, grids: dict, max_extensions: int) -> bool:
    """Whether ``out`` already holds this exact run (same config and start grids, and no grid that stopped at
    an extension cap other than ``max_extensions``): then it is not redone."""
    path = out / "results.json"
    if not path.exists():
        return False
    old = read_json(path)  # a corrupt file: an input error naming it
    if not isinstance(old, dict):
        raise InputError(f"{path}: not a merge-bench result (expected a JSON object)")
    same_grids = {m: g["start"] for m, g in old.get("grids", {}).items()} == json.loads(json.dumps(grids))
    # a grid still at an edge ("low"/"high") stopped at the cap of its run; a different cap changes that result
    capped = any(e in ("low", "high") and g.get("max_extensions", 4) != max_extensions
                 for g in old.get("grids", {}).values() for e in g.get("chosen_at", {}).values())
    return old.get("config") == json.loads(json.dumps(asdict(cfg))) and same_grids and not capped


def run_merge_bench(out: Path, suite: str = "8", epochs: int = 5, lr: float = 1e-4, max_train: int | None = None,
                    max_eval: int | None = None, random_init: bool = False, methods: Sequence[str] | None = None,
                    heads: str = "frozen", head_init: str = "probe", seeds: Sequence[int] = (0,),
                    backbone: str | None = None, arch: dict | None = None, data_options: dict | None = None,
                    continual: bool = False, log=print) -> dict:
    """What ``clmerge merge-bench`` runs.

    One seed: results in ``out``. Several: one run per seed in ``out/seed<s>`` (a seed whose results there
    match this config is not rerun), experts shared in ``out/experts``, and the summary over seeds in ``out``.
    ``backbone`` None: the suite's (``SUITE_BACKBONES``), else vit-tiny-fmnist; ``max_train`` / ``max_eval``
    None: the suite's caps (``SUITE_CAPS``) where it has them. ``arch`` (random init only) and
    ``data_options`` (the data source's keyword options) are for tests and dry runs. ``continual``: the
    continual-merging protocol instead (:func:`run_continual_bench`).
    """
    from .merge_bench import DEFAULT_GRIDS, MAX_EXTENSIONS, SUITES, BenchConfig, run_benchmark
    from .merge_bench_continual import CONTINUAL_METHODS
    from .merge_bench_data import SUITE_BACKBONES, SUITE_CAPS

    from .merge_bench_experts import HEAD_INITS, HEAD_PROTOCOLS

    _check_numbers(epochs=epochs, lr=lr, max_train=max_train, max_eval=max_eval)
    if suite not in SUITES:
        raise ValueError(f"--suite {suite!r}: unknown; known: {', '.join(SUITES)}")
    if heads not in HEAD_PROTOCOLS:
        raise ValueError(f"--heads {heads!r}: expected one of {', '.join(HEAD_PROTOCOLS)}")
    if head_init not in HEAD_INITS:
        raise ValueError(f"--head-init {head_init!r}: expected one of {', '.join(HEAD_INITS)}")
    known = CONTINUAL_METHODS if continual else DEFAULT_GRIDS
    unknown = [m for m in methods or () if m not in known]
    if unknown:
        what = "a continual-merging method" if continual else "in the benchmark's grids"
        raise ValueError(f"--method {unknown[0]!r}: not {what}; known: {', '.join(known)}")
    grids = DEFAULT_GRIDS if not methods or continual else {m: DEFAULT_GRIDS[m] for m in methods}
    backbone = _check_backbone(backbone or SUITE_BACKBONES.get(suite, "vit-tiny-fmnist"))
    cap_train, cap_eval = SUITE_CAPS.get(suite, (None, None))
    cfgs = [BenchConfig(suite=suite, backbone=backbone, epochs=epochs, lr=lr,
                        max_train=cap_train if max_train is None else max_train,
                        max_eval=cap_eval if max_eval is None else max_eval, pretrained=not random_init,
                        arch=dict(arch or {}), heads=heads, head_init=head_init, train_seed=s,
                        data_options=dict(data_options or {})) for s in seeds]
    if continual:
        return run_continual_bench(out, cfgs, methods, log)
    if len(seeds) == 1:
        return run_benchmark(cfgs[0], out, grids=grids, log=log)
    from .merge_bench_seeds import summarise

    for s, cfg in zip(seeds, cfgs):
        run_dir = out / f"seed{s}"
        if _done(run_dir, cfg, grids, MAX_EXTENSIONS):
            log(f"seed {s}: results in {run_dir} match this config; not rerun")
            continue
        log(f"seed {s}")
        run_benchmark(cfg, run_dir, grids=grids, cache=out / "experts", log=log)
    return summarise(out, seeds)


def run_continual_bench(out: Path, cfgs: Sequence, methods: Sequence[str] | None, log=print) -> dict:
    """The continual-merging protocol for each config (one per fine-tuning seed): one seed in ``out``,
    several in ``out/seed<s>`` with experts shared in ``out/experts`` and final accuracy and BWT as mean ±
    standard error over seeds in ``out/continual.json`` / ``continual.md``."""
    from .merge_bench_continual import run_continual, summarise_continual

    if len(cfgs) == 1:
        return run_continual(cfgs[0], out, methods=methods, log=log)
    runs = {}
    for cfg in cfgs:
        log(f"seed {cfg.fine_tune_seed}")
        runs[cfg.fine_tune_seed] = run_continual(cfg, out / f"seed{cfg.fine_tune_seed}", methods=methods,
                                                 cache=out / "experts", log=log)
    return summarise_continual(out, runs)


def _check_numbers(*, epochs: int, lr: float, max_train: int | None, max_eval: int | None) -> None:
    """Refuse what would silently train nothing (``--epochs 0``, ``--max-train 0``) or diverge (``--lr inf``)."""
    if epochs < 1:
        raise ValueError(f"--epochs {epochs}: expected at least 1 (fine-tuning epochs per expert)")
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"--lr {lr}: expected a positive finite learning rate")
    for flag, cap in (("--max-train", max_train), ("--max-eval", max_eval)):
        if cap is not None and cap < 1:
            raise ValueError(f"{flag} {cap}: expected at least 1 sample per task (or leave it out: no cap)")


def _check_backbone(name: str) -> str:
    from ..models import available_backbones

    known = list(available_backbones())
    if name not in known:
        raise ValueError(f"--backbone {name!r}: unknown; known: {', '.join(known)}")
    return name
