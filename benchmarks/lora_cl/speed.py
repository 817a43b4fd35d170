"""Speed and memory of the LoRA continual-learning methods; writes speed.md.

1. Training step time (forward + backward + Adam step) of sd_lora and pm relative to seq_lora on the same
   backbone and batch, measured after ``--old-tasks`` earlier tasks (SD-LoRA then carries that many frozen
   components); target ratio <= 1.15.
2. Inference: SD-LoRA's folded inference model (``inference_model()``) vs the plain backbone.
3. P&M's diagonal Fisher: vectorised per-sample gradients (from Linear inputs and output gradients, P&M's
   default; ``torch.func`` vmap also timed) vs a per-sample loop.
4. Memory per task over ``--tasks`` tasks: bytes of the model state plus the method's checkpointed state after
   each task, for pm (running sums, constant; per-task store for contrast) and sd_lora with and without RR
   and KD. Each task trains ``--steps`` real steps (domain-incremental permuted MNIST-5k, so 20 tasks exist).

Commands (``--smoke`` is the tiny setting the tests use):

    python benchmarks/lora_cl/speed.py                       # shipped tiny ViT, CPU
    python benchmarks/lora_cl/speed.py --backbone vit-b16 --batch 64 --device cuda
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from clmerge.config import parse_config
from clmerge.engine.run import Run, prepare, resolve_device, train_task

HERE = Path(__file__).resolve().parent


def _cfg(method: dict, a, *, tasks: int, domain: bool = False) -> object:
    scen = {"dataset": "mnist5k", "n_tasks": tasks, "train_per_class": a.per_class, "test_per_class": 2}
    if domain:
        scen.update(kind="domain_incremental", transform="permutation", train_per_task=a.per_class * 10)
    model = {"name": a.backbone, "pretrained": a.backbone == "vit-tiny-fmnist"}
    if a.depth:
        model.update(pretrained=False, config={"num_hidden_layers": a.depth})
    return parse_config({"scenario": scen, "model": model, "method": method,
                         "train": {"epochs": 1, "batch_size": a.batch, "max_steps_per_epoch": a.steps},
                         "run": {"progress": False, "report": False, "device": a.device}})


def _ctx(scenario, t, device):
    from clmerge.methods.base import TaskContext

    return TaskContext(task=scenario.tasks[t], seen_tasks=scenario.tasks[: t + 1], device=device,
                       generator=torch.Generator().manual_seed(t), n_tasks=len(scenario))


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_time(method: dict, a) -> float:
    """Median seconds per training step at task ``a.old_tasks`` (earlier tasks set up without training)."""
    from clmerge.adapters import fold_component
    cfg = _cfg(method, a, tasks=a.old_tasks + 1)
    device = resolve_device(cfg.run.device)
    scenario, model, meth, _ = prepare(cfg)
    model.to(device)
    for t in range(a.old_tasks):
        meth.begin_task(scenario.tasks[t], _ctx(scenario, t, device))
        model.to(device)
        if method["name"] == "pm":
            # P&M's end_task needs a Fisher pass; skip it but leave the structure it leaves: the task's LoRA
            # folded into the base weights (it used to stay as a live component, so P&M was timed with 5
            # trainable LoRA paths per layer against seq_lora's 1)
            fold_component(model.backbone, f"task{t}")
        else:
            meth.end_task(scenario.tasks[t], _ctx(scenario, t, device))
    t = a.old_tasks
    ctx = _ctx(scenario, t, device)
    meth.begin_task(scenario.tasks[t], ctx)
    model.to(device).train()
    opt = torch.optim.Adam([p for g in meth.parameter_groups(model) for p in g["params"]], lr=1e-4)
    x, y = next(iter(scenario.tasks[t].train.batches(a.batch, shuffle=False)))
    x, y = x.to(device), y.to(device)
    times = []
    for i in range(a.warmup + a.repeats):
        _sync(device)
        t0 = time.perf_counter()
        loss = meth.loss(model, x, y, ctx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        _sync(device)
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def inference_time(a) -> tuple[float, float, float]:
    """(folded SD-LoRA forward, plain backbone forward, max |difference|) in seconds / logits."""
    from clmerge.models import build_backbone

    cfg = _cfg({"name": "sd_lora"}, a, tasks=a.old_tasks + 1)
    device = resolve_device(cfg.run.device)
    scenario, model, meth, _ = prepare(cfg)
    from clmerge.adapters import lora_layers

    g = torch.Generator().manual_seed(0)
    for t in range(a.old_tasks + 1):
        meth.begin_task(scenario.tasks[t], _ctx(scenario, t, device))
        with torch.no_grad():  # non-zero directions, as if trained, so the comparison is not trivial
            for layer in lora_layers(model.backbone).values():
                up = layer.components[f"task{t}"].lora_up
                up.copy_(0.02 * torch.randn(up.shape, generator=g))
        meth.end_task(scenario.tasks[t], _ctx(scenario, t, device))
    folded = meth.inference_model().to(device)
    m = cfg.model
    torch.manual_seed(0)
    plain = torch.nn.Sequential(build_backbone(m.name, pretrained=m.pretrained, config=m.config), model.head).to(device)
    # a training batch: the test split has only test_per_class samples per class (4 images per task here)
    x, _ = next(iter(scenario.tasks[0].train.batches(a.batch, shuffle=False)))
    x = x.to(device)
    nets = (folded.eval(), plain.eval())
    times: list[list[float]] = [[], []]
    with torch.no_grad():  # interleaved, so that load changes on a shared machine hit both alike
        for i in range(a.warmup + a.repeats):
            for j, net in enumerate(nets):
                _sync(device)
                t0 = time.perf_counter()
                net(x)
                _sync(device)
                if i >= a.warmup:
                    times[j].append(time.perf_counter() - t0)
    out = [sorted(ts)[len(ts) // 2] for ts in times]
    model.to(device).eval()
    with torch.no_grad():
        diff = float((folded(x) - model(x)).abs().max())
    return out[0], out[1], diff


def fisher_time(a) -> tuple[float, float, float, float]:
    """(hooks seconds, torch.func seconds, loop seconds, max relative difference of either to the loop) for the
    K/V Fisher of ``a.fisher_n`` samples (``diagonal_fisher`` methods ``hooks`` (P&M's default) and ``func``)."""
    from clmerge.adapters import lora_layers
    from clmerge.params.fisher import diagonal_fisher, per_sample_loop_fisher

    cfg = _cfg({"name": "pm"}, a, tasks=1)
    device = resolve_device(cfg.run.device)
    scenario, model, meth, _ = prepare(cfg)
    meth.begin_task(scenario.tasks[0], _ctx(scenario, 0, device))
    model.to(device)
    names = [f"backbone.{n}.base_layer.weight" for n in lora_layers(model.backbone)]
    named = dict(model.named_parameters())
    for n in names:  # the loop reference reads .grad of the (frozen) base weights
        named[n].requires_grad_(True)
    x, y = next(iter(scenario.tasks[0].train.batches(a.fisher_n, shuffle=False)))
    batches = [(x[i:i + 32].to(device), y[i:i + 32].to(device)) for i in range(0, len(x), 32)]
    out = []
    for fn in (lambda: diagonal_fisher(model, names, batches, method="hooks"),
               lambda: diagonal_fisher(model, names, batches, method="func"),
               lambda: per_sample_loop_fisher(model, names, batches)):
        _sync(device)
        t0 = time.perf_counter()
        f = fn()
        _sync(device)
        out.append((time.perf_counter() - t0, f))
    fl = out[-1][1]
    rel = max(float((f[n] - fl[n]).abs().max() / fl[n].abs().max().clamp_min(1e-30)) for _, f in out[:2] for n in names)
    return out[0][0], out[1][0], out[2][0], rel


def _state_bytes(model, meth) -> int:
    tensors = list(model.state_dict().values()) + list(meth.state_tensors().values())
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_per_task(method: dict, a) -> list[float]:
    """MB of model state + method state after each of ``a.tasks`` trained tasks (domain-incremental)."""
    cfg = _cfg(method, a, tasks=a.tasks, domain=True)
    device = resolve_device(cfg.run.device)
    scenario, model, meth, _ = prepare(cfg)
    model.to(device)
    out, sizes = Path(a.tmp), []
    out.mkdir(parents=True, exist_ok=True)
    run = Run(cfg, scenario, model, meth, out, device)
    for t in range(len(scenario)):
        train_task(run, t)
        sizes.append(_state_bytes(model, meth) / 2**20)
    return sizes


MEMORY = {"pm (running sums)": {"name": "pm"}, "pm (per-task store)": {"name": "pm", "alpha_store": "per_task"},
          "sd_lora": {"name": "sd_lora"}, "sd_lora_rr": {"name": "sd_lora_rr"},
          "sd_lora_kd": {"name": "sd_lora_kd"}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backbone", default="vit-tiny-fmnist")
    ap.add_argument("--depth", type=int, default=None, help="random-init backbone with this many blocks")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--old-tasks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--fisher-n", type=int, default=256)
    ap.add_argument("--tasks", type=int, default=20)
    ap.add_argument("--steps", type=int, default=5, help="training steps per task in the memory benchmark")
    ap.add_argument("--per-class", type=int, default=20)
    ap.add_argument("--tmp", default=str(HERE / "runs" / "speed"))
    ap.add_argument("--out", type=Path, default=HERE / "speed.md")
    ap.add_argument("--smoke", action="store_true", help="tiny setting for tests")
    a = ap.parse_args(argv)
    if a.smoke:  # random-init 2-block backbone: no shipped weights needed
        a.depth = a.depth or 2
        a.batch, a.old_tasks, a.repeats, a.warmup, a.fisher_n, a.tasks, a.steps, a.per_class = 8, 1, 2, 1, 8, 3, 1, 4
    write_report(a)
    print(f"wrote {a.out}", flush=True)


def write_report(a) -> None:
    torch.manual_seed(0)
    base = step_time({"name": "seq_lora"}, a)
    rows = [("seq_lora", base)] + [(m, step_time({"name": m}, a)) for m in ("sd_lora", "pm")]
    t_fold, t_plain, diff = inference_time(a)
    t_vec, t_func, t_loop, rel = fisher_time(a)
    mem = {k: memory_per_task(v, a) for k, v in MEMORY.items()}
    lines = ["# Speed and memory of the LoRA CL methods", "",
             f"Backbone `{a.backbone}`{f' ({a.depth} blocks, random init)' if a.depth else ''}, device `{a.device}`, "
             f"batch {a.batch}; command: `python benchmarks/lora_cl/speed.py` with the arguments above."
             + (" **SMOKE SETTING: numbers are meaningless.**" if a.smoke else ""), "",
             f"## Training step time (after {a.old_tasks} earlier tasks; median of {a.repeats})", "",
             "| method | s / step | ratio to seq_lora (target <= 1.15) |", "|---|---|---|"]
    lines += [f"| {m} | {t:.4f} | {t / base:.3f} |" for m, t in rows]
    lines += ["", "## Inference: SD-LoRA folded vs plain backbone", "",
              f"folded {t_fold:.4f} s, plain {t_plain:.4f} s, ratio {t_fold / t_plain:.3f}; "
              f"max |logit difference| folded vs unfolded {diff:.2e}", "",
              f"## P&M Fisher over {a.fisher_n} samples (K/V weights)", "",
              f"vectorised (Linear inputs x output gradients, P&M's default) {t_vec:.3f} s, per-sample loop "
              f"{t_loop:.3f} s, speed-up {t_loop / t_vec:.1f}x (target >= 5x); torch.func vmap {t_func:.3f} s "
              f"({t_loop / t_func:.1f}x); max relative difference to the loop {rel:.1e}", "",
              f"## Model + method state (MB) after each of {a.tasks} tasks", "",
              "| method | " + " | ".join(f"t{t + 1}" for t in range(a.tasks)) + " |",
              "|---|" + "---|" * a.tasks]
    lines += [f"| {k} | " + " | ".join(f"{v:.3f}" for v in vals) + " |" for k, vals in mem.items()]
    a.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
