"""Training throughput and peak memory per continual method and precision; writes throughput.md.

What one cell (method, precision, network) measures: the engine's own loop (``engine.run.train_task`` ->
``engine.training.fit``, with the method's ``loss`` / ``before_step`` / ``after_step``) trains task 1 for a
couple of steps and runs the method's end-of-task work, so that task 2 starts with the state a method carries
(frozen earlier LoRA components, Fisher / anchors, GPM bases, the merged model). Task 2 then trains, and a
clock on ``after_step`` stamps the end of every optimizer step: the first ``--warmup`` steps are skipped and
the median of the next ``--steps`` step intervals is the cell's time per step (a full loop step: batch,
forward under autocast, backward, gradient hooks, optimizer, scheduler, ``after_step``). The method's
``loss`` and hooks are timed too, so an overhead can be traced to the part that costs it.

Every cell runs in a fresh process (forked from a parent that has imported the libraries and parsed the data
once; ``spawn`` on CUDA), so its memory is its own. Peak memory: CUDA, ``torch.cuda.max_memory_allocated``
over task 2 (absolute); CPU, the growth of the peak resident set (Linux ``VmHWM``, reset through
``/proc/self/clear_refs``) over task 2 (its ``begin_task`` and the timed steps) above the resident set at
its start, after ``malloc_trim`` returned freed heap to the system: gradients, optimizer state, activations
and the method's per-step state.

Rounds: every round runs every cell once (the method order rotates between rounds); a method's ratio to
seq_lora is taken within a round and precision, then the median over rounds is reported, so load changes on a
shared machine hit both sides of a ratio alike. On a CPU the ratios (and the loss / hook times) use this
process's CPU time per step (one thread: time slices lost to other jobs do not count), besides the wall-clock
steps per second; with CUDA, wall time.

Commands:

    nice -n 5 python benchmarks/throughput.py                     # CPU: tiny ViT + HALRP's MLP, ~15 min
    python benchmarks/throughput.py --device cuda                  # GPU: adds ViT-B/16 (random init)
    python benchmarks/throughput.py --quick --methods seq_lora,pm  # smoke, < 1 minute

With ``--inference-reps N`` the timed task runs to its end and every cell adds the trainable parameters, the
state the method and the head suite keep, and the time per evaluated test batch (benchmarks/cl_baselines_cost.py
uses it for the continual-learning baselines).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import multiprocessing as mp
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from throughput_report import write_plot, write_report  # noqa: E402

PRECISIONS = ["fp32", "bf16", "fp16"]
# label -> (method section, kind); the labels and option sets of benchmarks/lora_cl/run_evidence.py METHODS.
# "lora" methods are held to the target of <= 1.15 x seq_lora per step; "full" ones train the whole backbone.
METHODS: dict[str, tuple[dict, str]] = {
    "seq_lora": ({"name": "seq_lora"}, "lora"),
    "pm": ({"name": "pm"}, "lora"),
    "pm_m": ({"name": "pm", "perturbation": "none"}, "lora"),
    "sd_lora": ({"name": "sd_lora"}, "lora"),
    "sd_lora_rr": ({"name": "sd_lora_rr"}, "lora"),
    "sd_lora_kd": ({"name": "sd_lora_kd"}, "lora"),
    "inflora": ({"name": "inflora"}, "lora"),
    "lora_avg": ({"name": "lora_avg"}, "lora"),
    "lora_dare": ({"name": "lora_dare"}, "lora"),
    "coma": ({"name": "coma"}, "lora"),
    "cofima": ({"name": "cofima"}, "lora"),
    "finetune": ({"name": "finetune"}, "full"),
    "ewc": ({"name": "ewc"}, "full"),
    "l2": ({"name": "l2"}, "full"),
    "gpm": ({"name": "gpm"}, "full"),
    # prompt methods (frozen backbone; prompts, keys and head train) and MagMax (full fine-tuning)
    "l2p": ({"name": "l2p"}, "prompt"),
    "dualprompt": ({"name": "dualprompt"}, "prompt"),
    "coda_prompt": ({"name": "coda_prompt"}, "prompt"),
    "hide_prompt": ({"name": "hide_prompt"}, "prompt"),
    "magmax": ({"name": "magmax"}, "full"),
    # the continual-learning baselines of recent papers (benchmarks/cl_baselines_cost.py runs them with the
    # inference column): rehearsal with a 200-example buffer, SLCA, the adapter methods with their defaults
    # (APER's adapter variant), and the frozen-backbone heads (no training step at all)
    "er": ({"name": "er", "buffer_size": 200}, "rehearsal"),
    "der": ({"name": "der", "buffer_size": 200}, "rehearsal"),
    "derpp": ({"name": "derpp", "buffer_size": 200}, "rehearsal"),
    "er_ace": ({"name": "er_ace", "buffer_size": 200}, "rehearsal"),
    "xder": ({"name": "xder", "buffer_size": 200}, "rehearsal"),
    "lwf": ({"name": "lwf"}, "full"),
    "icarl": ({"name": "icarl", "buffer_size": 200}, "rehearsal"),
    "slca": ({"name": "slca"}, "full"),
    "aper": ({"name": "aper"}, "adapter"),
    "ease": ({"name": "ease"}, "adapter"),
    "mos": ({"name": "mos"}, "adapter"),
    "simplecil": ({"name": "simplecil"}, "frozen"),
    "ranpac": ({"name": "ranpac"}, "frozen"),
    # the pretrained-model baselines (docs/ptm_baselines.md)
    "olora": ({"name": "olora"}, "lora"),
    "lae": ({"name": "lae"}, "adapter"),
    "fecam": ({"name": "fecam"}, "frozen"),
    "cl_lora": ({"name": "cl_lora"}, "lora"),
}
# APER adapts its backbone in the first task only (its later tasks only add prototypes): its step is task 1's
TIMED_TASK = {"aper": 0}
CL_BASELINES = ["er", "der", "derpp", "slca", "aper", "ease", "mos", "simplecil", "ranpac", "lwf", "er_ace",
                "xder", "icarl"]
CL_BASELINES += ["olora", "lae", "fecam", "cl_lora"]
# Task 1's end-of-task statistics are computed on fewer samples than the methods' defaults: they only set up
# the state task 2 carries (its size and per-step cost do not depend on the sample count), and the default
# whole-task Fisher passes would dominate the benchmark's runtime.
END_TASK_CAPS: dict[str, dict] = {"pm": {"fisher_samples": 64}, "cofima": {"fisher_samples": 64},
                                  "ewc": {"fisher_samples": 64}, "inflora": {"covariance_samples": 128}}
# the default run: every method but l2, gpm, the prompt methods, magmax and the CL baselines (those on request:
# --methods), and halrp
DEFAULT_METHODS = [m for m in METHODS if m not in ("l2", "gpm", "l2p", "dualprompt", "coda_prompt", "hide_prompt",
                                                  "magmax", *CL_BASELINES)] + ["halrp"]
HALRP = {"halrp": ({"name": "halrp", "warmup_epochs": 1, "grad_multiplier": 10.0, "prune": True}, "halrp"),
         "finetune": ({"name": "finetune"}, "full")}
# network -> model + scenario sections, the methods it runs and the baseline of its ratios
MNIST5K = {"dataset": "mnist5k", "n_tasks": 5}  # 800 training images per task: 12 full batches of 64
PFMNIST = {"dataset": "fashion_mnist", "kind": "task_incremental", "n_tasks": 2, "transform": "permutation",
           "permute_first_task": True, "train_per_task": 1024}
SUITES: dict[str, dict] = {
    "vit-tiny-fmnist": {"model": {"name": "vit-tiny-fmnist"}, "scenario": MNIST5K, "methods": METHODS,
                        "baseline": "seq_lora", "cuda_only": False},
    "vit-b16": {"model": {"name": "vit-b16", "pretrained": False}, "scenario": MNIST5K, "methods": METHODS,
                "baseline": "seq_lora", "cuda_only": True},
    # HALRP: one head per task and its own small network (benchmarks/halrp/run.py, permuted Fashion-MNIST)
    "mlp (HALRP)": {"model": {"name": "mlp", "pretrained": False,
                              "config": {"image_size": 28, "hidden": [256, 256]}},
                    "scenario": PFMNIST, "methods": HALRP, "baseline": "finetune", "cuda_only": False},
}


class _Done(Exception):
    """Raised by the step clock after the last timed step: task 2's end-of-task work is not part of a cell."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """Wraps a method's ``loss`` / ``before_step`` / ``after_step`` on the instance: time stamps (wall and
    this process's CPU time) at the end of every optimizer step (``after_step`` is the loop's last call of a
    step) and the seconds spent in each hook (CPU time on a CPU; wall time with CUDA's asynchronous
    kernels)."""

    def __init__(self, method, total_steps: int, device: torch.device, on_last=None) -> None:
        self.on_last = on_last  # called at the last timed step instead of raising _Done (the task then goes on)
        self.stamps: list[float] = []
        self.cpu_stamps: list[float] = []
        self.clock = time.perf_counter if device.type == "cuda" else time.process_time
        self.spent = {"loss": [], "before_step": [], "after_step": []}
        self.total, self.device = total_steps, device
        for name in self.spent:
            setattr(method, name, self._timed(name, getattr(method, name)))

    def _timed(self, name: str, fn):
        def call(*args, **kwargs):
            _sync(self.device)
            t0 = self.clock()
            out = fn(*args, **kwargs)
            _sync(self.device)
            self.spent[name].append(self.clock() - t0)
            if name == "after_step" and len(self.stamps) < self.total:
                self.stamps.append(time.perf_counter())
                self.cpu_stamps.append(time.process_time())
                if len(self.stamps) == self.total:
                    if self.on_last is None:
                        raise _Done
                    self.on_last()
            return out

        return call


class PeakMemory:
    """Peak memory over a region: CUDA max_memory_allocated, or the growth of the peak RSS (Linux VmHWM)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.base = device, 0

    @staticmethod
    def _status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"/proc/self/status has no {key}")

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the system, so reuse cannot hide growth
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        self.base = self._status("VmRSS")

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self._status("VmHWM") - self.base


def cell_config(suite: dict, label: str, precision: str, a) -> dict:
    method, _ = suite["methods"][label]
    method = {**method, **END_TASK_CAPS.get(method["name"], {})}
    return {"seed": 0, "scenario": dict(suite["scenario"]), "model": dict(suite["model"]), "method": method,
            "optim": {"name": "adam", "lr": 1e-3},
            "train": {"epochs": 1, "batch_size": a.batch, "max_steps_per_epoch": a.task1_steps},
            "run": {"device": a.device, "threads": a.threads, "precision": precision, "progress": False,
                    "report": False}}


def measure_cell(job: dict) -> dict:
    """One cell in this (fresh) process: task 1 with end-of-task work, then the timed steps of task 2 (of task
    1 where ``job["timed_task"]`` is 0: a method that adapts its backbone in the first task only). With
    ``job["inference_reps"]`` the timed task also runs to its end (its end-of-task work, untimed), tasks 1-2
    are completed, and the cell adds what a method costs beyond the step (``cost_extras``). A method that
    trains nothing in the timed task (the frozen-backbone heads) has no step time; its peak memory is then
    that of the whole task."""
    from clmerge.config import parse_config
    from clmerge.engine.run import Run, build_heads, prepare, resolve_device, train_task
    from clmerge.engine.setup import head_variant_needs_features

    torch.set_num_threads(job["threads"])
    cfg = parse_config(job["config"])
    device = resolve_device(cfg.run.device)
    scenario, model, method, _ = prepare(cfg)
    model.to(device)
    heads = build_heads(cfg, model, method) if head_variant_needs_features(cfg) else None
    k, extras = job.get("timed_task", 1), bool(job.get("inference_reps"))
    precision, cfg.run.precision = cfg.run.precision, "fp32"  # task 1 only sets up state (CPU fp16 is slow)
    with tempfile.TemporaryDirectory() as tmp:
        run = Run(cfg, scenario, model, method, Path(tmp), device, heads=heads)
        if k == 1:
            train_task(run, 0)
        cfg.run.precision = precision
        clock, out = _time_task(run, k, job, extras)
        if extras:
            if k == 0:
                train_task(run, 1)  # the state after two tasks, as the other cells have
            out.update(cost_extras(run, job, out.pop("trainable", 0)))
    if not clock.stamps:
        return {**out, "no_step": True, "hook_s": {n: 0.0 for n in clock.spent}}
    w, total = job["warmup"], job["warmup"] + job["steps"]
    steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])][w - 1:]
    cpu = [b - a for a, b in zip(clock.cpu_stamps, clock.cpu_stamps[1:])][w - 1:]
    hooks = {n: statistics.median(v[w:total]) if len(v) > w else 0.0 for n, v in clock.spent.items()}
    return {"step_s": statistics.median(steps), "steps": steps, "cpu_step_s": statistics.median(cpu),
            "cpu_steps": cpu, "hook_s": hooks, **out}


def _time_task(run, k: int, job: dict, extras: bool) -> tuple[StepClock, dict]:
    """Train task ``k`` under the step clock over full batches only (timed steps are alike); the peak memory
    (and, with ``extras``, the trainable parameters) up to the last timed step, else over the whole task."""
    from clmerge.engine.run import train_task

    cfg, train = run.cfg, run.scenario.tasks[k].train
    total = job["warmup"] + job["steps"]
    full = len(train) // cfg.train.batch_size
    cfg.train.max_steps_per_epoch = max(1, min(full, train.num_batches(cfg.train.batch_size)))
    cfg.train.epochs = math.ceil(total / cfg.train.max_steps_per_epoch)
    memory, seen = PeakMemory(run.device), {}
    memory.start()
    last = (lambda: seen.update(peak_bytes=memory.peak_bytes(), trainable=_trainable(run))) if extras else None
    clock = StepClock(run.method, total, run.device, on_last=last)
    try:
        train_task(run, k)
    except _Done:
        pass
    if len(clock.stamps) < total and (clock.stamps or not extras):
        raise RuntimeError(f"task {k + 1} ran {len(clock.stamps)} steps, fewer than {total}")
    return clock, {"peak_bytes": memory.peak_bytes(), **seen, "timed_task": k + 1}


def _trainable(run) -> int:
    """Parameters that get gradients in the current task: the model's and the inference model's, once each."""
    params = {id(p): p for m in (run.model, run.method.inference_model()) for p in m.parameters()}
    return sum(p.numel() for p in params.values() if p.requires_grad)


def _nbytes(tensors) -> int:
    """Bytes of distinct tensor storages (a tensor shared by two entries counts once)."""
    seen = {}
    for v in tensors:
        if isinstance(v, torch.Tensor):
            seen[(v.untyped_storage().data_ptr(), v.dtype)] = v.untyped_storage().nbytes()
    return sum(seen.values())


def cost_extras(run, job: dict, trainable: int) -> dict:
    """After task 2's end-of-task work: trainable parameters of task 2's step, the method's state (replay
    buffer, prototypes, covariances, adapters it keeps) and the head suite's statistics in bytes, the
    inference model's weights in bytes, and the time per evaluated test batch of the classifier a run reports
    (the primary head: linear, NCM, RanPAC), medians over ``inference_reps`` passes over tasks 1-2's test
    images (CPU time on a CPU, like the steps)."""
    from clmerge.engine.evaluate import evaluate_tasks
    from clmerge.utils.precision import autocast

    cfg, model, heads = run.cfg, run.method.inference_model(), run.heads
    tasks, bs = run.scenario.tasks[:2], cfg.train.batch_size
    n_out = tasks[-1].offset + tasks[-1].n_classes
    batches = sum(t.test.num_batches(bs) for t in tasks)
    clock = time.perf_counter if run.device.type == "cuda" else time.process_time
    times = []
    for _ in range(job["inference_reps"]):
        t0 = clock()
        with autocast(cfg.run.precision, run.device):
            if heads is not None and heads.primary != "linear":
                heads.evaluate(model, tasks, n_outputs=n_out, variants=[heads.primary], batch_size=bs,
                               device=run.device)
            else:
                evaluate_tasks(model, tasks, n_outputs=n_out, batch_size=bs, device=run.device)
        _sync(run.device)
        times.append((clock() - t0) / batches)
    head_bytes = _nbytes(heads.state_tensors().values()) if heads is not None and heads.needs_features else 0
    return {"trainable": trainable, "method_state_bytes": _nbytes(run.method.state_tensors().values()),
            "head_state_bytes": head_bytes, "model_bytes": _nbytes(model.state_dict().values()),
            "infer_batch_s": statistics.median(times), "infer_batches": batches}


def _child(job: dict, conn) -> None:
    try:
        conn.send({"ok": measure_cell(job)})
    except BaseException as exc:  # reported by the parent with the cell's name
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        conn.close()


def run_cell(job: dict, context) -> dict:
    """``measure_cell`` in a fresh child process; returns its result or ``{"error": ...}``."""
    recv, send = context.Pipe(duplex=False)
    proc = context.Process(target=_child, args=(job, send))
    proc.start()
    send.close()
    try:
        msg = recv.recv()
    except EOFError:
        msg = {"error": "the cell's process died without a result"}
    proc.join()
    return msg.get("ok", msg)


def _cache_datasets() -> None:
    """Parse each dataset once in the parent (mnist5k is a 4-s text parse); forked cells inherit it."""
    import clmerge.engine.setup as engine_setup

    build, cache = engine_setup.build_dataset, {}

    def cached(name, **kw):
        key = json.dumps([name, kw], sort_keys=True, default=str)
        if key not in cache:
            cache[key] = build(name, **kw)
        return cache[key]

    engine_setup.build_dataset = cached


def _warm_parent(suites: dict, a) -> None:
    from clmerge.config import parse_config
    from clmerge.engine.run import prepare

    _cache_datasets()
    for suite in suites.values():  # imports the backbone code and fills the dataset cache before any fork
        prepare(parse_config(cell_config(suite, next(iter(suite["methods"])), "fp32", a)))


def machine_info(a) -> dict:
    """The device named: CPU model, cores, torch, threads, load average (the machine may be shared)."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or platform.machine())
    info = {"cpu": model, "cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)),
            "torch": torch.__version__, "python": platform.python_version(), "threads": a.threads,
            "load_start": list(os.getloadavg()), "platform": platform.platform(), "device": a.device,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if a.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(a.device))
    return info


def _step_counts(a, precision: str) -> dict:
    """Warm-up and timed steps of a cell; fp16 on a CPU without fp16 matrix units runs ~10x slower than fp32
    (its matmuls fall back to slow kernels), so it gets ``--fp16-cpu-steps`` after one warm-up step."""
    if precision == "fp16" and not a.device.startswith("cuda"):
        return {"warmup": 1, "steps": min(a.steps, a.fp16_cpu_steps)}
    return {"warmup": a.warmup, "steps": a.steps}


def run_rounds(suites: dict, a, context) -> list[dict]:
    """Every (suite, precision, method) cell once per round; the method order rotates between rounds."""
    cells = []
    for r in range(a.rounds):
        for net, suite in suites.items():
            labels = [m for m in suite["methods"] if m in a.methods or m == suite["baseline"]]
            shift = r % len(labels)
            for precision in a.precisions:
                for label in labels[shift:] + labels[:shift]:
                    job = {"config": cell_config(suite, label, precision, a), "threads": a.threads,
                           "inference_reps": a.inference_reps, "timed_task": TIMED_TASK.get(label, 1),
                           **_step_counts(a, precision)}
                    t0 = time.time()
                    res = run_cell(job, context)
                    cells.append({"suite": net, "method": label, "kind": suite["methods"][label][1],
                                  "precision": precision, "round": r, **res})
                    shown = (f"{res['step_s'] * 1e3:.1f} ms/step, CPU {res['cpu_step_s'] * 1e3:.1f}"
                             if "step_s" in res else "no training step" if res.get("no_step") else res["error"])
                    print(f"round {r + 1}/{a.rounds} {net} {precision} {label}: {shown} "
                          f"({time.time() - t0:.1f} s)", flush=True)
    return cells


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]; CUDA adds the ViT-B/16 suite")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help="comma-separated labels (also: l2, gpm, the prompt methods, magmax, " + ", ".join(CL_BASELINES) + ")")
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--suites", default=None, help="comma-separated networks (default: all the device runs)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="task-2 steps not timed (>= 1)")
    ap.add_argument("--steps", type=int, default=5, help="timed task-2 steps per cell")
    ap.add_argument("--fp16-cpu-steps", type=int, default=1, help="timed steps of fp16 cells on a CPU")
    ap.add_argument("--task1-steps", type=int, default=1,
                    help="task-1 steps (fp32) before its end-of-task work")
    ap.add_argument("--inference-reps", type=int, default=0,
                    help="> 0: task 2 runs to its end and each cell adds its state sizes, trainable parameters "
                         "and the time per evaluated test batch (median of this many passes)")
    ap.add_argument("--quick", action="store_true", help="smoke: 1 round, 1+2 steps, tiny ViT, fp32 + bf16")
    ap.add_argument("--out", type=Path, default=HERE / "throughput.md")
    ap.add_argument("--json", type=Path, default=None, help="raw results (default: OUT with .json)")
    ap.add_argument("--plot", type=Path, default=None, help="PNG (default: OUT with .png)")
    ap.add_argument("--notes", type=Path, default=HERE / "throughput_notes.md",
                    help="hand-written analysis included in the report if the file exists")
    ap.add_argument("--report-only", action="store_true", help="rebuild OUT and the plot from the JSON")
    a = ap.parse_args(argv)
    if a.quick:
        a.rounds, a.warmup, a.steps, a.task1_steps = 1, 1, 2, 1  # fp16 on a CPU: 1 + 1
        a.suites = a.suites or "vit-tiny-fmnist"
        if "--precisions" not in (argv if argv is not None else sys.argv):
            a.precisions = "fp32,bf16"
    a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    a.precisions = [p.strip() for p in a.precisions.split(",") if p.strip()]
    known = set(METHODS) | set(HALRP)
    checks = (("--methods", a.methods, known), ("--precisions", a.precisions, PRECISIONS))
    for name, values, allowed in checks:
        if bad := [v for v in values if v not in allowed]:
            ap.error(f"{name}: unknown {', '.join(bad)} (known: {', '.join(sorted(allowed))})")
    if a.warmup < 1 or a.steps < 1:
        ap.error("--warmup and --steps must be >= 1")
    a.json = a.json or a.out.with_suffix(".json")
    a.plot = a.plot or a.out.with_suffix(".png")
    return a


def select_suites(a) -> dict:
    cuda = a.device.startswith("cuda")
    names = a.suites.split(",") if a.suites else [n for n, s in SUITES.items() if cuda or not s["cuda_only"]]
    if bad := [n for n in names if n not in SUITES]:
        raise SystemExit(f"--suites: unknown {', '.join(bad)} (known: {', '.join(SUITES)})")
    picked = {n: SUITES[n] for n in names if any(m in a.methods for m in SUITES[n]["methods"])}
    return {n: s for n, s in picked.items() if not s["cuda_only"] or cuda}


def collect(a, argv: list[str] | None) -> dict:
    """Run every cell of ``a`` and write the raw results to ``a.json`` (atomically); returns them."""
    torch.set_num_threads(a.threads)
    info = machine_info(a)
    suites = select_suites(a)
    context = mp.get_context("spawn" if a.device.startswith("cuda") else "fork")
    if not a.device.startswith("cuda"):
        _warm_parent(suites, a)
    t0 = time.time()
    cells = run_rounds(suites, a, context)
    info.update(load_end=list(os.getloadavg()), seconds=round(time.time() - t0, 1))
    keep = ("batch", "rounds", "warmup", "steps", "fp16_cpu_steps", "task1_steps", "quick", "precisions",
            "methods", "inference_reps")
    settings = {k: v for k, v in vars(a).items() if k in keep}
    baselines = {n: s["baseline"] for n, s in suites.items()}
    data = {"machine": info, "settings": settings, "suites": baselines,
            "argv": shlex.join(sys.argv[1:] if argv is None else argv), "cells": cells}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.json.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(a.json)
    return data


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.report_only:
        data = json.loads(a.json.read_text())
    else:
        data = collect(a, argv)
    notes = a.notes.read_text() if a.notes and a.notes.exists() and not data["settings"]["quick"] else ""
    write_report(data, a.out, plot=a.plot, notes=notes)
    write_plot(data, a.plot)
    print(f"wrote {a.out}, {a.plot}, {a.json}", flush=True)


if __name__ == "__main__":
    main()
