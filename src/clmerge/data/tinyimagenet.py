"""``tinyimagenet``: Tiny ImageNet (200 classes, 64x64) in its release layout (HALRP App. F.1).

Layout (``tiny-imagenet-200.zip`` unzipped)::

    <root>/tiny-imagenet-200/wnids.txt                       (optional: the 200 wnids; else the train folders)
    <root>/tiny-imagenet-200/words.txt                       (optional: wnid -> names, for class_names)
    <root>/tiny-imagenet-200/train/<wnid>/images/*.JPEG      (500 per class)
    <root>/tiny-imagenet-200/val/images/*.JPEG + val/val_annotations.txt   (50 per class)

The test labels of the release are not public, so the labelled ``val`` split is the test split (as in the
HALRP/GPM code); ``scenario.val_fraction`` (0.1 in the paper configs) holds out validation images from train.
Class ids follow the sorted wnids. ``data_root`` may also point at the ``tiny-imagenet-200`` folder itself.
Images keep their native 64x64 when ``image_size`` is ``None`` or 64, else resize + centre crop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..utils.inpaths import read_text as read_input_text
from .base import DataSplits, register_dataset
from .lookalike import LookalikeSpec, png_pool, register_lookalike
from .folders import (
    images_in,
    read_table,
    reject_unknown,
    split_fingerprint,
    splits_from_lists,
    subdirs,
    missing_data_error,
    resolve_data_root,
)

__all__ = ["tinyimagenet", "write_tinyimagenet_lookalike"]

TINY_HOWTO = (
    "Get it: download http://cs231n.stanford.edu/tiny-imagenet-200.zip and unzip it into {root} "
    "(it creates tiny-imagenet-200/ with train/, val/ and wnids.txt)."
)


def _tiny_dir(root: Path) -> Path | None:
    for folder in (root / "tiny-imagenet-200", root):
        if (folder / "train").is_dir() and (folder / "val").is_dir():
            return folder
    return None


def _wnids(folder: Path) -> list[str]:
    path = folder / "wnids.txt"
    if path.is_file():
        ids = sorted({line.strip() for line in read_input_text(path, kind="text").splitlines() if line.strip()})
    else:
        ids = [d.name for d in subdirs(folder / "train")]
    if not ids:
        raise ValueError(f"tinyimagenet: no classes found in {path if path.is_file() else folder / 'train'}")
    return ids


def _val_annotations(folder: Path, ids: dict[str, int]) -> tuple[list[Path], list[int]]:
    """``val/val_annotations.txt``: ``<file> <wnid> <x0> <y0> <x1> <y1>`` (tab-separated), first two columns used."""
    path = folder / "val" / "val_annotations.txt"
    if not path.is_file():
        raise missing_data_error("tinyimagenet", str(path), [f"{folder}/val/images/*.JPEG + {path}"],
                                 TINY_HOWTO.format(root=folder.parent))

    def wnid(text: str) -> str:
        name = text.split()[0]
        if name not in ids:
            raise ValueError(f"unknown wnid {name!r}")
        return name

    rows = read_table(path, (str, wnid), expected="<file> <wnid> <box...>")
    paths = [folder / "val" / "images" / f for _, f, _ in rows]
    if paths and not paths[0].exists():
        raise FileNotFoundError(f"tinyimagenet: {path} names {paths[0]}, which does not exist")
    return paths, [ids[w] for _, _, w in rows]


def _words(folder: Path, wnids: list[str]) -> list[str]:
    path = folder / "words.txt"
    if not path.is_file():
        return list(wnids)
    table = {}
    for line in read_input_text(path, kind="text").splitlines():
        if "\t" in line:
            k, v = line.split("\t", 1)
            table[k.strip()] = v.split(",")[0].strip()
    return [table.get(w, w) for w in wnids]


@register_dataset("tinyimagenet", "Tiny ImageNet, 200 classes, 64x64, release layout (labelled val as test)")
def tinyimagenet(*, data_root: str | None = None, image_size: int | None = 64, seed: int = 0,
                 **options: Any) -> DataSplits:
    """Tiny ImageNet from ``<root>/tiny-imagenet-200/``; see the module docstring.

    Args:
        data_root: folder holding ``tiny-imagenet-200/`` (or that folder itself); see :func:`resolve_data_root`.
        image_size: output side; ``None`` or 64 keeps the native 64x64, else resize + centre crop.
        seed: unused (the split is the release's); accepted for a uniform signature.
        **options: rejected (``ValueError``).

    Returns:
        The splits (train = ``train/``, test = labelled ``val/``), class names from ``words.txt`` if present.
    """
    reject_unknown("tinyimagenet", options, [])
    root = resolve_data_root(data_root)
    folder = _tiny_dir(root)
    if folder is None:
        layouts = [f"{root}/tiny-imagenet-200/train/<wnid>/images/*.JPEG + val/images/ + val/val_annotations.txt",
                   f"{root}/train/... + {root}/val/... (data_root pointing at tiny-imagenet-200)"]
        raise missing_data_error("tinyimagenet", f"{root}/tiny-imagenet-200", layouts, TINY_HOWTO.format(root=root))
    wnids = _wnids(folder)
    ids = {w: i for i, w in enumerate(wnids)}
    tr_paths, tr_labels = [], []
    for w in wnids:
        d = folder / "train" / w
        files = images_in(d / "images" if (d / "images").is_dir() else d)
        if not files:
            raise FileNotFoundError(f"tinyimagenet: no images for class {w} under {d}")
        tr_paths += files
        tr_labels += [ids[w]] * len(files)
    te_paths, te_labels = _val_annotations(folder, ids)
    size = None if image_size in (None, 64) else image_size
    split_files = [p for p in (folder / "wnids.txt", folder / "val" / "val_annotations.txt") if p.is_file()]
    fp = {"root": str(folder), "layout": "tiny-imagenet-200 release (val as test)",
          "split_files": split_fingerprint(split_files)}
    out = splits_from_lists("tinyimagenet", (tr_paths, tr_labels), (te_paths, te_labels), image_size=size,
                             fingerprint=fp)
    out.class_names = _words(folder, wnids)
    return out


@register_lookalike("tinyimagenet", classes=200)
def write_tinyimagenet_lookalike(root: Path, spec: LookalikeSpec) -> None:
    """The release layout: ``train/<wnid>/images``, ``val/images`` + ``val_annotations.txt``, ``wnids.txt``."""
    folder, pool, n_test = root / "tiny-imagenet-200", png_pool(), spec.n_test
    wnids = [f"n{c:08d}" for c in range(spec.classes)]
    for k, w in enumerate(wnids):
        (folder / "train" / w / "images").mkdir(parents=True, exist_ok=True)
        for i in range(spec.n_train):
            (folder / "train" / w / "images" / f"{w}_{i}.JPEG").write_bytes(pool[(k + i) % len(pool)])
    (folder / "val" / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for k, w in enumerate(wnids):
        for i in range(n_test):
            name = f"val_{k * n_test + i}.JPEG"
            (folder / "val" / "images" / name).write_bytes(pool[k % len(pool)])
            lines.append(f"{name}\t{w}\t0\t0\t7\t7")
    (folder / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    (folder / "wnids.txt").write_text("\n".join(wnids) + "\n")
