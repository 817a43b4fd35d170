"""Export a continual run directory as an HF model folder or a PEFT LoRA adapter.

The plugins the run recorded are imported first (:func:`clmerge.utils.provenance.open_run_plugins`, checked
against their recorded sha256). The model is rebuilt from the run's last checkpoint as a resumed run does
(``engine.run.load_into``: the config's classifier, :func:`rebuild_structure`, a strict ``load_state_dict``),
and every LoRA component is folded into its base weight (``W = W_0 + sum_k c_k U_k D_k``,
:func:`clmerge.adapters.folded.folded_copy`).

- ``hf``: the folded backbone (an HF ``ViTModel``/``CLIPVisionModel``) with ``save_pretrained``, the
  classifier head as ``head.safetensors`` (``weight`` ``(C, D)``, ``bias`` ``(C,)``: the per-task blocks
  concatenated) and ``classes.json`` (class order, tasks, preprocessing, how features are taken). A text
  backbone's export records its tokenizer (name, SHA-256 of its definition), maximum length and pooling in
  place of the image preprocessing, and holds the tokenizer's files beside the model;
- ``peft``: ``Delta W = W_folded - W_pretrained`` of every adapted Linear as a PEFT adapter over the backbone's
  module names (exact at the default rank, the largest numerical rank of the updates; truncated SVD at
  ``rank``), so ``PeftModel.from_pretrained(base, out)``
  reproduces the folded backbone; ``--base-out`` also writes the pretrained backbone as an HF folder.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from ..errors import RunStateError, UsageError
from ..merging.io.base import MergeInputError
from ..merging.io.lora_svd import (check_out_dir, check_svd, error_summary, low_rank_factors, numerical_rank,
                                   rank_pattern)
from ..merging.io.output import build_folder
from ..models.classifier import ContinualClassifier
from ..merging.io.peft import adapter_config, write_adapter
from ..utils.inpaths import inside
from ..utils.provenance import open_run_plugins
from ..utils.io import read_json, save_tensors

__all__ = ["export_run", "load_run_model", "FORMATS"]

FORMATS = ("hf", "peft")
REPORT_FILE = "export_report.json"


def load_run_model(run_dir: Path) -> tuple[nn.Module, nn.Module, dict, dict]:
    """``(folded model, pretrained backbone, manifest, checkpoint meta)`` of the run's last checkpoint."""
    from ..adapters.folded import folded_copy
    from ..config import ConfigError, load_config
    from .checkpoint import checkpoint_contents, load_checkpoint, resume_checkpoint
    from .run import build_classifier, load_into
    from ..methods import build_method

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise MergeInputError(f"{run_dir}: not a run directory (no config.yaml)")
    for name in ("config.yaml", "manifest.json", "checkpoints"):  # nothing read from outside the run
        inside(run_dir, name, f"{run_dir}: run file")
    plugins = open_run_plugins(run_dir)  # the run's own plugins (checked, then imported) before its config
    ck, sha = resume_checkpoint(run_dir)  # the newest recorded checkpoint and its sha256
    if ck is None:
        raise MergeInputError(f"{run_dir}: no checkpoint (checkpoints/task_NNN.safetensors); finish a task first")
    inside(run_dir, ck.relative_to(run_dir), f"{run_dir}: checkpoint")
    try:
        cfg = load_config(run_dir / "config.yaml")
        model = build_classifier(cfg)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        hint = "" if plugins else ("; a run made with --plugin before runs recorded their plugins needs the same "
                                   "--plugin FILE here")
        raise MergeInputError(f"{run_dir / 'config.yaml'}: cannot rebuild the model ({exc}){hint}") from exc
    pretrained = copy.deepcopy(model.backbone).eval()
    state, method_tensors, meta = load_checkpoint(ck, sha256=sha)
    _check_finished(run_dir, meta["task"], cfg.scenario.n_tasks)
    with checkpoint_contents(ck):  # a hand-made or foreign checkpoint: one line naming it
        others = sorted({c for c in meta["structure"].get("wrapped", {}).values() if c != "LoRALinear"})
        if others:
            raise MergeInputError(f"{run_dir}: method {cfg.method.name!r} keeps per-task modules "
                                  f"({', '.join(others)}); a single exported model cannot route tasks")
        # the method's own state too: its inference model is what the run evaluated (MagMax: theta_0 + lambda *
        # tau_MagMax, not the last task's fine-tuned weights the live model holds)
        method = build_method(cfg.method.name, cfg.method_options(), seed=cfg.seed)
        method.setup(model)
        load_into(model, method, None, meta, state, method_tensors, {}, torch.device("cpu"))
    model = method.inference_model()
    if not isinstance(model, ContinualClassifier):  # e.g. MOS: per-task adapters picked per image, an ensemble
        raise MergeInputError(f"{run_dir}: method {cfg.method.name!r} predicts with {type(model).__name__}, not "
                              "one backbone and head; a single exported model cannot reproduce its predictions")
    manifest = read_json(run_dir / "manifest.json") if (run_dir / "manifest.json").exists() else {}
    manifest["method"] = cfg.method.name
    manifest["scenario_options"] = dict(cfg.scenario.options or {})
    return folded_copy(model), pretrained, manifest, meta


def _check_finished(run_dir: Path, last: int, n_tasks: int) -> None:
    """Refuse a run whose last checkpoint is not its last task: its head would lack the later tasks' classes
    while ``classes.json`` lists every task."""
    if last + 1 >= n_tasks:
        return
    tasks = _read_tasks(run_dir)
    missing = tasks[last + 1]["name"] if last + 1 < len(tasks) and isinstance(tasks[last + 1], dict) else None
    name = f" ({missing})" if isinstance(missing, str) else ""
    raise RunStateError(f"{run_dir}: unfinished run: its last checkpoint is task {last} of 0..{n_tasks - 1}, so "
                        f"task {last + 1}{name} is missing; finish it with clmerge run --resume, then export")


def _read_tasks(run_dir: Path) -> list:
    try:
        tasks = read_json(run_dir / "manifest.json").get("tasks")
    except (OSError, ValueError, AttributeError):
        return []
    return tasks if isinstance(tasks, list) else []


def _hf_inner(backbone: nn.Module, run_dir: Path) -> nn.Module:
    inner = getattr(backbone, "inner", None)
    if inner is None or not hasattr(inner, "save_pretrained"):
        raise MergeInputError(f"{run_dir}: the backbone is not an HF model ({type(inner or backbone).__name__}); "
                              "only HF backbones (vit-*, hf-*, clip) export")
    return inner


def _is_text(backbone: nn.Module) -> bool:
    return getattr(backbone, "info", {}).get("kind") == "text"


def _text_preprocess(backbone: nn.Module, manifest: dict, options: dict) -> tuple[str, dict]:
    """``(features note, preprocess)`` of a text backbone: the run's tokenizer, maximum length and pooling."""
    data = manifest.get("data") or {}
    pooling = backbone.pooling
    features = ("attention-mask-weighted mean of last_hidden_state over the tokens (sentence-transformers' mean "
                "pooling)" if pooling == "mean" else "last_hidden_state[:, 0] (the [CLS] token)")
    preprocess = {"kind": "text", "tokenizer": data.get("tokenizer", options.get("tokenizer", "minilm-l6")),
                  "tokenizer_sha256": data.get("tokenizer_sha256"),
                  "max_length": data.get("max_length", options.get("max_length", 64)), "pooling": pooling,
                  "padding": "right", "truncation": True,
                  "inputs": "input_ids and attention_mask (the tokenizer files in this folder)"}
    return features, preprocess


def _head_and_classes(model: nn.Module, manifest: dict, backbone: nn.Module,
                      options: dict | None = None) -> tuple[dict, dict]:
    blocks = list(model.head.blocks)
    head = {"weight": torch.cat([b.weight.detach() for b in blocks], dim=0)}
    if blocks and blocks[0].bias is not None:
        head["bias"] = torch.cat([b.bias.detach() for b in blocks], dim=0)
    if _is_text(backbone):
        features, preprocess = _text_preprocess(backbone, manifest, options or {})
    else:
        features = "last_hidden_state[:, 0] (ViT CLS token after the final LayerNorm); CLIP: pooler_output"
        preprocess = {"image_size": backbone.image_size, "num_channels": backbone.num_channels,
                      "mean": backbone.mean.flatten().tolist(), "std": backbone.std.flatten().tolist()}
    classes = {
        "method": manifest.get("method"), "kind": manifest.get("kind"), "dataset": manifest.get("dataset"),
        "class_order": manifest.get("class_order"), "tasks": manifest.get("tasks"),
        "head_blocks": [b.out_features for b in blocks], "features": features, "preprocess": preprocess,
    }
    return head, classes


def _save_tokenizer(tmp: Path, preprocess: dict, run_dir: Path) -> None:
    """The run's tokenizer saved beside the model, checked against the digest the run recorded."""
    from ..data.text_tokens import load_tokenizer, tokenizer_digest

    tok = load_tokenizer(str(preprocess["tokenizer"]))
    want = preprocess.get("tokenizer_sha256")
    if want and tokenizer_digest(tok) != want:
        raise MergeInputError(f"{run_dir}: tokenizer {preprocess['tokenizer']!r} is no longer the one the run used "
                              "(its SHA-256 differs from the manifest's data.tokenizer_sha256)")
    tok.save_pretrained(tmp)


def _adapted_deltas(folded: nn.Module, pretrained: nn.Module, adapted: list[str], run_dir: Path) -> dict:
    """``{module name: Delta W}`` for the adapted Linears; any other change is an error (not a LoRA)."""
    after, before = folded.state_dict(), pretrained.state_dict()
    deltas = {}
    for key, w0 in before.items():
        mod = key[: -len(".weight")] if key.endswith(".weight") else None
        if mod in adapted:
            deltas[mod] = after[key].to(torch.float64) - w0.to(torch.float64)
        elif not torch.equal(after[key], w0):
            raise MergeInputError(f"{run_dir}: backbone parameter {key!r} changed and is not a LoRA-adapted "
                                  "Linear weight; export --format hf instead (or extract-lora from it)")
    return deltas


def _write_peft(tmp: Path, deltas: dict, rank: int | None, base_ref: str | None, svd: str) -> dict:
    r = rank or max(1, max(numerical_rank(d) for d in deltas.values()))
    factors, errors = {}, {}
    for mod, d in deltas.items():
        low = low_rank_factors(d, r, svd)
        factors[mod], errors[mod] = (low.a, low.b), low
    pattern = rank_pattern(factors, r)  # modules smaller than r: written at min(out, in), exact
    write_adapter(tmp, factors, adapter_config(r=r, alpha=r, targets=list(factors), base_model=base_ref,
                                               rank_pattern=pattern, alpha_pattern=pattern))
    return {"rank": r, **error_summary(errors)}


def export_run(run_dir: str | Path, *, format: str, out: str | Path, rank: int | None = None,
               base_out: str | Path | None = None, svd: str = "auto", overwrite: bool = False) -> dict:
    """Export the run in ``run_dir`` (see the module docstring).

    Args:
        run_dir: a continual run directory (``config.yaml``, ``checkpoints/``).
        format: ``"hf"`` or ``"peft"``.
        out: the new folder (written atomically; must not exist or be empty).
        rank: ``peft`` only: the adapter rank (default: the largest numerical rank of the updates, exact).
        base_out: ``peft`` only: also write the pretrained backbone here as an HF folder.
        svd: ``"auto"``, ``"full"`` or ``"randomized"`` (:func:`.lora_svd.low_rank_factors`).
        overwrite: replace an existing non-empty ``out`` / ``base_out`` (``--overwrite``).

    Returns:
        A report dict (``export_report.json`` in ``out``): format, method, modules, rank and errors.
    """
    run_dir = Path(run_dir)
    if format not in FORMATS:
        raise UsageError(f"--format {format!r}: expected one of {', '.join(FORMATS)}")
    if rank is not None and (format != "peft" or rank < 1):
        raise UsageError("--rank: only with --format peft, and >= 1")
    check_svd(svd)
    check_out_dir(Path(out), [run_dir], overwrite)
    if base_out is not None:
        check_out_dir(Path(base_out), [run_dir, Path(out)], overwrite)
    from ..adapters.lora import LoRALinear

    # which Linears carry LoRA: read before folding removes the wrappers
    folded, pretrained, manifest, meta = load_run_model(run_dir)
    inner, inner0 = _hf_inner(folded.backbone, run_dir), _hf_inner(pretrained, run_dir)
    prefix = "backbone.inner."
    adapted = sorted(n[len(prefix):] for n, c in meta["structure"].get("wrapped", {}).items()
                     if c == LoRALinear.__name__ and n.startswith(prefix))
    report = {"out": str(out), "format": format, "run": str(run_dir), "method": manifest.get("method"),
              "task": meta["task"], "adapted_modules": adapted}
    if format == "hf":
        head, classes = _head_and_classes(folded, manifest, folded.backbone, manifest.get("scenario_options"))

        def fill(tmp: Path) -> dict:
            inner.save_pretrained(tmp)
            if _is_text(folded.backbone):
                _save_tokenizer(tmp, classes["preprocess"], run_dir)
            save_tensors(tmp / "head.safetensors", head)
            (tmp / "classes.json").write_text(json.dumps(classes, indent=2) + "\n")
            return report

        return build_folder(Path(out), fill, REPORT_FILE)
    if not adapted:
        raise MergeInputError(f"{run_dir}: method {manifest.get('method')!r} has no LoRA layers; export "
                              "--format hf (then clmerge extract-lora against the pretrained backbone)")
    deltas = _adapted_deltas(inner, inner0, adapted, run_dir)
    if base_out is not None:
        build_folder(Path(base_out), lambda tmp: inner0.save_pretrained(tmp) or {})
    info = pretrained.info
    base_ref = str(base_out) if base_out is not None else info.get("source") or info.get("weights")
    return build_folder(Path(out), lambda tmp: report | _write_peft(tmp, deltas, rank, base_ref, svd), REPORT_FILE)
