"""``clmerge pretrain --preset vit-tiny-fmnist``: train the shipped small ViT on the full Fashion-MNIST.

Supervised training from a fixed seed on the 60k training images (random 2-pixel shifts and horizontal flips),
AdamW with linear warm-up and cosine decay. The backbone's weights are written as safetensors together with
its config and a provenance file (data files and their sha256, seed, epochs, test accuracy, weights sha256).
"""

from __future__ import annotations

import math
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .data.idx import find_idx_files, read_idx
from .models.classifier import ContinualClassifier, IncrementalHead
from .models.presets import VIT_TINY_FMNIST, vit_tiny_fmnist
from .registry import Registry
from .utils.io import save_tensors, sha256_file, write_json
from .utils.progress import Progress

__all__ = ["pretrain_vit_tiny_fmnist", "PRESETS"]

FMNIST_STEMS = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
FMNIST_HINT = "Install it with `apt-get install dataset-fashion-mnist` or point data_root / $CLMERGE_DATA at the IDX files."


def _augment(x: torch.Tensor, gen: torch.Generator, shift: int = 2) -> torch.Tensor:
    """Random translation by up to ``shift`` pixels (zero padding) and horizontal flip, per image."""
    b, _, h, w = x.shape
    padded = F.pad(x, (shift, shift, shift, shift))
    dx = torch.randint(0, 2 * shift + 1, (b,), generator=gen)
    dy = torch.randint(0, 2 * shift + 1, (b,), generator=gen)
    # gather in two steps: rows then columns
    tmp = torch.gather(padded, 2, (dy.view(b, 1, 1, 1) + torch.arange(h).view(1, 1, h, 1)).expand(b, 1, h, w + 2 * shift))
    out = torch.gather(tmp, 3, (dx.view(b, 1, 1, 1) + torch.arange(w).view(1, 1, 1, w)).expand(b, 1, h, w))
    flip = torch.rand(b, generator=gen) < 0.5
    out[flip] = out[flip].flip(-1)
    return out


def _load_fmnist(data_root: str | None) -> tuple[list[Path], tuple[torch.Tensor, ...]]:
    files = find_idx_files("fashion-mnist", FMNIST_STEMS, data_root=data_root, hint=FMNIST_HINT)
    xtr, ytr, xte, yte = (read_idx(f) for f in files)
    to_img = lambda a: torch.from_numpy(a).float().div_(255.0).unsqueeze(1)  # noqa: E731
    return files, (to_img(xtr), torch.from_numpy(ytr).long(), to_img(xte), torch.from_numpy(yte).long())


@torch.no_grad()
def _accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1000) -> float:
    model.eval()
    correct = sum(int((model(x[i : i + batch]).argmax(-1) == y[i : i + batch]).sum()) for i in range(0, len(x), batch))
    return 100.0 * correct / len(x)


def _train_epochs(model, xtr, ytr, opt, sched, gen, *, epochs: int, batch_size: int, progress: bool) -> list[dict]:
    steps_per_epoch = math.ceil(len(xtr) / batch_size)
    history = []
    for epoch in range(epochs):
        model.train()
        perm = torch.randperm(len(xtr), generator=gen)
        bar = Progress(range(steps_per_epoch), desc=f"pretrain epoch {epoch + 1}/{epochs}", enabled=progress)
        run_loss, t0 = 0.0, time.time()
        for i in bar:
            idx = perm[i * batch_size : (i + 1) * batch_size]
            loss = F.cross_entropy(model(_augment(xtr[idx], gen)), ytr[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            run_loss += loss.item()
            bar.set_postfix(loss=f"{run_loss / (i + 1):.3f}")
        bar.close()
        bar.line(f"pretrain epoch {epoch + 1}/{epochs} loss {run_loss / steps_per_epoch:.4g} ({time.time() - t0:.1f} s)")
        history.append({"epoch": epoch + 1, "train_loss": run_loss / steps_per_epoch})
    return history


def pretrain_vit_tiny_fmnist(
    out_dir: str | Path,
    *,
    epochs: int = 6,
    batch_size: int = 256,
    lr: float = 1e-3,
    weight_decay: float = 0.05,
    warmup_steps: int = 200,
    seed: int = 0,
    data_root: str | None = None,
    limit: int | None = None,
    threads: int | None = 1,
    progress: bool = True,
) -> dict:
    """Train the tiny ViT and write ``model.safetensors``, ``config.json`` and ``provenance.json`` to ``out_dir``.

    Args:
        limit: use only the first ``limit`` training images (tests); the shipped weights use all 60k.
        threads: torch intra-op threads. Bit-identical weights need the same count (CPU reductions are split
            by thread); the shipped weights were made with 1.
    """
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    files, (xtr, ytr, xte, yte) = _load_fmnist(data_root)
    if limit:
        xtr, ytr = xtr[:limit], ytr[:limit]
    backbone = vit_tiny_fmnist(pretrained=False)
    head = IncrementalHead(backbone.feature_dim)
    gen = torch.Generator().manual_seed(seed)
    head.grow(10, generator=gen)
    model = ContinualClassifier(backbone, head)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr)
    steps_per_epoch = math.ceil(len(xtr) / batch_size)
    total = epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup_steps) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))
    )
    t0 = time.time()
    history = _train_epochs(model, xtr, ytr, opt, sched, gen, epochs=epochs, batch_size=batch_size, progress=progress)
    test_acc = _accuracy(model, xte, yte)
    out = Path(out_dir)
    wfile = out / "model.safetensors"
    save_tensors(wfile, backbone.inner.state_dict(), metadata={"format": "pt"})  # one key: safetensors orders several at random
    write_json(out / "config.json", VIT_TINY_FMNIST)
    provenance = {
        "preset": "vit-tiny-fmnist",
        "data": {"dataset": "fashion-mnist", "files": {f.name: sha256_file(f) for f in files},
                 "train_images": len(xtr), "test_images": len(xte)},
        "seed": seed,
        "epochs": epochs,
        "batch_size": batch_size,
        "optimizer": {"name": "adamw", "lr": lr, "weight_decay": weight_decay, "warmup_steps": warmup_steps,
                      "schedule": "cosine"},
        "augmentation": "random shift <= 2 px, horizontal flip",
        "history": history,
        "test_accuracy": round(test_acc, 2),
        "train_seconds": round(time.time() - t0, 1),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "sha256": sha256_file(wfile),
    }
    write_json(out / "provenance.json", provenance)
    return provenance


PRESETS: Registry = Registry("pretrain preset", key="--preset")  # name -> pretrain function
PRESETS.register("vit-tiny-fmnist", pretrain_vit_tiny_fmnist)
