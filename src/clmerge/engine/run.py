"""The continual loop: config -> scenario, model, method (built by :mod:`.setup`) -> train/evaluate/checkpoint
per task -> metrics.

Reads top to bottom (docs/architecture.md, "The data flow of a continual run"). Randomness is derived from
``(seed, task)`` at the start of every task, so a run resumed at task t+1 from the checkpoint of task t gives
exactly the same numbers as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from ..adapters.structure import model_structure, rebuild_structure
from ..config import ExperimentConfig, dump_config
from ..methods.base import TaskContext
from ..metrics import summarize
from ..models import ContinualClassifier
from ..utils.io import append_jsonl, atomic_write_text, read_json, sha256_bytes, sha256_file, write_json
from ..utils.progress import Progress, progress_enabled
from ..utils.provenance import open_run_plugins
from .checkpoint import (RECORD_KEY, ResumeError, RunLock, checkpoint_contents, checkpoint_record,
                         load_checkpoint, load_head_tensors, resume_checkpoint, save_checkpoint)
from .evaluate import evaluate_tasks
from .heads import VARIANTS
from .resume import (CONFIG_SHA_KEY, check_resumable, check_same_config, events_sha256, finished_tasks_in_events,
                     recorded_config_sha256, thread_history, verify_events)
from . import distributed
from ..utils.precision import autocast, check_precision, fp32_region
from .training import fit
from .setup import (Run, RunState, build_classifier, build_heads, fresh_objects, head_variant_needs_features,
                    prepare, prepare_run, resolve_device, task_generator)
from .sinks import Sinks, check_sinks

# the names of .setup are re-exported: callers build a run with clmerge.engine.run.prepare_run, as before
__all__ = ["run_experiment", "prepare", "prepare_run", "build_heads", "build_classifier", "Run", "RunState",
           "task_generator", "resolve_device", "fresh_objects", "head_variant_needs_features", "share_state",
           "train_task", "evaluate_row", "restore", "load_into", "final_metrics"]

log_warning = logging.getLogger("clmerge.engine").warning  # one line on stderr ("warning: ...")


def _check_run_dir(out: Path, cfg_text: str, resume: bool) -> None:
    cfg_file = out / "config.yaml"
    if resume:  # check_resumable(out) ran before the lock
        check_same_config(cfg_file, cfg_text, recorded_config_sha256(out))
        return
    if cfg_file.exists() or (out / "checkpoints").exists():
        raise FileExistsError(f"{out} already holds a run; pass --resume to continue it or choose another --out")


def restore(run: Run) -> tuple[int, dict[str, str]]:
    """Load the newest verified checkpoint of ``run.out`` into the run's objects and set ``run.state``;
    returns ``(first task to run, checkpoint record)``. Every check (missing or corrupt checkpoint, changed
    events.jsonl) runs before the one change: events.jsonl is cut back to what the checkpoint saw."""
    out, heads = run.out, run.heads
    ck, sha = resume_checkpoint(out)
    events = out / "events.jsonl"
    if ck is None:  # killed during the first task: start over
        if checkpoint_record(out) is None and (n := finished_tasks_in_events(events)):
            raise ResumeError(f"{out}: events.jsonl records {n} finished task(s) but checkpoints/ holds no "
                                "checkpoint; nothing was changed: restore the checkpoints to resume")
        events.unlink(missing_ok=True)
        run.state = RunState()
        return 0, {}
    model_state, method_tensors, meta = load_checkpoint(ck, sha256=sha)
    with checkpoint_contents(ck):  # a hand-made or foreign checkpoint: one line naming it
        st = meta["state"]
        kept = verify_events(events, st["events_lines"], meta.get("events_sha256"))
        load_into(run.model, run.method, heads, meta, model_state, method_tensors,
                  load_head_tensors(ck) if heads is not None and heads.needs_features else {}, run.device)
        run.state = RunState(st["rows"], st["til_rows"], st["task_seconds"], st["initial"], st["events_lines"],
                             st.get("head_rows", {}), st.get("head_val", {}))
    if events.exists():  # drop events written by the interrupted task
        atomic_write_text(events, kept)
    record = checkpoint_record(out)  # a run from before hashes were recorded adopts its checkpoint's hash
    return meta["task"] + 1, record if record is not None else {ck.name: sha256_file(ck)}


def _row(results, n_tasks: int, key: str) -> list[float | None]:
    vals = [r[key] for r in results]
    return vals + [None] * (n_tasks - len(vals))


def train_task(run: Run, t: int) -> None:
    """Train task ``t`` and run the end-of-task work. In a data-parallel run's processes other than 0, the
    run's model, method and heads are then new objects holding process 0's end-of-task state
    (:mod:`.distributed`)."""
    cfg, scenario, state, device = run.cfg, run.scenario, run.state, run.device
    method, task = run.method, scenario.tasks[t]
    gen = task_generator(cfg.seed, t)
    main = distributed.is_main()
    log = (lambda ev: _log(run, ev)) if main else (lambda ev: None)
    precision = cfg.run.precision
    ctx = TaskContext(task=task, seen_tasks=scenario.tasks[: t + 1], device=device, generator=gen,
                      head_loss=cfg.head.loss, batch_size=cfg.train.batch_size,
                      eval_batch_size=cfg.train.eval_batch_size, log=log, n_tasks=len(scenario),
                      n_outputs=scenario.num_outputs,
                      fit=_bound_fit(run, t, gen, log))
    t0 = time.time()
    with fp32_region():  # statistics computed before training (InfLoRA's covariances) stay fp32
        method.begin_task(task, ctx)
    run.model.to(device)
    if main and scenario.kind == "domain_incremental" and t == 0 and state.initial is None:
        with autocast(precision, device):
            res = evaluate_tasks(method.inference_model(), scenario.tasks, n_outputs=scenario.num_outputs,
                                 batch_size=cfg.train.eval_batch_size, device=device)
        state.initial = [r["acc"] for r in res]
    _fit_task(run, t, ctx)
    if main:
        with distributed.local(), fp32_region():  # once, over the whole task (engine.distributed), in fp32
            method.end_task(task, ctx)
            if run.heads is not None:  # the same hook for every method: the inference model's features
                run.heads.end_task(method.inference_model(), task, scenario.tasks[: t + 1],
                                   batch_size=cfg.train.eval_batch_size, device=device)
    state.task_seconds.append(time.time() - t0)
    if (dp := distributed.active()) is not None:
        share_state(dp, run)


def _bound_fit(run: Run, t: int, gen: torch.Generator, log) -> Callable[..., dict]:
    """:func:`.training.fit` with this run's settings for task ``t`` bound (keywords; a caller's win): the one
    training call of the task, for the engine's own loop (:func:`_fit_task`) and a method's (``ctx.fit``)."""
    cfg = run.cfg
    return functools.partial(
        fit, optim=cfg.optim, generator=gen, device=run.device, log=log, task_index=t,
        batch_size=cfg.train.batch_size, precision=cfg.run.precision, log_every=cfg.run.log_every_steps,
        progress=cfg.run.progress and distributed.is_main(),
        max_steps_per_epoch=cfg.train.max_steps_per_epoch)


def _fit_task(run: Run, t: int, ctx: TaskContext) -> None:
    """The task's training loop over the groups ``train.adapt_tasks`` leaves trainable, through ``ctx.fit``
    (a dry run's cap on it applies here too)."""
    cfg, model, method, main = run.cfg, run.model, run.method, distributed.is_main()
    lr = cfg.optim.first_task_lr if (t == 0 and cfg.optim.first_task_lr) else cfg.optim.lr
    groups, frozen = _adapted_groups(cfg, t, method.parameter_groups(model))
    if main and frozen and cfg.train.adapt_tasks == 0 and not run.state.warned_untrained:
        run.state.warned_untrained = True
        log_warning(f"warning: train.adapt_tasks=0: method {cfg.method.name!r} trains none of its "
                    f"{sum(p.numel() for p in frozen)} own parameters in any task (only the linear head); a "
                    "frozen-backbone method is method.name=ranpac_rp or simplecil")
    if groups or method.trains_linear_head:  # else a statistics method in a task without adaptation
        ctx.fit(model=model, data=ctx.task.train, groups=groups,
                loss_fn=lambda m, x, y: method.loss(m, x, y, ctx), epochs=cfg.train.epochs, lr=lr,
                before_step=lambda m: method.before_step(m, ctx),
                after_step=lambda m: method.after_step(m, ctx), desc=f"task {t + 1}/{len(run.scenario)}",
                first_loss_fn=lambda m, x, y: method.first_step_loss(m, x, y, ctx),
                before_first_step=lambda m: method.before_first_step(m, ctx))
    for p in frozen:
        p.requires_grad_(True)


def share_state(dp, run: Run) -> None:
    """Process 0's model, method and head state (what a checkpoint holds) to every process; the others load it
    into fresh objects (``run.fresh``, default :func:`fresh_objects`), as ``--resume`` does, and put them in
    ``run``."""
    model, method, heads = run.model, run.method, run.heads
    meta = tensors = None
    if dp.rank == 0:
        meta = {"structure": model_structure(model), "method": method.state_meta(),
                "heads": heads.state_meta() if heads is not None else None}
        tensors = {**{f"model/{k}": v for k, v in model.state_dict().items()},
                   **{f"method/{k}": v for k, v in method.state_tensors().items()}}
        if heads is not None and heads.needs_features:
            tensors.update({f"heads/{k}": v for k, v in heads.state_tensors().items()})
        tensors = {k: v.detach().cpu() for k, v in tensors.items()}
    meta = distributed.broadcast_json(dp, meta)
    tensors = distributed.broadcast_tensors(dp, tensors)
    if dp.rank == 0:
        return
    part = lambda prefix: {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}  # noqa: E731
    model, method, new_heads = (run.fresh or (lambda: fresh_objects(run.cfg)))()
    new_heads = new_heads if heads is not None else None
    load_into(model, method, new_heads, meta, part("model/"), part("method/"), part("heads/"), run.device)
    run.model, run.method, run.heads = model, method, new_heads


def load_into(model, method, heads, meta: dict, model_state: dict, method_tensors: dict, head_tensors: dict,
               device) -> None:
    """Load a checkpoint's state (from a file on --resume, or broadcast by process 0) into model, method and
    head suite: the structure first, then the weights, the method's state and the heads' statistics."""
    rebuild_structure(model, meta["structure"])
    model.load_state_dict(model_state, strict=True)
    model.to(device)
    method.load_state({k: v.to(device) for k, v in method_tensors.items()}, meta["method"])
    if heads is not None and heads.needs_features:
        heads.load_state(head_tensors, meta["heads"])


def _adapted_groups(cfg, t: int, groups: list[dict]) -> tuple[list[dict], list]:
    """``train.adapt_tasks``: from task N on, only the head group trains; the body's parameters get
    ``requires_grad=False`` for the task (no backward pass through the backbone) and are returned to be
    re-enabled. A method's own end-of-task updates (folds, merges) still run."""
    n = cfg.train.adapt_tasks
    if n is None or t < n:
        return groups, []
    frozen = [p for g in groups if g.get("name") != "head" for p in g["params"] if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    return [g for g in groups if g.get("name") == "head"], frozen


def evaluate_row(run: Run, t: int) -> None:
    """Evaluate after task ``t``: append the accuracy rows (and shadow heads' rows) to ``run.state``."""
    with autocast(run.cfg.run.precision, run.device):
        _evaluate_row_inner(run, t)


def _evaluate_row_inner(run: Run, t: int) -> None:
    cfg, scenario, state, heads = run.cfg, run.scenario, run.state, run.heads
    task = scenario.tasks[t]
    future = scenario.kind == "domain_incremental"
    tasks = scenario.tasks if future else scenario.tasks[: t + 1]
    n_out = scenario.num_outputs if future else task.offset + task.n_classes
    model = run.method.inference_model()
    # task-incremental: the task id is known, so accuracy is the argmax within the task's own range
    key = "til_acc" if scenario.kind == "task_incremental" else "acc"
    shadows = _head_results(run, model, tasks, n_out)
    if heads is not None and heads.primary == "linear" and "linear" in shadows and _plain_classifier(model):
        res = shadows["linear"]  # the same logits (head of the same features): no second backbone pass
    elif heads is None or heads.primary == "linear":
        # task-incremental rows keep only til_acc, so only each task's own logits are computed (one routed pass)
        res = evaluate_tasks(model, tasks, n_outputs=n_out, batch_size=cfg.train.eval_batch_size,
                             device=run.device, til_only=scenario.kind == "task_incremental")
    else:
        res = shadows[heads.primary]
    state.rows.append(_row(res, len(scenario), key))
    state.til_rows.append(_row(res, len(scenario), "til_acc"))
    if heads is not None and heads.cfg.compare:
        for v in VARIANTS:
            rows = state.head_rows.setdefault(v, {"rows": [], "til_rows": []})
            rows["rows"].append(_row(shadows[v], len(scenario), key))
            rows["til_rows"].append(_row(shadows[v], len(scenario), "til_acc"))
    if t == len(scenario) - 1 and all(x.val is not None and len(x.val) for x in scenario.tasks):
        _validation(run, model)


def _plain_classifier(model) -> bool:
    """Whether ``model(x)`` is ``model.head(model.forward_features(x))`` (what the linear shadow head computes)."""
    cls = type(model)
    return (isinstance(model, ContinualClassifier) and cls.forward is ContinualClassifier.forward
            and cls.forward_features is ContinualClassifier.forward_features)


def _head_results(run: Run, model, tasks, n_out) -> dict:
    """Results of the feature-based variants this run evaluates (all four with head.compare)."""
    heads = run.heads
    if heads is None or not heads.needs_features:
        return {}
    variants = list(VARIANTS) if heads.cfg.compare else [heads.primary]
    return heads.evaluate(model, tasks, n_outputs=n_out, variants=variants,
                          batch_size=run.cfg.train.eval_batch_size, device=run.device)


def _validation(run: Run, model) -> None:
    """Final CIL accuracy (mean over tasks) on the held-out validation parts, per evaluated head variant:
    what selects a head (and method) without touching test data."""
    heads, batch, device = run.heads, run.cfg.train.eval_batch_size, run.device
    tasks = run.scenario.tasks
    n_out = tasks[-1].offset + tasks[-1].n_classes
    if heads is not None and heads.needs_features:
        variants = list(VARIANTS) if heads.cfg.compare else [heads.primary]
        res = heads.evaluate(model, tasks, n_outputs=n_out, variants=variants, batch_size=batch, device=device,
                             split="val")
    else:
        res = {"linear": evaluate_tasks(model, tasks, n_outputs=n_out, batch_size=batch, device=device,
                                        split="val")}
    run.state.head_val = {v: float(np.mean([r["acc"] for r in rs])) for v, rs in res.items()}


def _log(run: Run, event: dict) -> None:
    event = {"time": round(time.time(), 3), **event}
    append_jsonl(run.out / "events.jsonl", event)
    run.state.events_lines += 1
    if run.sinks is not None:
        run.sinks.write(event)


def final_metrics(run: Run) -> dict:
    """The metrics of a finished run (what metrics.json holds)."""
    cfg, scenario, state, heads = run.cfg, run.scenario, run.state, run.heads
    sizes = [len(t.test) for t in scenario.tasks]
    metrics = {"accuracy_matrix": state.rows, **summarize(state.rows, sizes=sizes, initial=state.initial)}
    til = scenario.kind == "class_incremental" and cfg.run.eval_til
    metrics["til_accuracy_matrix"] = state.til_rows if til else None
    metrics["til"] = summarize(state.til_rows, sizes=sizes) if til else None
    metrics.update(
        initial_accuracy=state.initial, task_names=[t.name for t in scenario.tasks], task_keys=[t.key for t in scenario.tasks],
        task_sizes=sizes, method=cfg.method.name, scenario=scenario.kind, dataset=cfg.scenario.dataset,
        timings={"total_s": round(sum(state.task_seconds), 2), "per_task_s": [round(s, 2) for s in state.task_seconds]},
        method_metrics=run.method.metrics(),
    )
    if heads is not None:
        metrics["head"] = {**heads.metrics(), "val_acc": state.head_val.get(heads.primary)}
        if heads.cfg.compare:
            metrics["heads"] = {v: _head_summary(state, v, sizes) for v in VARIANTS}
    return metrics


def _head_summary(state: RunState, variant: str, sizes: list[int]) -> dict:
    rows = state.head_rows[variant]
    return {"accuracy_matrix": rows["rows"], "til_accuracy_matrix": rows["til_rows"],
            **summarize(rows["rows"], sizes=sizes), "til": summarize(rows["til_rows"], sizes=sizes),
            "val_acc": state.head_val.get(variant)}


def run_experiment(cfg: ExperimentConfig, out_dir: str | Path, *, resume: bool = False,
                   announce: Callable[[str], None] = lambda s: None) -> dict:
    """Run (or resume) the experiment into ``out_dir``; return the metrics dict (also in metrics.json).
    ``announce`` gets ``writing the run to DIR`` once every check has passed, before the first task.

    Under ``torchrun`` (several processes) the run is data-parallel (:mod:`.distributed`): process 0 checks,
    writes and evaluates; the others train their share of every batch and return ``{}``.
    """
    out = Path(out_dir)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    dp = distributed.setup(cfg.run.device)
    device = dp.device if dp is not None else resolve_device(cfg.run.device)
    check_precision(cfg.run.precision, device)
    if dp is not None and cfg.train.batch_size < dp.world:
        raise ValueError(f"train.batch_size={cfg.train.batch_size} is smaller than the {dp.world} processes: "
                         "each process needs at least one sample per batch")
    main = distributed.is_main()
    cfg_text = dump_config(cfg)
    check_sinks(cfg.run.log)  # a missing package, before anything is written
    if main:
        if resume:  # before the lock, which would create a mistyped directory
            check_resumable(out)
            open_run_plugins(out)  # the plugins it recorded hold the code it ran (imported in this process)
        _check_run_dir(out, cfg_text, resume)
    # data, scenario, model and method errors surface here, before the run directory exists
    run = prepare_run(cfg, out, device)
    manifest = run.manifest
    manifest.update(precision=cfg.run.precision, world_size=dp.world if dp is not None else 1,
                    device=str(device), threads=torch.get_num_threads())
    with RunLock(out) if main else contextlib.nullcontext():
        start, record = 0, {}
        if main:
            _check_run_dir(out, cfg_text, resume)  # again under the lock: another run may have started meanwhile
            if resume:
                start, record = restore(run)
                manifest.update(thread_history(out / "manifest.json", manifest["threads"], start))
            atomic_write_text(out / "config.yaml", cfg_text)
            # what --resume checks config.yaml against (a hand edit would mix two experiments)
            manifest[CONFIG_SHA_KEY] = sha256_bytes(cfg_text.encode("utf-8"))
            write_json(out / "manifest.json", {**manifest, RECORD_KEY: record})
            announce(f"writing the run to {out.absolute()}")
        if dp is not None and resume:  # the others start from process 0's restored state
            start = distributed.broadcast_json(dp, start)
            share_state(dp, run)
        run.model.to(device)
        if main and cfg.run.log:
            run.sinks = Sinks(out, cfg.run.log)
        try:
            _train_tasks(run, start, main)
        finally:
            if run.sinks is not None:
                run.sinks.close()
        if not main:
            return {}
        metrics = final_metrics(run)
        write_json(out / "metrics.json", metrics)
        if cfg.run.report:
            from ..report import build_report

            build_report(out)
    return metrics


def _train_tasks(run: Run, start: int, main: bool) -> None:
    shown = run.cfg.run.progress and main
    bar = Progress(range(start, len(run.scenario)), desc="tasks", enabled=shown)
    with progress_enabled(shown):  # the methods' and heads' long phases (utils.progress.phase) too
        for t in bar:
            train_task(run, t)
            if main:
                _end_task(run, t, bar)
    bar.close()


def _end_task(run: Run, t: int, bar: Progress) -> None:
    """Process 0 after task ``t``: evaluate, log the row, save the checkpoint, report progress."""
    state, model, method, heads = run.state, run.model, run.method, run.heads
    evaluate_row(run, t)
    row = [v for v in state.rows[-1][: t + 1]]
    _log(run, {"event": "task_end", "task": t, "seconds": round(state.task_seconds[-1], 3),
               "acc_row": row, "avg_acc": float(np.mean(row))})
    meta = {"task": t, "structure": model_structure(model), "method": method.state_meta(),
            "state": state.to_meta(), "heads": heads.state_meta(),
            "events_sha256": events_sha256(run.out / "events.jsonl", state.events_lines)}
    save_checkpoint(run.out, t, model.state_dict(), method.state_tensors(), meta,
                    keep=run.cfg.run.keep_checkpoints,
                    head_tensors=heads.state_tensors() if heads.needs_features else None)
    bar.set_postfix(avg_acc=f"{np.mean(row):.1f}")
    bar.line(f"task {t + 1}/{len(run.scenario)} done: avg acc {np.mean(row):.2f} "
             f"({state.task_seconds[-1]:.1f} s)")


def load_metrics(run_dir: str | Path) -> dict:
    return read_json(Path(run_dir) / "metrics.json")
