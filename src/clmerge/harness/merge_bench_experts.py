"""The merging benchmark's experts: one fine-tuned backbone per task, under one of two head protocols.

- ``heads="frozen"`` (the benchmark's default): each task's head is fixed BEFORE fine-tuning, from the pretrained
  backbone's features of the task's training split, and the expert then trains only the backbone. This is the
  protocol of task arithmetic, TIES and CART (their heads are fixed zero-shot heads), which keeps every expert
  in the pretrained feature space. The head is either a linear probe (``head_init="probe"``) or the class
  prototypes as a nearest-class-mean linear layer (``head_init="prototypes"``).
- ``heads="cotrained"``: a fresh seeded head is trained together with the backbone (the protocol of the first
  tables; the pretrained backbone with such heads is at chance).

Experts are cached as safetensors next to the JSON config whose SHA-256 names them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..utils.io import load_tensors, read_json, save_tensors, write_json
from .merge_bench_config import HEAD_INITS, HEAD_PROTOCOLS, PROBE_STEPS, PROBE_WEIGHT_DECAY, BenchConfig, BenchTask

__all__ = ["BenchConfig", "HEAD_PROTOCOLS", "HEAD_INITS", "build_base", "features", "fit_probe", "prototype_head",
           "fit_head", "init_expert", "train_expert", "split_expert", "expert_digest", "expert_path",
           "load_cached_expert", "make_optimizer", "index_batches",
           "expert_for_task", "loss_and_accuracy", "make_head"]

def build_base(cfg: BenchConfig) -> nn.Module:
    """The shared starting backbone (shipped weights, or a seeded random init)."""
    from ..models import build_backbone

    torch.manual_seed(cfg.seed)
    kw = {"pretrained": cfg.pretrained} | ({"config": cfg.arch} if cfg.arch else {})
    return build_backbone(cfg.backbone, **kw)


def features(backbone: nn.Module, x: Tensor, bs: int = 256) -> Tensor:
    """``backbone(x)`` in eval mode without gradients, in batches: (N, D)."""
    backbone.eval()
    with torch.no_grad():
        return torch.cat([backbone(x[i:i + bs]) for i in range(0, len(x), bs)])


def make_head(params: dict[str, Tensor]) -> nn.Linear:
    """A linear head holding ``{"weight": (C, D), "bias": (C,)}``."""
    c, d = params["weight"].shape
    head = nn.Linear(d, c)
    head.load_state_dict(params)
    return head


def fit_probe(feats: Tensor, y: Tensor, num_classes: int, weight_decay: float = PROBE_WEIGHT_DECAY,
              steps: int = PROBE_STEPS) -> dict[str, Tensor]:
    """Linear probe: multinomial logistic regression on frozen features, deterministic (zero init, L-BFGS).

    Minimises ``mean_i CE(W f_i + b, y_i) + (weight_decay / 2) ||W||_F^2``.

    Args:
        feats: (N, D) features of the pretrained backbone.
        y: (N,) labels in ``[0, num_classes)``.
        num_classes: C.
        weight_decay: L2 coefficient on ``W`` (not on ``b``).
        steps: L-BFGS iterations.
    """
    f = feats.double()
    w = torch.zeros(num_classes, f.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(num_classes, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=steps, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(f @ w.T + b, y) + 0.5 * weight_decay * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return {"weight": w.detach().float(), "bias": b.detach().float()}


def prototype_head(feats: Tensor, y: Tensor, num_classes: int) -> dict[str, Tensor]:
    """Class prototypes as a linear layer: nearest class mean in Euclidean distance.

    ``argmin_c ||f - mu_c||^2 = argmax_c (mu_c . f - ||mu_c||^2 / 2)``, so ``W = [mu_c]`` and
    ``b_c = -||mu_c||^2 / 2`` with ``mu_c`` the mean feature of class ``c``.
    """
    mu = torch.stack([feats[y == c].double().mean(0) for c in range(num_classes)])
    return {"weight": mu.float(), "bias": (-0.5 * (mu * mu).sum(-1)).float()}


def fit_head(cfg: BenchConfig, backbone: nn.Module, x: Tensor, y: Tensor, num_classes: int) -> dict[str, Tensor]:
    """The frozen head of a task: ``cfg.head_init`` fitted on ``backbone``'s (pretrained) features of ``x``."""
    feats = features(backbone, x)
    if cfg.head_init == "probe":
        return fit_probe(feats, y, num_classes)
    return prototype_head(feats, y, num_classes)


def init_expert(cfg: BenchConfig, num_classes: int, data: dict | None = None) -> tuple[nn.Module, nn.Module]:
    """The starting point of an expert: the shared base backbone and its head.

    Co-trained: a seeded fresh head. Frozen: the head fitted on the base backbone's features of
    ``data["train"]`` (required then).
    """
    backbone = build_base(cfg)
    if cfg.heads == "frozen":
        if data is None:
            raise ValueError("the frozen-head protocol needs the task's training data to fit the head")
        return backbone, make_head(fit_head(cfg, backbone, *data["train"], num_classes))
    if cfg.train_seed is not None:
        torch.manual_seed(cfg.train_seed)
    return backbone, nn.Linear(backbone.feature_dim, num_classes)


def make_optimizer(cfg: BenchConfig, params: list) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r} (expected sgd, adam or adamw)")


def index_batches(n: int, cfg: BenchConfig, g: torch.Generator):
    """Index batches: ``epochs`` passes, or exactly ``steps`` batches over repeated seeded permutations."""
    if cfg.steps is None:
        for _ in range(cfg.epochs):
            yield from torch.randperm(n, generator=g).split(cfg.batch_size)
        return
    done = 0
    while done < cfg.steps:
        for idx in torch.randperm(n, generator=g).split(cfg.batch_size):
            if done == cfg.steps:
                return
            yield idx
            done += 1


def train_expert(cfg: BenchConfig, data: dict) -> dict[str, Tensor]:
    """Fine-tune one expert from :func:`init_expert` on ``data["train"]``; keys ``backbone.*`` and ``head.*``.

    With frozen heads only the backbone is optimised (the head gets no gradient and is saved unchanged).
    """
    x, y = data["train"]
    backbone, head = init_expert(cfg, int(y.max()) + 1, data)
    frozen = cfg.heads == "frozen"
    head.requires_grad_(not frozen)
    opt = make_optimizer(cfg, list(backbone.parameters()) + ([] if frozen else list(head.parameters())))
    g = torch.Generator().manual_seed(cfg.fine_tune_seed)
    backbone.train()
    for idx in index_batches(len(x), cfg, g):
        loss = F.cross_entropy(head(backbone(x[idx])), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {f"backbone.{k}": v for k, v in backbone.state_dict().items()} | \
           {f"head.{k}": v for k, v in head.state_dict().items()}


def split_expert(sd: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``(backbone params, head params)`` of a saved expert dict."""
    split = lambda p: {k[len(p):]: v for k, v in sd.items() if k.startswith(p)}  # noqa: E731
    return split("backbone."), split("head.")


def expert_digest(task: BenchTask, cfg: BenchConfig) -> str:
    """SHA-256 of the JSON of everything that makes the expert of ``task`` (its cache identity)."""
    return hashlib.sha256(json.dumps(cfg.expert_key(task), sort_keys=True).encode()).hexdigest()


def expert_path(cache: Path, task: BenchTask, cfg: BenchConfig) -> Path:
    """Where the expert of ``task`` under ``cfg`` is cached (safetensors; its config JSON sits beside it)."""
    return cache / f"{task.name}-{expert_digest(task, cfg)[:16]}.safetensors"


def expert_for_task(task: BenchTask, cfg: BenchConfig, data: dict,
                    cache: Path) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``(backbone params, head params)`` of the expert for ``task``: from the cache, or fine-tuned now."""
    path = expert_path(cache, task, cfg)
    if path.exists():
        sd = load_cached_expert(path)
    else:
        digest = expert_digest(task, cfg)
        sd = train_expert(cfg, data)
        file_sha = save_tensors(path, sd, metadata={"sha256_of_config": digest})
        write_json(path.with_suffix(".json"), {"sha256": digest, "config": cfg.expert_key(task),
                                               "file_sha256": file_sha})
    return split_expert(sd)


def cached_file_sha256(path: Path) -> str | None:
    """The sha256 of the cached expert's bytes recorded in the JSON beside it (None: cached before hashes
    were recorded, or no JSON)."""
    meta = path.with_suffix(".json")
    try:
        return read_json(meta, within=meta.parent).get("file_sha256") if meta.is_file() else None
    except (ValueError, AttributeError):  # not JSON (an InputError is a ValueError), or not an object
        return None


def load_cached_expert(path: Path) -> dict[str, Tensor]:
    """A cached expert, verified against its recorded sha256 (a corrupt cache file is refused, naming it)."""
    from ..engine.checkpoint import verify_sha256

    verify_sha256(path, cached_file_sha256(path), what="cached expert",
                  hint="delete it and its .json to retrain")
    return load_tensors(path)


def loss_and_accuracy(backbone: nn.Module, head: nn.Module, x: Tensor, y: Tensor,
                      bs: int = 256) -> tuple[float, float]:
    """``(summed cross-entropy, number correct)`` of ``head(backbone(x))`` against ``y`` (sums, for pooling)."""
    backbone.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), bs):
            logits = head(backbone(x[i:i + bs]))
            loss += float(F.cross_entropy(logits.double(), y[i:i + bs], reduction="sum"))
            correct += int((logits.argmax(-1) == y[i:i + bs]).sum())
    return loss, correct
