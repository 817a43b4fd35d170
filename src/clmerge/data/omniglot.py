"""``omniglot``: Omniglot characters with rotated copies (HALRP App. F.1, Omniglot-Rotation).

Layout (the standard release, e.g. ``images_background.zip`` and ``images_evaluation.zip`` unzipped)::

    <root>/omniglot/images_background/<Alphabet>/<characterNN>/*.png     (964 characters)
    <root>/omniglot/images_evaluation/<Alphabet>/<characterNN>/*.png     (659 characters)

(``<root>/omniglot-py/`` -- torchvision's folder name -- and ``<root>`` itself are accepted too.)

Protocol (APD / WSN, as far as the HALRP paper gives it; our reading, documented choices marked *):
- classes: the first ``n_classes`` = 1200 characters, in the order background then evaluation, alphabets and
  characters sorted by name (*: APD uses "1200 classes"; the exact selection is not given);
- every drawing is split per class into train and test (``test_fraction`` 0.2 of the 20 drawings*, seeded by
  ``split_seed``/``seed`` and the class name, so the split is the same under every task order), *then* each
  drawing contributes four images, rotated by 0, 90, 180 and 270 degrees (``rotations``), to the same class --
  rotated copies of a test drawing stay in test;
- images are read as grey, inverted so that strokes are 1 and the background 0 (``invert``), and resized
  (bilinear, antialiased) to ``image_size`` (the engine passes the backbone's; 28 in the paper config).
With ``scenario.kind: task_incremental``, ``n_tasks: 100`` and ``shuffle_classes: false`` the scenario cuts the
1200 classes into the paper's 100 12-way tasks; ``scenario.val_fraction`` holds out validation images.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .base import DataSplits, FileListData, register_dataset
from .folders import images_in, reject_unknown, subdirs, missing_data_error, resolve_data_root, split_per_class
from .lookalike import LookalikeSpec, png_pool, register_lookalike

__all__ = ["RotatedFileData", "omniglot", "OMNIGLOT_SETS", "write_omniglot_lookalike"]

OMNIGLOT_SETS = ("images_background", "images_evaluation")
OMNIGLOT_HOWTO = (
    "Get it: download images_background.zip and images_evaluation.zip from "
    "https://github.com/brendenlake/omniglot (python/ folder) and unzip both into {root}/omniglot/."
)


class RotatedFileData(FileListData):
    """Image files, each item rotated by ``quarter_turns[i] * 90`` degrees, resized to ``out_size``, inverted."""

    def __init__(self, paths: list[Path], targets, quarter_turns, *, out_size: int | None, invert: bool,
                 name: str = "") -> None:
        super().__init__(paths, targets, image_size=None, mode="L", name=name)
        self.quarter_turns = np.asarray(quarter_turns, dtype=np.int64)
        self.out_size, self.invert = out_size, invert

    def get_batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        imgs = []
        for i in idx:
            x = self.load(int(i)).unsqueeze(0)  # (1, 1, H, W)
            if self.out_size is not None and tuple(x.shape[-2:]) != (self.out_size, self.out_size):
                shrink = x.shape[-1] > self.out_size
                x = F.interpolate(x, size=(self.out_size, self.out_size), mode="bilinear", align_corners=False,
                                  antialias=shrink).clamp_(0, 1)
            imgs.append(torch.rot90(x[0], int(self.quarter_turns[i]), dims=(1, 2)))
        x = torch.stack(imgs)
        return (1.0 - x if self.invert else x), torch.as_tensor(self.targets[idx], dtype=torch.long)


def _omniglot_dir(root: Path) -> Path | None:
    for folder in (root / "omniglot", root / "omniglot-py", root):
        if any((folder / s).is_dir() for s in OMNIGLOT_SETS):
            return folder
    return None


def _characters(folder: Path, sets: list[str]) -> dict[str, list[Path]]:
    """``"<set>/<Alphabet>/<character>" -> sorted drawings`` in background-then-evaluation, sorted order."""
    out: dict[str, list[Path]] = {}
    for s in sets:
        if not (folder / s).is_dir():
            continue
        for alphabet in subdirs(folder / s):
            for char in subdirs(alphabet):
                files = images_in(char)
                if files:
                    out[f"{s}/{alphabet.name}/{char.name}"] = files
    return out


def _expand(by_class: dict[str, list[Path]], ids: dict[str, int], turns: list[int]):
    paths, labels, rots = [], [], []
    for name, files in by_class.items():
        for f in files:
            for k in turns:
                paths.append(f), labels.append(ids[name]), rots.append(k)
    return paths, labels, rots


@register_dataset("omniglot", "Omniglot characters (background+evaluation), 0/90/180/270-degree copies (APD)")
def omniglot(*, data_root: str | None = None, image_size: int | None = 28, seed: int = 0, n_classes: int = 1200,
             test_fraction: float = 0.2, split_seed: int | None = None, rotations: list[int] | None = None,
             invert: bool = True, sets: list[str] | None = None, **options: Any) -> DataSplits:
    """Omniglot-Rotation source; see the module docstring.

    Args:
        data_root: folder holding ``omniglot/`` (or ``omniglot-py/``); see :func:`resolve_data_root`.
        image_size: output side (bilinear resize); ``None`` keeps 105x105.
        seed: seed of the per-class drawing split (unless ``split_seed``).
        n_classes: how many characters to keep (the first ones in the documented order); 0 keeps all.
        test_fraction: share of each character's drawings used for testing.
        split_seed: overrides ``seed`` for the split.
        rotations: angles in degrees (multiples of 90) of the copies of every drawing (default 0, 90, 180, 270).
        invert: strokes 1 / background 0 (the files have black strokes on white).
        sets: which of ``images_background`` / ``images_evaluation`` to read (default both, in that order).
        **options: rejected (``ValueError``).

    Returns:
        The splits, class names ``<set>/<Alphabet>/<character>``.
    """
    reject_unknown("omniglot", options, ["n_classes", "test_fraction", "split_seed", "rotations", "invert", "sets"])
    angles = [0, 90, 180, 270] if rotations is None else [int(a) for a in rotations]
    if not angles or any(a % 90 for a in angles):
        raise ValueError(f"omniglot: rotations must be multiples of 90 degrees, got {angles}")
    sets = list(sets) if sets is not None else list(OMNIGLOT_SETS)
    unknown = [s for s in sets if s not in OMNIGLOT_SETS]
    if unknown:
        raise ValueError(f"omniglot: unknown set(s) {unknown}; choose from {list(OMNIGLOT_SETS)}")
    root = resolve_data_root(data_root)
    folder = _omniglot_dir(root)
    chars = _characters(folder, sets) if folder is not None else {}
    if not chars:
        layouts = [f"{root}/omniglot/images_background/<Alphabet>/<character>/*.png (+ images_evaluation/)",
                   f"{root}/omniglot-py/images_background/... (torchvision)"]
        raise missing_data_error("omniglot", f"character folders under {root}/omniglot", layouts,
                                 OMNIGLOT_HOWTO.format(root=root))
    if n_classes:
        if n_classes > len(chars):
            raise ValueError(f"omniglot: n_classes={n_classes} but {folder} holds only {len(chars)} characters")
        chars = dict(list(chars.items())[:n_classes])
    train, test = split_per_class(chars, test_fraction, seed if split_seed is None else split_seed)
    names = list(chars)
    ids = {n: i for i, n in enumerate(names)}
    turns = [(a // 90) % 4 for a in angles]
    tr, te = _expand(train, ids, turns), _expand(test, ids, turns)
    fp = {"root": str(folder), "layout": "omniglot images_background/images_evaluation", "n_classes": len(names),
          "rotations": angles, "test_fraction": test_fraction, "n_train": len(tr[0]), "n_test": len(te[0])}
    return DataSplits(
        train=RotatedFileData(*tr, out_size=image_size, invert=invert, name="omniglot/train"),
        test=RotatedFileData(*te, out_size=image_size, invert=invert, name="omniglot/test"),
        class_names=names, fingerprint=fp,
    )


@register_lookalike("omniglot", classes=lambda options: int(options.get("n_classes", 1200)))
def write_omniglot_lookalike(root: Path, spec: LookalikeSpec) -> None:
    """``omniglot/images_background/<Alphabet>/<characterNN>/*.png``: ``spec.classes`` characters of
    ``n_train + n_test + 2`` drawings each (the reader splits every character's drawings itself)."""
    folder, pool, n = root / "omniglot" / "images_background", png_pool(), spec.n_train + spec.n_test + 2
    for c in range(spec.classes):
        char = folder / f"Alphabet{c // 20:03d}" / f"character{c % 20 + 1:02d}"
        char.mkdir(parents=True, exist_ok=True)
        for d in range(n):
            (char / f"{c:04d}_{d:02d}.png").write_bytes(pool[(c + d) % len(pool)])
