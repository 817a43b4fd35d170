"""``clmerge run CONFIG --dry-run``: check a config end to end on this machine, without its data or weights.

What a dry run does (so that a user with a GPU and the data can trust the config):

1. builds the config's real backbone from its architecture config with random init (``model.pretrained:
   false`` semantics, whatever the config says; ``model.config`` overrides still apply);
2. writes a tiny look-alike dataset into a temporary directory, in the on-disk layout the config's data source
   reads (ImageNet-R / -A pre-split wnid folders, DomainNet domain folders + split files, CUB-200-2011 tables,
   the CIFAR-100 python pickles, generic class folders), with the config's number of classes, so the
   scenario cuts the same class split into the same tasks. The data layer writes it: each reader registers
   the writer of its layout (:mod:`clmerge.data.lookalike`). Bundled sources (mnist5k, digits, mnist1d, ...)
   need nothing and are only subsampled per class;
3. runs the real engine hooks (``engine.run``: ``begin_task``, ``fit``, ``end_task``) for the first
   ``tasks`` tasks with one epoch of ``steps`` optimizer steps and a small batch (a method's own inner
   training loops through ``ctx.fit``, e.g. HALRP's warm-up, are capped the same way; the method, its options
   and the scenario are otherwise untouched), then one evaluation, saves a checkpoint and restores it into a
   freshly built model (the resume path);
4. prints a short summary and returns it as a dict.
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


from ..adapters.structure import model_structure
from ..utils import inpaths
from ..utils.progress import progress_enabled
from ..config import ExperimentConfig
from ..data.lookalike import LookalikeSpec, lookalike_class_count
from ..data.lookalike import write_lookalike as write_dataset_lookalike
from .checkpoint import save_checkpoint
from . import distributed
from .run import evaluate_row, fresh_objects, prepare_run, resolve_device, restore, train_task

__all__ = ["dry_run", "dry_run_config", "write_lookalike", "lookalike_classes", "time_left"]


def dry_run_config(cfg: ExperimentConfig, *, steps: int = 2, batch_size: int = 4,
                   train_per_class: int = 2, test_per_class: int = 1) -> ExperimentConfig:
    """The config a dry run trains with: random init, 1 epoch of ``steps`` steps, a small batch, no report.

    The method, its options, the head and the scenario's class split are not changed; every source is
    subsampled per class (``scenario.train_per_class`` / ``test_per_class``, only if smaller), which matters
    for bundled sources (the look-alike folders hold that many images anyway).
    """
    c = cfg.model_copy(deep=True)
    c.model.pretrained = False
    c.train.epochs = 1
    c.train.max_steps_per_epoch = steps
    c.train.batch_size = min(c.train.batch_size, batch_size)
    c.train.eval_batch_size = min(c.train.eval_batch_size, 64)
    c.optim.warmup_epochs = 0
    c.run.report, c.run.progress = False, False
    s = c.scenario
    s.train_per_class = min(s.train_per_class or train_per_class, train_per_class)
    s.test_per_class = min(s.test_per_class or test_per_class, test_per_class)
    if s.train_per_task is not None:
        s.train_per_task = min(s.train_per_task, 10 * train_per_class)
    return c


def lookalike_classes(cfg: ExperimentConfig) -> int:
    """How many classes the look-alike dataset gets: from class_order, classes_per_task, the source, the root.

    For ``image_folder`` the count comes from a trailing number of ``data_root`` (``tiny-imagenet-200``)
    or, failing that, 10 per task.
    """
    s = cfg.scenario
    if s.class_order is not None:
        return max(s.class_order) + 1
    if s.classes_per_task is not None:
        return sum(s.classes_per_task)
    if (known := lookalike_class_count(s.dataset, dict(s.options))) is not None:
        return known
    m = re.search(r"(\d+)/*$", s.data_root or "")
    return int(m.group(1)) if m else 10 * s.n_tasks


def per_class_for_batches(cfg: ExperimentConfig, train_per_class: int, batch: int) -> int:
    """The smallest per-class count >= ``train_per_class`` whose per-task training set (after the validation
    hold-out) has at least one full batch, and neither it nor the validation part ends in a batch of a single
    image (BatchNorm cannot train on one)."""
    s, k = cfg.scenario, lookalike_classes(cfg)
    split = s.kind == "class_incremental" or s.transform == "none"
    cpt = (min(s.classes_per_task) if s.classes_per_task else k // s.n_tasks) if split else k
    for n in range(train_per_class, train_per_class + 4 * batch + 2):
        total = n * max(cpt, 1)
        val = max(1, round(s.val_fraction * total)) if s.val_fraction > 0 else 0
        if total - val >= batch and (total - val) % batch != 1 and val % batch != 1:
            return n
    return train_per_class


def write_lookalike(cfg: ExperimentConfig, root: Path, *, n_train: int = 2, n_test: int = 1) -> str | None:
    """Write the look-alike dataset of ``cfg.scenario.dataset`` under ``root``; return a one-line description.

    The data layer writes it (:mod:`clmerge.data.lookalike`: each reader registers a writer of its layout).
    Returns ``None`` for sources that need no files (bundled ones).
    """
    name, k = cfg.scenario.dataset, lookalike_classes(cfg)
    spec = LookalikeSpec(classes=k, n_train=n_train, n_test=n_test, options=dict(cfg.scenario.options))
    if not write_dataset_lookalike(name, root, spec):
        return None
    return f"{name}: {k} classes, {n_train} train + {n_test} test images per class, written to {root}"


def _task_losses(out: Path) -> dict[int, float]:
    events = out / "events.jsonl"
    if not events.exists():
        return {}
    import json

    rows = [json.loads(line) for line in inpaths.read_jsonl_lines(events, within=out) if line.strip()]
    return {r["task"]: r["loss"] for r in rows if r.get("event") == "epoch" and r.get("task") is not None}


def _check_resume(cfg: ExperimentConfig, out: Path, device) -> None:
    """Restore the last checkpoint into a freshly built model and method (the ``--resume`` path)."""
    start = restore(prepare_run(cfg, out, device, heads=False, data_check="fit"))[0]
    if start < 1:
        raise RuntimeError("dry run: the checkpoint could not be restored")


def _cap_inner_loops(method, steps: int) -> None:
    """Methods' own training loops (``ctx.fit``: warm-ups, extra epochs) also run 1 epoch of ``steps`` steps."""
    begin = method.begin_task

    def capped_begin(task, ctx):
        inner = ctx.fit
        if inner is not None:
            ctx.fit = lambda **kw: inner(**{**kw, "epochs": 1, "max_steps_per_epoch": steps})
        return begin(task, ctx)

    method.begin_task = capped_begin


def _capped(objs, steps):
    _cap_inner_loops(objs[1], steps)
    return objs


def time_left(task_seconds: list[float], tasks_left: int) -> str:
    """The time hint after a task: the tasks left at the mean time of the tasks so far, then the evaluation
    and the resume check (not estimated: on a pm_imagenet_r_10 dry run they took about a quarter of a task)."""
    if not tasks_left:
        return "next: the evaluation and the resume check"
    mean = sum(task_seconds) / len(task_seconds)
    return f"about {mean * tasks_left:.0f}s for {tasks_left} more task(s), then the evaluation and the resume check"


def _run_tasks(cfg: ExperimentConfig, out: Path, tasks: int, echo: Callable[[str], None]) -> dict:
    dp = distributed.setup(cfg.run.device)
    device = dp.device if dp is not None else resolve_device(cfg.run.device)
    echo(f"building {cfg.model.name} (random init) and {cfg.method.name}; then {tasks} task(s) of "
         f"{cfg.train.max_steps_per_epoch} steps, an evaluation, a resume check")
    # with the configured head's statistics, as a run keeps them; the method's options fit to the sample (a
    # replay buffer holds at most its few images: the same draws, no allocation of the configured size)
    run = prepare_run(cfg, out, device, data_check="fit")
    given = cfg.method_options().model_dump()
    cut = {k: v for k, v in run.method.options.model_dump().items() if given.get(k) != v}
    if cut:
        n_train = sum(len(t.train) for t in run.scenario.tasks)
        echo("method options cut to this dry run's " + f"{n_train} training images: "
             + ", ".join(f"method.{k}={given[k]} -> {v}" for k, v in cut.items())
             + " (a real run refuses them when larger than its training set)")
    _cap_inner_loops(run.method, cfg.train.max_steps_per_epoch)
    run.fresh = lambda: _capped(fresh_objects(cfg), cfg.train.max_steps_per_epoch)
    run.model.to(device)
    state, scenario, n = run.state, run.scenario, min(tasks, len(run.scenario))
    params = sum(p.numel() for p in run.model.backbone.parameters())
    echo(f"backbone {cfg.model.name} (random init): {params / 1e6:.2f}M parameters; "
         f"{len(scenario)} tasks of {[t.n_classes for t in scenario.tasks[:3]]}... classes ({scenario.kind})")
    for t in range(n):
        train_task(run, t)
        meta = {"task": t, "structure": model_structure(run.model), "method": run.method.state_meta(),
                "state": state.to_meta()}
        save_checkpoint(out, t, run.model.state_dict(), run.method.state_tensors(), meta, keep=1)
        loss = _task_losses(out).get(t)
        trained = (f"{cfg.train.max_steps_per_epoch} steps, loss {loss:.4f}" if loss is not None
                   else "nothing trained (feature statistics only)")
        echo(f"task {t}: {trained}, {state.task_seconds[-1]:.1f}s ({time_left(state.task_seconds, n - t - 1)})")
    evaluate_row(run, n - 1)
    row = [round(v, 2) for v in state.rows[-1][:n] if v is not None]
    echo(f"evaluation after task {n - 1}: accuracy per task {row}")
    _check_resume(cfg, out, device)
    echo("checkpoint saved and restored into a fresh model: ok")
    return {"tasks_run": n, "n_tasks": len(scenario), "accuracy_row": row, "backbone_params": params,
            "losses": _task_losses(out), "task_seconds": state.task_seconds,
            "method_metrics": run.method.metrics(),
            "trainable_params": run.manifest["trainable_params_after_setup"]}


def dry_run(cfg: ExperimentConfig, *, tasks: int = 2, steps: int = 2, batch_size: int = 4, train_per_class: int = 2,
            workdir: str | Path | None = None, echo: Callable[[str], None] = print) -> dict:
    """Dry-run ``cfg`` (see the module docstring); returns a summary dict, raises on any failure.

    Args:
        cfg: the experiment config as loaded (its data need not exist).
        tasks: how many of the first tasks to train (at least 1).
        steps: optimizer steps per task.
        batch_size: upper bound on the training batch size (the config's, if smaller, is kept).
        train_per_class: training images per class (look-alike data and subsampling of bundled sources).
        workdir: where to write the look-alike data and the run (default: a temporary directory, removed).
        echo: where the summary lines go.
    """
    t0 = time.time()
    dp = distributed.setup(cfg.run.device)  # under torchrun (--nproc N): every process dry-runs; 0 prints
    if not distributed.is_main():
        echo = lambda line: None  # noqa: E731
    if dp is not None:  # every process needs a sample of each batch
        batch_size = max(batch_size, dp.world)
    batch = min(cfg.train.batch_size, batch_size)
    train_per_class = per_class_for_batches(cfg, train_per_class, batch)
    dcfg = dry_run_config(cfg, steps=steps, batch_size=batch_size, train_per_class=train_per_class)
    with tempfile.TemporaryDirectory(prefix="clmerge-dry-") as tmp:
        base = Path(workdir) if workdir is not None else Path(tmp)
        data_root = base / "data"
        described = write_lookalike(dcfg, data_root, n_train=train_per_class)
        if described is not None:
            dcfg.scenario.data_root = str(data_root)
            echo(f"look-alike data: {described}")
        out = base / "run"
        out.mkdir(parents=True, exist_ok=True)
        with progress_enabled(cfg.run.progress):  # the long phases follow the config's run.progress
            summary = _run_tasks(dcfg, out, max(1, tasks), echo)
    summary["seconds"] = round(time.time() - t0, 2)
    summary["method"], summary["dataset"] = cfg.method.name, cfg.scenario.dataset
    summary["processes"] = dp.world if dp is not None else 1
    procs = f", {dp.world} data-parallel processes ({dp.backend})" if dp is not None else ""
    echo(f"dry run ok: {cfg.method.name} on {cfg.scenario.dataset}, {summary['tasks_run']}/{summary['n_tasks']} "
         f"tasks, {summary['seconds']}s{procs}")
    return summary
