"""ImageNet-R and ImageNet-A: pre-split folders, the CODA-Prompt yaml split, or a seeded per-class split."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clmerge.data.base import DataSplits, register_dataset
from clmerge.data.lookalike import LookalikeSpec, png_pool, register_lookalike, write_presplit
from clmerge.data.folders import (
    IMAGENET_A_HOWTO,
    IMAGENET_R_HOWTO,
    check_first_exists,
    check_same_classes,
    read_utf8_text,
    reject_unknown,
    scan_classes,
    split_fingerprint,
    splits_from_classes,
    splits_from_lists,
    missing_data_error,
    resolve_data_root,
    split_per_class,
)

__all__ = ["imagenet_r", "imagenet_a", "write_imagenet_r_lookalike", "write_imagenet_a_lookalike"]


def _find_coda_yaml(folder: Path, root: Path) -> tuple[Path, Path] | None:
    """Locate ``imagenet-r_{train,test}.yaml`` in ``folder`` or ``root`` (both files or neither)."""
    for d in (folder, root):
        tr, te = d / "imagenet-r_train.yaml", d / "imagenet-r_test.yaml"
        if tr.is_file() and te.is_file():
            return tr, te
        if tr.is_file() or te.is_file():
            missing = te if tr.is_file() else tr
            raise FileNotFoundError(f"imagenet_r: found one CODA-Prompt split file in {d} but not {missing}")
    return None


def _coda_path(entry: str, folder: Path) -> Path:
    """Resolve a CODA-Prompt path (e.g. ``data/imagenet-r/n01443537/art_0.jpg``) against the raw folder."""
    p = Path(entry)
    if p.is_absolute() and p.exists():
        return p
    parts = p.parts
    if "imagenet-r" in parts:
        cut = len(parts) - 1 - parts[::-1].index("imagenet-r")
        parts = parts[cut + 1 :]
    return folder.joinpath(*parts)


def _read_coda_yaml(path: Path, folder: Path) -> tuple[list[Path], list[int]]:
    """Read one CODA-Prompt split file: a YAML mapping with ``data`` (paths) and ``targets`` (int labels)."""
    from ..utils.yaml_io import load_yaml

    # a split file lists every image: larger than a config, so higher limits (still no alias bomb)
    cfg = load_yaml(read_utf8_text(path), source=str(path), max_nodes=20_000_000, fast=True)
    if (
        not isinstance(cfg, dict)
        or not isinstance(cfg.get("data"), list)
        or not isinstance(cfg.get("targets"), list)
    ):
        raise ValueError(
            f"{path}: expected a YAML mapping with list entries 'data' (paths) and 'targets' (labels)"
        )
    data, targets = cfg["data"], cfg["targets"]
    if len(data) != len(targets):
        raise ValueError(f"{path}: {len(data)} entries in 'data' but {len(targets)} in 'targets'")
    bad = next(
        (i for i, t in enumerate(targets) if isinstance(t, bool) or not isinstance(t, int) or t < 0), None
    )
    if bad is not None:
        raise ValueError(f"{path}: targets[{bad}] = {targets[bad]!r} is not a non-negative integer label")
    bad = next((i for i, d in enumerate(data) if not isinstance(d, str)), None)
    if bad is not None:
        raise ValueError(f"{path}: data[{bad}] = {data[bad]!r} is not a path string")
    return [_coda_path(d, folder) for d in data], [int(t) for t in targets]


def _imagenet_r_coda(folder: Path, files: tuple[Path, Path], image_size: int | None) -> DataSplits:
    """Layout (b): the raw folder plus the CODA-Prompt YAML split files."""
    train = _read_coda_yaml(files[0], folder)
    test = _read_coda_yaml(files[1], folder)
    for split, f in zip((train, test), files, strict=True):
        check_first_exists("imagenet_r", split[0], f, folder)
    fp = {
        "root": str(folder),
        "layout": "raw folder + CODA-Prompt yaml split",
        "split_files": split_fingerprint(files),
    }
    return splits_from_lists("imagenet_r", train, test, image_size=image_size, fingerprint=fp)


def _berkeley_folder(
    dataset: str, folder: Path, *, image_size: int | None, seed: int, test_fraction: float
) -> DataSplits | None:
    """Layouts "pre-split" (``folder/{train,test}/<wnid>/``) and "raw" (``folder/<wnid>/``, seeded split).

    Returns ``None`` if ``folder`` does not exist or holds no image class folders.
    """
    if not folder.is_dir():
        return None
    if (folder / "train").is_dir() and (folder / "test").is_dir():
        train, test = scan_classes(folder / "train"), scan_classes(folder / "test")
        check_same_classes(dataset, train, test, folder)
        fp = {"root": str(folder), "layout": "pre-split train/test (PILOT / SD-LoRA)"}
        return splits_from_classes(dataset, train, test, image_size=image_size, fingerprint=fp)
    by_class = {k: v for k, v in scan_classes(folder, exclude=("train", "test")).items() if v}
    if not by_class:
        return None
    train, test = split_per_class(by_class, test_fraction, seed)
    fp = {
        "root": str(folder),
        "layout": "raw folder, seeded per-class split",
        "seed": int(seed),
        "test_fraction": test_fraction,
    }
    return splits_from_classes(dataset, train, test, image_size=image_size, fingerprint=fp)


@register_dataset(
    "imagenet_r", "ImageNet-R, 200 classes (pre-split, CODA-Prompt yaml split, or seeded 80/20)"
)
def imagenet_r(
    *,
    data_root: str | None = None,
    image_size: int | None = 224,
    seed: int = 0,
    test_fraction: float = 0.2,
    split_seed: int | None = None,
    **options: Any,
) -> DataSplits:
    """ImageNet-R (200 classes, wnid folder names), from ``<root>/imagenet-r/``.

    Layouts, in order of preference: (a) pre-split ``train/<wnid>/`` and ``test/<wnid>/`` (PILOT / SD-LoRA);
    (b) the raw Berkeley folder ``<wnid>/`` plus ``imagenet-r_train.yaml`` / ``imagenet-r_test.yaml``
    (CODA-Prompt split, in ``<root>/imagenet-r/`` or ``<root>``); (c) the raw folder alone, split per class.

    Args:
        data_root: folder holding ``imagenet-r/``; see :func:`resolve_data_root`.
        image_size: square side after resize + centre crop, ``None`` keeps the original size.
        seed: seed of the per-class split (layout (c) only, unless ``split_seed`` is set).
        test_fraction: test share per class (layout (c) only).
        split_seed: overrides ``seed`` for the split, to keep one split across runs with different seeds.
        **options: rejected (``ValueError``) if any.

    Returns:
        The splits; ``fingerprint["layout"]`` says which layout was used.
    """
    reject_unknown("imagenet_r", options, ["test_fraction", "split_seed"])
    seed = seed if split_seed is None else split_seed
    root = resolve_data_root(data_root)
    folder = root / "imagenet-r"
    if folder.is_dir() and not ((folder / "train").is_dir() and (folder / "test").is_dir()):
        coda = _find_coda_yaml(folder, root)
        if coda is not None:
            return _imagenet_r_coda(folder, coda, image_size)
    found = _berkeley_folder(
        "imagenet_r", folder, image_size=image_size, seed=seed, test_fraction=test_fraction
    )
    if found is None:
        layouts = [
            f"{folder}/train/<wnid>/ + {folder}/test/<wnid>/ (PILOT / SD-LoRA)",
            f"{folder}/<wnid>/ + imagenet-r_train.yaml / imagenet-r_test.yaml in {folder} or {root} "
            "(CODA-Prompt)",
            f"{folder}/<wnid>/ alone (seeded 80/20 split per class)",
        ]
        raise missing_data_error(
            "imagenet_r", f"wnid image folders in {folder}", layouts, IMAGENET_R_HOWTO.format(root=root)
        )
    return found


@register_dataset("imagenet_a", "ImageNet-A, 200 classes (pre-split train/test, or seeded 80/20 per class)")
def imagenet_a(
    *,
    data_root: str | None = None,
    image_size: int | None = 224,
    seed: int = 0,
    test_fraction: float = 0.2,
    split_seed: int | None = None,
    **options: Any,
) -> DataSplits:
    """ImageNet-A (200 classes, wnid folder names), from ``<root>/imagenet-a/``.

    Layouts: pre-split ``train/<wnid>/`` and ``test/<wnid>/`` (PILOT), else the raw Berkeley folder
    ``<wnid>/`` split per class by ``seed``.

    Args:
        data_root: folder holding ``imagenet-a/``; see :func:`resolve_data_root`.
        image_size: square side after resize + centre crop, ``None`` keeps the original size.
        seed: seed of the per-class split (raw layout only, unless ``split_seed`` is set).
        test_fraction: test share per class (raw layout only).
        split_seed: overrides ``seed`` for the split, to keep one split across runs with different seeds.
        **options: rejected (``ValueError``) if any.

    Returns:
        The splits; ``fingerprint["layout"]`` says which layout was used.
    """
    reject_unknown("imagenet_a", options, ["test_fraction", "split_seed"])
    seed = seed if split_seed is None else split_seed
    root = resolve_data_root(data_root)
    folder = root / "imagenet-a"
    found = _berkeley_folder(
        "imagenet_a", folder, image_size=image_size, seed=seed, test_fraction=test_fraction
    )
    if found is None:
        layouts = [
            f"{folder}/train/<wnid>/ + {folder}/test/<wnid>/ (PILOT)",
            f"{folder}/<wnid>/ (seeded 80/20 split per class)",
        ]
        raise missing_data_error(
            "imagenet_a", f"wnid image folders in {folder}", layouts, IMAGENET_A_HOWTO.format(root=root)
        )
    return found


# ----------------------------------------------------------------------------------------------- DomainNet


@register_lookalike("imagenet_r", classes=200)
def write_imagenet_r_lookalike(root: Path, spec: LookalikeSpec) -> None:
    """``imagenet-r/{train,test}/<wnid>/*.png``: the pre-split layout."""
    _write_presplit_wnids(root / "imagenet-r", spec)


@register_lookalike("imagenet_a", classes=200)
def write_imagenet_a_lookalike(root: Path, spec: LookalikeSpec) -> None:
    """``imagenet-a/{train,test}/<wnid>/*.png``: the pre-split layout."""
    _write_presplit_wnids(root / "imagenet-a", spec)


def _write_presplit_wnids(folder: Path, spec: LookalikeSpec) -> None:
    wnids = [f"n{c:08d}" for c in range(spec.classes)]
    write_presplit(folder, wnids, spec.n_train, spec.n_test, png_pool())
