"""The engine's head suite: end-of-task head statistics, the chosen head's evaluation, and shadow heads.

Every method composes the same suite (``head:`` in the config). After ``method.end_task`` the engine calls
:meth:`HeadSuite.end_task` with ``method.inference_model()`` and the current task's training data: the
backbone's features of that data update the class statistics (NCM, alignment) and RanPAC's Gram matrices,
and the aligned head is retrained. None of this feeds back into training: the aligned head is a private
copy of the model's linear head, so a run's backbone trajectory is the same whatever head it
evaluates. That is what makes ``head.compare`` (evaluate all four variants as shadows in one run) exact.
``head.align_keep`` says what the copy starts from at each task end: ``discard`` (default, the official SLCA
code) copies every block of the model's trained head afresh, so each alignment starts from the unaligned head;
``persistent`` (the official InfLoRA-CA code) keeps the aligned old blocks and aligns them again.

Variants: ``linear`` (the model's own head), ``linear+align`` (SLCA classifier alignment), ``ncm``,
``ranpac`` (see ``models.heads``).
"""

from __future__ import annotations

import copy
import time

import torch
from torch import nn

from ..config import HeadConfig
from ..data.scenarios import Task
from ..models.classifier import ContinualClassifier, IncrementalHead
from ..models.heads import ClassFeatureStats, NCMHead, RanPACHead, align_linear_head
from .evaluate import TaskAccuracy, eval_batches
from ..utils.precision import full_precision
from ..utils.progress import phase

__all__ = ["VARIANTS", "HeadSuite", "head_variant", "extract_features", "check_head_support"]

VARIANTS = ("linear", "linear+align", "ncm", "ranpac")


def head_variant(h: HeadConfig) -> str:
    """The variant name of the configured head (``linear+align`` when ``head.align`` is on)."""
    return "linear+align" if h.align else h.classifier


def check_head_support(h: HeadConfig, method_name: str, inference_model: nn.Module) -> None:
    """A clear config error when a feature-based head is asked of a method without one shared backbone."""
    if head_variant(h) == "linear" and not h.compare:
        return
    if not isinstance(inference_model, ContinualClassifier):
        what = "head.compare" if h.compare and head_variant(h) == "linear" else f"head.{_key(h)}"
        raise ValueError(f"{what}: method {method_name!r} has no single shared backbone (its inference model is "
                         f"{type(inference_model).__name__}); use head.classifier=linear, head.align=false, "
                         "head.compare=false")


def _key(h: HeadConfig) -> str:
    return "align=true" if h.align else f"classifier={h.classifier}"


def _generator(seed: int, task: int, stream: int) -> torch.Generator:
    """A private RNG per (seed, task, variant): head draws never touch the training RNGs."""
    return torch.Generator().manual_seed((seed * 1_000_003 + task * 7919 + 104_729 * (stream + 1)) % (2**63 - 1))


@full_precision
@torch.no_grad()
def extract_features(model: ContinualClassifier, data, *, batch_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Backbone features and labels of ``data`` (eval mode, in order), on the CPU."""
    was = model.training
    model.eval()
    fs, ys = [], []
    with phase(data.batches(batch_size), "head: training features",
               total=data.num_batches(batch_size) if hasattr(data, "num_batches") else None) as bar:
        for x, y in bar:
            fs.append(model.forward_features(x.to(device)).float().cpu())
            ys.append(y)
    model.train(was)
    return torch.cat(fs), torch.cat(ys)


class HeadSuite:
    """The configured head plus, with ``head.compare``, the other variants as shadows.

    Args:
        h: the ``head:`` config.
        seed: the run seed (RanPAC's projection seed and the alignment draws derive from it).
        feature_dim: the backbone's feature dimension D.
        head_bias: whether the model's head blocks have a bias (the aligned copy matches).
    """

    def __init__(self, h: HeadConfig, *, seed: int, feature_dim: int, head_bias: bool = True) -> None:
        self.cfg, self.seed = h, seed
        self.primary = head_variant(h)
        self.variants = list(VARIANTS) if h.compare else [self.primary]
        aligned = "linear+align" in self.variants
        self.needs_features = self.variants != ["linear"]
        self.stats = ClassFeatureStats(feature_dim, cov=h.align_cov if aligned else "none", rank=h.align_rank)
        self.ranpac = RanPACHead(feature_dim, h.ranpac_dim, seed) if "ranpac" in self.variants else None
        self.aligned = IncrementalHead(feature_dim, bias=head_bias) if aligned else None
        self.seconds: dict[str, list[float]] = {"features": [], "stats": [], "align": [], "ranpac": []}
        self.align_losses: list[list[float]] = []

    # -- end of task ---------------------------------------------------------------------------------------
    @full_precision
    def end_task(self, model: nn.Module, task: Task, seen: list[Task], *, batch_size: int, device) -> None:
        """Update the statistics from ``task``'s training features; refit RanPAC; realign the head copy."""
        if not self.needs_features:
            return
        clock = time.perf_counter()
        feats, labels = extract_features(model, task.train, batch_size=batch_size, device=device)
        self.seconds["features"].append(time.perf_counter() - clock)
        clock = time.perf_counter()
        self.stats.update(feats, labels)
        self.seconds["stats"].append(time.perf_counter() - clock)
        if self.ranpac is not None:
            clock = time.perf_counter()
            self.ranpac.update(feats, labels, task.offset + task.n_classes, _generator(self.seed, task.index, 0))
            self.seconds["ranpac"].append(time.perf_counter() - clock)
        if self.aligned is not None:
            clock = time.perf_counter()
            self._realign(model, task, seen)
            self.seconds["align"].append(time.perf_counter() - clock)

    def _realign(self, model: ContinualClassifier, task: Task, seen: list[Task]) -> None:
        head = model.head
        if self.cfg.align_keep == "discard":  # SLCA: align a fresh copy of the trained head, drop it at the next
            del self.aligned.blocks[:]        # task end (its fc.backup() before alignment, fc.recall() after)
        for block in list(head.blocks)[len(self.aligned.blocks):]:  # the blocks not in the copy, as trained
            self.aligned.blocks.append(copy.deepcopy(block).to(torch.device("cpu")))
        for b_new, b_model in zip(self.aligned.blocks, head.blocks):
            if b_new.out_features != b_model.out_features:
                raise RuntimeError("the model's head blocks changed shape; the aligned copy cannot follow")
        h = self.cfg
        if len(seen) == 1 and not h.align_first_task:  # the official codes align from the second task on
            self.align_losses.append([])
            return
        losses = align_linear_head(
            self.aligned, self.stats, [t.class_range for t in seen], epochs=h.align_epochs, lr=h.align_lr,
            samples_per_class=h.align_samples, weight_decay=h.align_weight_decay, logit_norm=h.align_logit_norm,
            mean_decay=h.align_mean_decay, generator=_generator(self.seed, task.index, 1))
        self.align_losses.append([round(v, 5) for v in losses])

    # -- evaluation ----------------------------------------------------------------------------------------
    def _logit_fns(self, model: ContinualClassifier, n_outputs: int, variants: list[str]) -> dict:
        fns = {}
        for v in variants:
            if v == "linear":
                fns[v] = lambda f: model.head(f)[:, :n_outputs]
            elif v == "linear+align":
                aligned = self.aligned.to(next(model.parameters()).device)
                fns[v] = lambda f, a=aligned: a(f)[:, :n_outputs]
            elif v == "ncm":
                ncm = NCMHead(self.stats, self.cfg.ncm_metric)
                fns[v] = lambda f, n=ncm: n.logits(f, n_outputs)
            else:
                fns[v] = lambda f: self.ranpac.logits(f, n_outputs)
        return fns

    @torch.no_grad()
    def evaluate(self, model: ContinualClassifier, tasks: list[Task], *, n_outputs: int, variants: list[str],
                 batch_size: int, device, split: str = "test") -> dict[str, list[TaskAccuracy]]:
        """CIL and TIL accuracy of each variant on each task (one backbone pass per batch for all variants)."""
        was = model.training
        model.eval()
        fns = self._logit_fns(model, n_outputs, variants)
        out: dict[str, list[TaskAccuracy]] = {v: [] for v in variants}
        bar = phase(desc=f"evaluation ({split})", total=eval_batches(tasks, split, batch_size))
        for task in tasks:
            data = getattr(task, split)
            if data is None or len(data) == 0:
                raise ValueError(f"task {task.index} has no {split} data")
            lo, hi = task.class_range
            hits = {v: [0, 0] for v in variants}
            for x, y in bar.track(data.batches(batch_size)):
                x, y = x.to(device), y.to(device)
                feats = model.forward_features(x)
                for v, fn in fns.items():
                    logits = fn(feats)
                    hits[v][0] += int((logits.argmax(-1) == y).sum())
                    hits[v][1] += int((logits[:, lo:hi].argmax(-1) + lo == y).sum())
            for v in variants:
                n = len(data)
                out[v].append(TaskAccuracy(acc=100.0 * hits[v][0] / n, til_acc=100.0 * hits[v][1] / n, n=n,
                                           loss=None))
        bar.close()
        model.train(was)
        return out

    # -- memory, metrics, checkpoints --------------------------------------------------------------------
    def nbytes(self) -> dict[str, int]:
        out = {"class_stats": self.stats.nbytes()}
        if self.ranpac is not None:
            out["ranpac"] = self.ranpac.nbytes()
        if self.aligned is not None:
            out["aligned_head"] = sum(p.numel() * p.element_size() for p in self.aligned.parameters())
        return out

    def metrics(self) -> dict:
        h = self.cfg
        out = {"classifier": h.classifier, "align": h.align, "variant": self.primary, "compare": h.compare,
               "ncm_metric": h.ncm_metric, "stats_bytes": self.nbytes(),
               "seconds_per_task": {k: [round(s, 4) for s in v] for k, v in self.seconds.items() if v}}
        if self.ranpac is not None:
            out["ranpac"] = {"dim": h.ranpac_dim, "seed": self.seed, "ridges": self.ranpac.ridges}
        if self.aligned is not None:
            out["align_losses"] = self.align_losses
            out["align_cov"] = h.align_cov
        return out

    def state_tensors(self) -> dict[str, torch.Tensor]:
        tensors, _ = self.stats.state()
        out = {f"stats.{k}": v for k, v in tensors.items()}
        if self.ranpac is not None:
            out.update({f"ranpac.{k}": v for k, v in self.ranpac.state()[0].items()})
        if self.aligned is not None:
            out.update({f"aligned.{k}": v.detach().clone() for k, v in self.aligned.state_dict().items()})
        return out

    def state_meta(self) -> dict:
        meta = {"stats": self.stats.state()[1], "seconds": self.seconds, "align_losses": self.align_losses}
        if self.ranpac is not None:
            meta["ranpac"] = self.ranpac.state()[1]
        if self.aligned is not None:
            meta["aligned"] = self.aligned.get_structure()
        return meta

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        def part(prefix: str) -> dict[str, torch.Tensor]:
            return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}

        self.stats.load(part("stats."), meta["stats"])
        self.seconds = {k: list(v) for k, v in meta["seconds"].items()}
        self.align_losses = [list(v) for v in meta.get("align_losses", [])]
        if self.ranpac is not None:
            self.ranpac.load(part("ranpac."), meta["ranpac"])
        if self.aligned is not None:
            self.aligned.set_structure(meta["aligned"])
            self.aligned.load_state_dict(part("aligned."), strict=True)
