"""The CLIP merging benchmark of the papers: ``merge-bench --suite clip-ta8 | clip-tall14 | clip-tall20``.

No fine-tuning: a CLIP model (``--clip``: a folder or hub id) gives the pretrained vision tower and, through its
text tower, one zero-shot head per dataset (the class names and templates of
:mod:`clmerge.data.clip_classnames`; each class's embedding is the mean of its normalised template embeddings,
normalised again, as in CLIP's zero-shot protocol). The experts are given: fine-tuned vision towers named by a
pattern (default FusionBench's public checkpoints, ``tanganke/clip-vit-base-patch32_{dataset}``). Every method
merges the vision towers with fixed hyperparameters (:data:`CLIP_HPARAMS`, the papers' ViT-B/32 values; no
validation search) and is scored on each dataset's test split (:mod:`clmerge.data.clip_tasks`).

Rows: ``zero-shot`` (the pretrained CLIP), ``individual`` (each expert on its own dataset) and one per method.
Normalized accuracy is the mean over datasets of merged / individual (%), as in the TALL-masks and Iso papers.
``OUT/<suite>/results.{json,md}`` hold one suite; ``OUT/table1.md`` holds every suite found under ``OUT`` in
the layout of Table 1 of Marczak et al. 2025 (methods x {8, 14, 20 tasks}, absolute and normalized).
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..data.clip_tasks import CLIP_SUITES, class_prompts, clip_test_files, load_clip_images
from ..errors import InputError, UsageError
from ..merging.methods.hparams import coerce_value, method_hparams
from ..merging.methods.registry import get_method, merge
from ..utils.extras import offline
from ..utils.io import atomic_write_text, load_tensors, read_json, save_tensors, write_json

__all__ = ["CLIP_HPARAMS", "CLIP_HPARAM_SOURCES", "DEFAULT_EXPERTS", "run_clip_bench", "zero_shot_heads",
           "clip_results_markdown", "table1_markdown", "expert_source"]

DEFAULT_EXPERTS = "tanganke/clip-vit-base-patch32_{dataset}"
# The papers' standard ViT-B/32 hyperparameters (fixed, not searched here).
CLIP_HPARAMS: dict[str, dict[str, Any]] = {
    "weight_average": {},
    "task_arithmetic": {"scaling": 0.3},
    "ties": {"density": 0.2, "scaling": 0.3, "merge_fn": "sum", "trim_rule": "threshold"},
    "cart": {"rank_ratio": 0.08, "scaling": 1.0},
    "tsv_m": {"scaling": 1.0},
    "iso_c": {"scaling": 1.0},
    "iso_cts": {"scaling": 1.0, "common_space_fraction": 0.8},
}
CLIP_HPARAM_SOURCES = {
    "task_arithmetic": "Ilharco et al. 2023's ViT-B/32 choice; FusionBench config/method/task_arithmetic.yaml",
    "ties": "FusionBench config/method/ties_merging.yaml (top 20%, sum of agreeing entries, scaling 0.3)",
    "cart": "CART's default rank (8% of each matrix's rank) at scaling 1.0 (clmerge's cart defaults)",
    "tsv_m": "alpha = 1.0: Gargiulo et al. 2025 and FusionBench TaskSingularVectorMerging.yaml",
    "iso_c": "alpha = 1.0: FusionBench isotropic_merging/iso_c.yaml (the paper selects alpha on validation)",
    "iso_cts": "alpha = 1.0, common_space_fraction 0.8: FusionBench isotropic_merging/iso_cts.yaml",
}
ROWS = {"zero-shot": "zero-shot (pretrained CLIP)", "individual": "individual experts"}
SUITE_TASKS = {"clip-ta8": 8, "clip-tall14": 14, "clip-tall20": 20}


def expert_source(pattern: str, dataset: str) -> str:
    """The folder or hub id of ``dataset``'s expert under ``pattern`` (``{dataset}`` filled in)."""
    if "{dataset}" not in pattern:
        raise UsageError(f"--experts {pattern!r}: the pattern must hold {{dataset}}, e.g. {DEFAULT_EXPERTS}")
    return pattern.format(dataset=dataset)


@contextmanager
def _quiet_loading():
    """transformers' loading bars and load reports off (they would bury the one-line errors), then restored."""
    from transformers.utils import logging as hf_logging

    bars, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _from_pretrained(cls, source: str, what: str):
    local = Path(source).expanduser()
    try:
        with _quiet_loading():
            return cls.from_pretrained(str(local) if local.is_dir() else source,
                                       local_files_only=offline() or local.is_dir())
    except (OSError, ValueError) as exc:
        where = f"folder {local}" if local.is_dir() else f"hub id {source!r} (no folder {local})"
        raise InputError(f"{what}: cannot load {cls.__name__} from {where}; expected a save_pretrained folder or "
                         f"a hub id{' in the local cache (HF_HUB_OFFLINE=1)' if offline() else ''}") from exc


def load_clip(source: str):
    """The CLIP model (eval mode) and its tokenizer from a folder or hub id."""
    from transformers import AutoTokenizer, CLIPModel

    model = _from_pretrained(CLIPModel, source, f"--clip {source}").eval()
    tok = _from_pretrained(AutoTokenizer, source, f"--clip {source} (tokenizer)")
    return model, tok


def load_expert(pattern: str, dataset: str, like: dict[str, Tensor]) -> dict[str, Tensor]:
    """``dataset``'s fine-tuned vision tower as a state dict with the keys and shapes of the pretrained ``like``."""
    from transformers import CLIPVisionModel

    src = expert_source(pattern, dataset)
    sd = _from_pretrained(CLIPVisionModel, src, f"expert for {dataset}").state_dict()
    sd = {k.removeprefix("vision_model."): v for k, v in sd.items()}  # the prefix depends on the HF version
    bad = sorted(set(sd) ^ set(like)) or [k for k in sd if sd[k].shape != like[k].shape]
    if bad:
        raise InputError(f"expert for {dataset} ({src}): its vision tower differs from --clip's ({len(bad)} "
                         f"parameters differ in name or shape, e.g. {bad[0]}); expected the same architecture")
    return sd


def _projected(out) -> Tensor:
    """The projected embeddings: transformers 4 returns them, 5 an output whose pooler_output holds them."""
    return out if isinstance(out, Tensor) else out.pooler_output


@torch.no_grad()
def _text_head(model, tok, dataset: str, device: str) -> Tensor:
    rows = []
    for prompts in class_prompts(dataset):
        enc = tok(prompts, padding=True, truncation=True, return_tensors="pt").to(device)
        emb = _projected(model.get_text_features(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]))
        emb = emb / emb.norm(dim=-1, keepdim=True)
        mean = emb.mean(0)
        rows.append(mean / mean.norm())
    return torch.stack(rows).cpu()


def zero_shot_heads(model, tok, datasets: list[str], cache: Path, clip: str, device: str = "cpu") -> dict[str, Tensor]:
    """One (classes, dim) zero-shot head per dataset, cached in ``cache`` under a digest of the CLIP source,
    its text weights and the prompts (computed once)."""
    text = {k: v for k, v in model.state_dict().items() if k.startswith(("text_model.", "text_projection"))}
    wdig = hashlib.sha256(b"".join(v.float().cpu().numpy().tobytes()[:4096] for v in text.values())).hexdigest()
    heads = {}
    for d in datasets:
        key = hashlib.sha256(json.dumps([clip, wdig, class_prompts(d)]).encode()).hexdigest()[:16]
        path = cache / f"{d}-{key}.safetensors"
        if path.is_file():
            heads[d] = load_tensors(path)["head"]
            continue
        heads[d] = _text_head(model, tok, d, device)
        save_tensors(path, {"head": heads[d]})
    return heads


@torch.no_grad()
def _correct(model, params: dict[str, Tensor], head: Tensor, x: Tensor, y: Tensor) -> int:
    model.vision_model.load_state_dict(params)
    feats = _projected(model.get_image_features(pixel_values=x))
    feats = feats / feats.norm(dim=-1, keepdim=True)
    return int(((feats @ head.T).argmax(-1).cpu() == y).sum())


def _evaluate(model, rows: dict[str, Any], heads: dict[str, Tensor], files: dict[str, list], device: str,
              bs: int) -> dict[str, list[float]]:
    """Test accuracy (%) of every row on every dataset. A row's parameters are one dict, or a list with one
    dict per dataset (the individual experts). Each batch of images is decoded once and scored by every row,
    so no dataset is ever held in memory whole."""
    size = model.config.vision_config.image_size
    acc: dict[str, list[float]] = {r: [] for r in rows}
    for t, (d, pairs) in enumerate(files.items()):
        correct = dict.fromkeys(rows, 0)
        head = heads[d].to(device)
        for i in range(0, len(pairs), bs):
            x, y = load_clip_images(pairs[i:i + bs], size)
            for r, params in rows.items():
                correct[r] += _correct(model, params[t] if isinstance(params, list) else params, head, x.to(device), y)
        for r in rows:
            acc[r].append(100.0 * correct[r] / len(pairs))
    return acc


def _load_experts(pattern: str, names: list[str], like: dict[str, Tensor], log) -> list[dict[str, Tensor]]:
    out = []
    for d in names:
        log(f"expert {d}: {expert_source(pattern, d)}")
        out.append(load_expert(pattern, d, like))
    return out


def _check_inputs(datasets: list[str], data_root: Path, max_eval: int | None) -> dict[str, list]:
    """Every dataset's test files, before any model is loaded; one error names the first missing dataset's
    expected folder and every other missing dataset."""
    files, missing = {}, []
    for d in datasets:
        try:
            files[d] = clip_test_files(data_root, d, max_eval)
        except (FileNotFoundError, ValueError) as exc:
            missing.append((d, exc))
    if missing:
        more = f" (also missing or malformed: {', '.join(d for d, _ in missing[1:])})" if len(missing) > 1 else ""
        raise InputError(f"{missing[0][1]}{more}") from missing[0][1]
    return files


def _suite_datasets(suite: str, datasets: list[str] | None) -> list[str]:
    if suite not in CLIP_SUITES:
        raise UsageError(f"--suite {suite!r}: expected one of {', '.join(CLIP_SUITES)}")
    full = list(CLIP_SUITES[suite])
    if not datasets:
        return full
    bad = [d for d in datasets if d not in full]
    if bad:
        raise UsageError(f"--datasets {','.join(bad)}: not in {suite} (its datasets: {', '.join(full)})")
    return [d for d in full if d in datasets]


def _methods(methods: list[str] | None, overrides: dict[str, dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    names = methods or list(CLIP_HPARAMS)
    for m in names:
        get_method(m)  # an unknown name fails here, before any loading
    out = {m: dict(CLIP_HPARAMS.get(m, {})) for m in names}
    for m, hp in (overrides or {}).items():
        if m not in out:
            raise UsageError(f"--hp {m}.*: {m} is not among the methods run ({', '.join(out)})")
        known = method_hparams(get_method(m))
        for k, v in hp.items():
            if k not in known:
                raise UsageError(f"--hp {m}.{k}: {m} has no hyperparameter {k} (it has: {', '.join(known)})")
            out[m][k] = coerce_value(m, known[k], v, f"--hp {m}.{k}")
    return out


def run_clip_bench(out: Path, *, suite: str, clip: str, data_root: Path, experts: str = DEFAULT_EXPERTS,
                   datasets: list[str] | None = None, methods: list[str] | None = None,
                   hparams: dict[str, dict[str, Any]] | None = None, max_eval: int | None = None,
                   batch_size: int = 256, device: str = "cpu", log=print) -> dict:
    """Merge the given experts with every method and report test accuracy (module docstring).

    Writes ``out/<suite>/results.json`` and ``results.md``, the cached heads in ``out/heads`` and
    ``out/table1.md``; returns the results dict. Inputs are checked before anything is written.
    """
    names = _suite_datasets(suite, datasets)
    grids = _methods(methods, hparams)
    files = _check_inputs(names, Path(data_root), max_eval)
    for d in names:
        expert_source(experts, d)
    model, tok = load_clip(clip)
    model.to(device)
    base = {k: v.detach().cpu().clone() for k, v in model.vision_model.state_dict().items()}
    exp = _load_experts(experts, names, base, log)
    heads = zero_shot_heads(model, tok, names, Path(out) / "heads", clip, device)
    params: dict[str, Any] = {"zero-shot": base, "individual": exp}
    for m, hp in grids.items():
        log(f"merge {m} {hp}")
        params[m] = {k: v.to(torch.float32) for k, v in merge(m, base=base, experts=exp, **hp).items()}
    log(f"evaluating {len(params)} rows on {len(names)} test splits")
    acc = _evaluate(model, params, heads, files, device, batch_size)
    rows = {r: {"hp": grids.get(r, {}), "test": acc[r]} for r in params}
    _summarise(rows)
    results = {"suite": suite, "clip": clip, "experts": experts, "datasets": names, "max_eval": max_eval,
               "complete": names == list(CLIP_SUITES[suite]), "rows": rows,
               "sizes": {d: len(files[d]) for d in names}}
    write_json(Path(out) / suite / "results.json", results)
    atomic_write_text(Path(out) / suite / "results.md", clip_results_markdown(results))
    atomic_write_text(Path(out) / "table1.md", table1_markdown(Path(out)))
    return results


def _summarise(rows: dict[str, dict[str, Any]]) -> None:
    """Each row's mean absolute accuracy and its normalized accuracy: mean over datasets of acc / individual."""
    ind = rows["individual"]["test"]
    for r in rows.values():
        r["avg"] = sum(r["test"]) / len(r["test"])
        r["normalized"] = 100.0 * sum(a / max(i, 1e-9) for a, i in zip(r["test"], ind)) / len(ind)


def clip_results_markdown(results: dict) -> str:
    """The per-dataset table of one suite: absolute test accuracy per dataset, average, normalized."""
    names = results["datasets"]
    note = "" if results["complete"] else f" (subset of {results['suite']}: {len(names)} datasets)"
    lines = [f"{results['suite']}{note}: CLIP `{results['clip']}`, experts `{results['experts']}`, test split"
             + (f" (at most {results['max_eval']} images per dataset)" if results["max_eval"] else "") + ".", "",
             "| method | " + " | ".join(names) + " | avg (abs.) | normalized | hyperparameters |",
             "|" + "---|" * (len(names) + 4)]
    for name, r in results["rows"].items():
        cells = " | ".join(f"{a:.1f}" for a in r["test"])
        lines.append(f"| {ROWS.get(name, name)} | {cells} | {r['avg']:.1f} | {r['normalized']:.1f} | "
                     f"{r['hp'] or ''} |")
    return "\n".join(lines) + "\n"


def table1_markdown(root: Path) -> str:
    """Table 1 of the Iso paper from every ``root/<suite>/results.json``: one row per method, absolute and
    normalized accuracy for 8, 14 and 20 tasks (``—`` where that suite was not run; ``*`` marks a dataset
    subset or a capped test split)."""
    found = {s: read_json(root / s / "results.json") for s in SUITE_TASKS if (root / s / "results.json").is_file()}
    order = list(dict.fromkeys(m for r in found.values() for m in r["rows"]))
    head = " | ".join(f"{n} tasks abs. | {n} tasks norm." for n in SUITE_TASKS.values())
    lines = ["| method | " + head + " |", "|" + "---|" * 7]
    for m in order:
        cells = []
        for s in SUITE_TASKS:
            r = found.get(s)
            mark = "" if r is None or (r["complete"] and not r["max_eval"]) else "*"
            row = None if r is None else r["rows"].get(m)
            cells += ["—", "—"] if row is None else [f"{row['avg']:.1f}{mark}", f"{row['normalized']:.1f}{mark}"]
        lines.append(f"| {ROWS.get(m, m)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n`*`: a subset of the suite's datasets or a capped test split (`--max-eval`).\n"
