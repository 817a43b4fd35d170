"""CUB-200-2011 with its official train/test split tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clmerge.data.base import DataSplits, register_dataset
from clmerge.data.folders import (
    CUB_HOWTO,
    check_first_exists,
    names_from_parents,
    read_table,
    reject_unknown,
    split_fingerprint,
    splits_from_lists,
    missing_data_error,
    resolve_data_root,
)
from clmerge.data.lookalike import LookalikeSpec, png_pool, register_lookalike, write_class_dirs

__all__ = ["cub200", "write_cub_lookalike"]


def _cub_tables(folder: Path) -> tuple[dict[int, str], dict[int, int], dict[int, int]]:
    """Read ``images.txt``, ``image_class_labels.txt`` and ``train_test_split.txt`` as id-keyed dicts."""

    def is_train(text: str) -> int:
        if text not in ("0", "1"):
            raise ValueError("is_training_image must be 0 or 1")
        return int(text)

    def label(text: str) -> int:
        value = int(text)
        if value < 1:
            raise ValueError("class labels are 1-based")
        return value

    images = {
        i: p for _, i, p in read_table(folder / "images.txt", (int, str), expected="<image_id> <path>")
    }
    labels = {
        i: c
        for _, i, c in read_table(
            folder / "image_class_labels.txt", (int, label), expected="<image_id> <class_id>"
        )
    }
    split = {
        i: t
        for _, i, t in read_table(
            folder / "train_test_split.txt", (int, is_train), expected="<image_id> <0|1>"
        )
    }
    for name, table in (("image_class_labels.txt", labels), ("train_test_split.txt", split)):
        missing = sorted(set(images) - set(table))
        if missing:
            raise ValueError(
                f"cub200: {folder / name} has no entry for image id(s) {missing[:10]} listed in images.txt"
            )
    return images, labels, split


def _cub_class_names(folder: Path, labels: dict[int, int], images: dict[int, str]) -> list[str]:
    """Names from ``classes.txt`` if present, else image folders; the ``001.`` prefix is dropped."""
    path = folder / "classes.txt"
    if path.is_file():
        rows = read_table(path, (int, str), expected="<class_id> <name>")
        raw = [name for _, _, name in sorted(rows, key=lambda r: r[1])]
    else:
        raw = names_from_parents([Path(images[i]) for i in images], [labels[i] - 1 for i in images])
    return [n.split(".", 1)[1] if n[:3].isdigit() and "." in n else n for n in raw]


@register_dataset("cub200", "CUB-200-2011 birds, 200 classes, official train/test split")
def cub200(
    *, data_root: str | None = None, image_size: int | None = 224, seed: int = 0, **options: Any
) -> DataSplits:
    """CUB-200-2011 from ``<root>/CUB_200_2011/`` with its official split (labels made 0-based).

    Args:
        data_root: folder holding ``CUB_200_2011/``; see :func:`resolve_data_root`.
        image_size: square side after resize + centre crop, ``None`` keeps the original size.
        seed: unused (the split is official); accepted for a uniform signature.
        **options: rejected (``ValueError``) if any.

    Returns:
        The splits, with the 200 species names as ``class_names``.
    """
    reject_unknown("cub200", options, [])
    root = resolve_data_root(data_root)
    folder = root / "CUB_200_2011"
    needed = [folder / n for n in ("images.txt", "image_class_labels.txt", "train_test_split.txt")]
    missing = [p for p in needed if not p.is_file()]
    if missing:
        layouts = [
            f"{folder}/images/<class>/*.jpg with images.txt, image_class_labels.txt, train_test_split.txt"
        ]
        raise missing_data_error("cub200", ", ".join(map(str, missing)), layouts, CUB_HOWTO.format(root=root))
    images, labels, split = _cub_tables(folder)
    lists: dict[int, tuple[list[Path], list[int]]] = {1: ([], []), 0: ([], [])}
    for i in sorted(images):
        lists[split[i]][0].append(folder / "images" / images[i])
        lists[split[i]][1].append(labels[i] - 1)
    check_first_exists("cub200", lists[1][0], needed[0], folder / "images")
    fp = {
        "root": str(folder),
        "layout": "CUB_200_2011 official split",
        "split_files": split_fingerprint(needed),
    }
    out = splits_from_lists("cub200", lists[1], lists[0], image_size=image_size, fingerprint=fp)
    out.class_names = _cub_class_names(folder, labels, images)
    return out


@register_lookalike("cub200", classes=200)
def write_cub_lookalike(root: Path, spec: LookalikeSpec) -> None:
    """``CUB_200_2011/images/<NNN.Name>/*.png`` with the release's four tables (ids, labels, split, classes)."""
    folder, per = root / "CUB_200_2011", spec.n_train + spec.n_test
    names = [f"{c + 1:03d}.Bird_{c}" for c in range(spec.classes)]
    rel = write_class_dirs(folder / "images", names, per, png_pool())
    (folder / "images.txt").write_text("".join(f"{i + 1} {r}\n" for i, r in enumerate(rel)))
    (folder / "image_class_labels.txt").write_text("".join(f"{i + 1} {i // per + 1}\n" for i in range(len(rel))))
    (folder / "train_test_split.txt").write_text(
        "".join(f"{i + 1} {int(i % per < spec.n_train)}\n" for i in range(len(rel))))
    (folder / "classes.txt").write_text("".join(f"{c + 1} {n}\n" for c, n in enumerate(names)))
