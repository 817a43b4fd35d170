"""Sources read from image folders on disk: generic class folders, ImageNet-R, ImageNet-A, DomainNet, CUB-200.

Every builder is registered with :func:`~clmerge.data.base.register_dataset` and has the signature
``fn(*, data_root=None, image_size=224, seed=0, **options) -> DataSplits``. Nothing on disk is ever moved
or written: where a dataset ships without a train/test split, a deterministic per-class split is computed in
memory (sorted file lists, then a permutation seeded by ``seed`` and the class name), so the same seed always
gives the same split and adding a class does not change the split of the others.

``data_root`` defaults to ``$CLMERGE_DATA`` when set, else ``./data`` (:func:`resolve_data_root`).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from clmerge.data.base import DataSplits, FileListData, register_dataset
from clmerge.utils.io import sha256_file

__all__ = [
    "DATA_ENV_VAR",
    "IMAGE_EXTENSIONS",
    "DOMAINNET_DOMAINS",
    "resolve_data_root",
    "missing_data_error",
    "split_per_class",
    "image_folder",
    "imagenet_r",
    "imagenet_a",
    "domainnet",
    "cub200",
]

DATA_ENV_VAR = "CLMERGE_DATA"
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
DOMAINNET_DOMAINS = ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")

IMAGENET_R_HOWTO = (
    "Get it: download the Berkeley tarball imagenet-r.tar "
    "(https://people.eecs.berkeley.edu/~hendrycks/imagenet-r.tar) and extract it into {root} "
    "(it creates imagenet-r/); optionally add the CODA-Prompt split files imagenet-r_train.yaml / "
    "imagenet-r_test.yaml next to it."
)
IMAGENET_A_HOWTO = (
    "Get it: download the Berkeley tarball imagenet-a.tar "
    "(https://people.eecs.berkeley.edu/~hendrycks/imagenet-a.tar) and extract it into {root} "
    "(it creates imagenet-a/)."
)
DOMAINNET_HOWTO = (
    "Get it: download the six domain zips and their <domain>_train.txt / <domain>_test.txt split files from "
    "http://ai.bu.edu/M3SDA/ and unzip them into {root}/domainnet/ (so that e.g. "
    "{root}/domainnet/clipart/aircraft_carrier/ and {root}/domainnet/clipart_train.txt exist)."
)
CUB_HOWTO = (
    "Get it: download the CUB_200_2011.tgz tarball (https://www.vision.caltech.edu/datasets/cub_200_2011/) "
    "and extract it into {root} (it creates CUB_200_2011/ with images/, images.txt, image_class_labels.txt "
    "and train_test_split.txt)."
)

ByClass = dict[str, list[Path]]


# ----------------------------------------------------------------------------------------------- helpers


def resolve_data_root(data_root: str | os.PathLike[str] | None) -> Path:
    """Return the data root: ``data_root`` if given, else ``$CLMERGE_DATA`` if set, else ``./data``.

    Args:
        data_root: explicit root, or ``None`` to use the environment / default.

    Returns:
        The root as a :class:`~pathlib.Path` (``~`` expanded, not required to exist).
    """
    if data_root is not None and str(data_root) != "":
        return Path(data_root).expanduser()
    env = os.environ.get(DATA_ENV_VAR)
    return Path(env).expanduser() if env else Path("./data")


def missing_data_error(
    dataset: str, looked_for: str, layouts: Sequence[str], howto: str
) -> FileNotFoundError:
    """Build the uniform "data not found" error.

    Args:
        dataset: registered source name.
        looked_for: what was searched for, and where.
        layouts: the accepted on-disk layouts, one phrase each.
        howto: how to obtain the data.

    Returns:
        A :class:`FileNotFoundError` to raise.
    """
    accepted = "; ".join(f"({i + 1}) {lay}" for i, lay in enumerate(layouts))
    return FileNotFoundError(
        f"{dataset}: data not found: looked for {looked_for}. Accepted layouts: {accepted}. {howto} "
        f"The root comes from data_root, else ${DATA_ENV_VAR}, else ./data."
    )


def _reject_unknown(dataset: str, options: dict[str, Any], accepted: Iterable[str]) -> None:
    """Raise ``ValueError`` if ``options`` holds keys the builder does not understand."""
    if options:
        known = ", ".join(sorted(accepted)) or "none"
        raise ValueError(f"{dataset}: unknown option(s) {sorted(options)}; accepted options: {known}")


def _is_image(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS and not path.name.startswith(".")


def _subdirs(folder: Path) -> list[Path]:
    """Visible sub-folders of ``folder``, sorted by name."""
    return sorted(
        (p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")), key=lambda p: p.name
    )


def _images_in(folder: Path) -> list[Path]:
    """Image files anywhere below ``folder`` (hidden entries skipped), sorted by relative path."""
    found = [p for p in folder.rglob("*") if _is_image(p)]
    found = [p for p in found if not any(part.startswith(".") for part in p.relative_to(folder).parts)]
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def _scan_classes(folder: Path, *, exclude: Iterable[str] = ()) -> ByClass:
    """Map each class sub-folder name of ``folder`` (sorted) to its sorted image files."""
    skip = set(exclude)
    return {d.name: _images_in(d) for d in _subdirs(folder) if d.name not in skip}


def _check_same_classes(dataset: str, train: ByClass, test: ByClass, root: Path) -> None:
    """Raise ``ValueError`` if the train and test class-folder sets differ."""
    only_train, only_test = sorted(set(train) - set(test)), sorted(set(test) - set(train))
    if only_train or only_test:
        raise ValueError(
            f"{dataset}: {root}/train and {root}/test must hold the same class folders; "
            f"only in train: {only_train[:10]}{' ...' if len(only_train) > 10 else ''}, "
            f"only in test: {only_test[:10]}{' ...' if len(only_test) > 10 else ''}"
        )


def split_per_class(by_class: ByClass, test_fraction: float, seed: int) -> tuple[ByClass, ByClass]:
    """Deterministically split each class's files into train and test, without touching the disk.

    Each class is permuted by a generator seeded with ``(seed, crc32(class name))``;
    ``round(n * test_fraction)`` files go to test (at least one and at most ``n - 1`` when a class has two or
    more files; a single file stays in train). Both parts keep the sorted file order.

    Args:
        by_class: class name -> sorted file list.
        test_fraction: share of each class used for testing, in ``(0, 1)``.
        seed: split seed.

    Returns:
        ``(train_by_class, test_by_class)`` with the same class keys.
    """
    if not 0.0 < float(test_fraction) < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    train: ByClass = {}
    test: ByClass = {}
    for name, files in by_class.items():
        n = len(files)
        n_test = min(max(round(n * test_fraction), 1), n - 1) if n >= 2 else 0
        rng = np.random.default_rng([int(seed) % 2**32, zlib.crc32(name.encode("utf-8"))])
        test_idx = set(rng.permutation(n)[:n_test].tolist())
        test[name] = [f for i, f in enumerate(files) if i in test_idx]
        train[name] = [f for i, f in enumerate(files) if i not in test_idx]
    return train, test


def _flatten(by_class: ByClass, class_ids: dict[str, int]) -> tuple[list[Path], list[int]]:
    """Concatenate per-class file lists into ``(paths, labels)``."""
    paths: list[Path] = []
    labels: list[int] = []
    for name, files in by_class.items():
        paths.extend(files)
        labels.extend([class_ids[name]] * len(files))
    return paths, labels


def _splits_from_classes(
    dataset: str, train: ByClass, test: ByClass, *, image_size: int | None, fingerprint: dict[str, Any]
) -> DataSplits:
    """Turn per-class file lists (same keys) into :class:`DataSplits`; class ids follow the sorted names."""
    names = sorted(train)
    ids = {n: i for i, n in enumerate(names)}
    tr_paths, tr_labels = _flatten({n: train[n] for n in names}, ids)
    te_paths, te_labels = _flatten({n: test[n] for n in names}, ids)
    if not tr_paths or not te_paths:
        raise ValueError(
            f"{dataset}: found {len(tr_paths)} train and {len(te_paths)} test images "
            f"({', '.join(IMAGE_EXTENSIONS)}) in {len(names)} class folders; both splits need at least one"
        )
    fp = {**fingerprint, "num_classes": len(names), "n_train": len(tr_paths), "n_test": len(te_paths)}
    return DataSplits(
        train=FileListData(tr_paths, tr_labels, image_size=image_size, name=f"{dataset}/train"),
        test=FileListData(te_paths, te_labels, image_size=image_size, name=f"{dataset}/test"),
        class_names=names,
        fingerprint=fp,
    )


def _splits_from_lists(
    dataset: str,
    train: tuple[list[Path], list[int]],
    test: tuple[list[Path], list[int]],
    *,
    image_size: int | None,
    fingerprint: dict[str, Any],
) -> DataSplits:
    """Turn ``(paths, labels)`` lists into :class:`DataSplits`; class names come from parent folders."""
    if not train[0] or not test[0]:
        raise ValueError(f"{dataset}: split lists hold {len(train[0])} train and {len(test[0])} test entries")
    names = _names_from_parents(train[0] + test[0], train[1] + test[1])
    fp = {
        **fingerprint,
        "num_classes": max(train[1] + test[1]) + 1,
        "n_train": len(train[0]),
        "n_test": len(test[0]),
    }
    return DataSplits(
        train=FileListData(train[0], train[1], image_size=image_size, name=f"{dataset}/train"),
        test=FileListData(test[0], test[1], image_size=image_size, name=f"{dataset}/test"),
        class_names=names,
        fingerprint=fp,
    )


def _names_from_parents(paths: Sequence[Path], labels: Sequence[int]) -> list[str]:
    """Class names from the files' parent folders; ``[]`` if a label maps to several folders or to none."""
    by_label: dict[int, str] = {}
    for path, label in zip(paths, labels, strict=True):
        if by_label.setdefault(int(label), path.parent.name) != path.parent.name:
            return []
    if not by_label or set(by_label) != set(range(max(by_label) + 1)):
        return []
    return [by_label[i] for i in range(len(by_label))]


def _read_text(path: Path) -> str:
    """Read a UTF-8 text file; raise ``ValueError`` naming it if it is not text."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a UTF-8 text file ({exc})") from exc


def _nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"negative value {value}")
    return value


def _read_table(
    path: Path,
    convert: tuple[Callable[[str], Any], Callable[[str], Any]],
    *,
    expected: str,
    right: bool = False,
) -> list[tuple[int, Any, Any]]:
    """Parse a two-column whitespace-separated text file.

    Args:
        path: the file.
        convert: converters for the two columns (a ``ValueError`` marks the line malformed).
        expected: the line format, for error messages (e.g. ``"<path> <label>"``).
        right: split on the last whitespace run instead of the first (for paths that may contain spaces).

    Returns:
        ``(line_number, first, second)`` for each non-blank line.
    """
    rows: list[tuple[int, Any, Any]] = []
    for lineno, line in enumerate(_read_text(path).splitlines(), 1):
        stripped = line.strip()
        if not stripped:
            continue
        parts = stripped.rsplit(maxsplit=1) if right else stripped.split(maxsplit=1)
        try:
            if len(parts) != 2:
                raise ValueError("expected two columns")
            rows.append((lineno, convert[0](parts[0]), convert[1](parts[1])))
        except ValueError as exc:
            raise ValueError(
                f"{path}, line {lineno}: malformed line {line!r} (expected {expected}; {exc})"
            ) from None
    return rows


def _check_first_exists(dataset: str, paths: Sequence[Path], split_file: Path, base: Path) -> None:
    """Fail early, with a clear message, if the first file named by a split file is missing."""
    if paths and not paths[0].exists():
        raise FileNotFoundError(
            f"{dataset}: {split_file} names {paths[0]}, which does not exist; the paths in that file are "
            f"read relative to {base}. Extract the images there (or fix data_root)."
        )


def _split_fingerprint(files: Sequence[Path]) -> dict[str, str]:
    """``{file name: sha256}`` for the split files used."""
    return {f.name: sha256_file(f) for f in files}


# ----------------------------------------------------------------------------------------------- image_folder


def _folder_layout(
    dataset: str, root: Path, test_fraction: float, seed: int
) -> tuple[ByClass, ByClass, dict]:
    """Read ``root/{train,test}/<class>/`` or ``root/<class>/`` (then split); return the splits and layout."""
    has_train, has_test = (root / "train").is_dir(), (root / "test").is_dir()
    if has_train and has_test:
        train, test = _scan_classes(root / "train"), _scan_classes(root / "test")
        _check_same_classes(dataset, train, test, root)
        return train, test, {"layout": "train/test class folders"}
    if has_train or has_test:
        present, absent = ("train", "test") if has_train else ("test", "train")
        raise FileNotFoundError(
            f"{dataset}: found {root / present} but not {root / absent}; a pre-split folder needs both "
            f"(or put the class folders directly under {root} for a seeded per-class split)"
        )
    by_class = {k: v for k, v in _scan_classes(root).items() if v}
    train, test = split_per_class(by_class, test_fraction, seed)
    fp = {
        "layout": "class folders, seeded per-class split",
        "seed": int(seed),
        "test_fraction": test_fraction,
    }
    return train, test, fp


@register_dataset(
    "image_folder", "generic <root>/{train,test}/<class>/*.jpg folders, or <root>/<class>/ split by seed"
)
def image_folder(
    *,
    data_root: str | None = None,
    image_size: int | None = 224,
    seed: int = 0,
    test_fraction: float = 0.2,
    split_seed: int | None = None,
    subdir: str | None = None,
    **options: Any,
) -> DataSplits:
    """Images in class folders; class ids are the sorted class-folder names.

    Args:
        data_root: the folder holding ``train/`` and ``test/`` (or the class folders); see
            :func:`resolve_data_root`.
        image_size: square side after resize + centre crop, ``None`` keeps the original size.
        seed: seed of the per-class split when the folder is not pre-split (unless ``split_seed`` is set).
        test_fraction: share of each class used for testing when the folder is not pre-split.
        split_seed: overrides ``seed`` for the split, to keep one split across runs with different seeds.
        subdir: optional sub-folder of ``data_root`` to read instead of ``data_root`` itself.
        **options: rejected (``ValueError``) if any.

    Returns:
        The train / test splits, with the class-folder names as ``class_names``.
    """
    _reject_unknown("image_folder", options, ["test_fraction", "split_seed", "subdir"])
    seed = seed if split_seed is None else split_seed
    root = resolve_data_root(data_root) / subdir if subdir else resolve_data_root(data_root)
    layouts = [
        f"{root}/train/<class>/*.jpg and {root}/test/<class>/*.jpg",
        f"{root}/<class>/*.jpg (seeded split)",
    ]
    howto = f"Point data_root at the folder (image extensions: {', '.join(IMAGE_EXTENSIONS)})."
    if not root.is_dir() or not _subdirs(root):
        raise missing_data_error("image_folder", f"class folders under {root}", layouts, howto)
    train, test, fp = _folder_layout("image_folder", root, test_fraction, seed)
    if not train:
        raise missing_data_error(
            "image_folder", f"image files in the class folders under {root}", layouts, howto
        )
    return _splits_from_classes(
        "image_folder", train, test, image_size=image_size, fingerprint={"root": str(root), **fp}
    )


# ------------------------------------------------------------------------------------------- ImageNet-R / -A


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
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        cfg = yaml.load(_read_text(path), Loader=loader)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML ({exc})") from exc
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
        _check_first_exists("imagenet_r", split[0], f, folder)
    fp = {
        "root": str(folder),
        "layout": "raw folder + CODA-Prompt yaml split",
        "split_files": _split_fingerprint(files),
    }
    return _splits_from_lists("imagenet_r", train, test, image_size=image_size, fingerprint=fp)


def _berkeley_folder(
    dataset: str, folder: Path, *, image_size: int | None, seed: int, test_fraction: float
) -> DataSplits | None:
    """Layouts "pre-split" (``folder/{train,test}/<wnid>/``) and "raw" (``folder/<wnid>/``, seeded split).

    Returns ``None`` if ``folder`` does not exist or holds no image class folders.
    """
    if not folder.is_dir():
        return None
    if (folder / "train").is_dir() and (folder / "test").is_dir():
        train, test = _scan_classes(folder / "train"), _scan_classes(folder / "test")
        _check_same_classes(dataset, train, test, folder)
        fp = {"root": str(folder), "layout": "pre-split train/test (PILOT / SD-LoRA)"}
        return _splits_from_classes(dataset, train, test, image_size=image_size, fingerprint=fp)
    by_class = {k: v for k, v in _scan_classes(folder, exclude=("train", "test")).items() if v}
    if not by_class:
        return None
    train, test = split_per_class(by_class, test_fraction, seed)
    fp = {
        "root": str(folder),
        "layout": "raw folder, seeded per-class split",
        "seed": int(seed),
        "test_fraction": test_fraction,
    }
    return _splits_from_classes(dataset, train, test, image_size=image_size, fingerprint=fp)


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
    _reject_unknown("imagenet_r", options, ["test_fraction", "split_seed"])
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
    _reject_unknown("imagenet_a", options, ["test_fraction", "split_seed"])
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


def _domainnet_dir(root: Path) -> Path:
    """``<root>/domainnet`` or ``<root>/DomainNet``, whichever exists."""
    for name in ("domainnet", "DomainNet"):
        if (root / name).is_dir():
            return root / name
    layouts = [
        f"{root}/domainnet/ (or {root}/DomainNet/) with <domain>/<class>/*.jpg and "
        "<domain>_{train,test}.txt"
    ]
    raise missing_data_error(
        "domainnet", f"{root}/domainnet or {root}/DomainNet", layouts, DOMAINNET_HOWTO.format(root=root)
    )


def _domain_list(domains: str | Sequence[str] | None) -> list[str]:
    """Validate the ``domains`` option (a name, a comma-separated string, or a list)."""
    if domains is None:
        return list(DOMAINNET_DOMAINS)
    names = [d.strip() for d in domains.split(",")] if isinstance(domains, str) else [str(d) for d in domains]
    unknown = [d for d in names if d not in DOMAINNET_DOMAINS]
    if unknown or not names:
        raise ValueError(
            f"domainnet: unknown domain(s) {unknown or names}; choose from {', '.join(DOMAINNET_DOMAINS)}"
        )
    return list(dict.fromkeys(names))


def _read_domainnet_split(folder: Path, domain: str, split: str) -> tuple[Path, list[Path], list[int]]:
    """Read ``<domain>_<split>.txt``: lines ``<relative/path.jpg> <label>``, paths relative to ``folder``."""
    path = folder / f"{domain}_{split}.txt"
    rows = _read_table(path, (str, _nonneg_int), expected="<relative/path.jpg> <label>", right=True)
    paths = [folder / rel for _, rel, _ in rows]
    _check_first_exists("domainnet", paths, path, folder)
    return path, paths, [label for _, _, label in rows]


@register_dataset(
    "domainnet", "DomainNet, 345 classes over 6 domains, standard <domain>_{train,test}.txt splits"
)
def domainnet(
    *,
    data_root: str | None = None,
    image_size: int | None = 224,
    seed: int = 0,
    domains: str | Sequence[str] | None = None,
    **options: Any,
) -> DataSplits:
    """DomainNet from ``<root>/domainnet/`` (or ``DomainNet/``) with its standard split files.

    Args:
        data_root: folder holding ``domainnet/``; see :func:`resolve_data_root`.
        image_size: square side after resize + centre crop, ``None`` keeps the original size.
        seed: unused (the split is fixed by the split files); accepted for a uniform signature.
        domains: domains to include (default all six: clipart, infograph, painting, quickdraw, real, sketch).
        **options: rejected (``ValueError``) if any.

    Returns:
        The splits, domains concatenated in the order given; labels are those of the split files.
    """
    _reject_unknown("domainnet", options, ["domains"])
    names = _domain_list(domains)
    folder = _domainnet_dir(resolve_data_root(data_root))
    missing = [folder / f"{d}_{sp}.txt" for d in names for sp in ("train", "test")]
    missing = [p for p in missing if not p.is_file()]
    if missing:
        layouts = [
            f"{folder}/<domain>/<class>/*.jpg with split files {folder}/<domain>_train.txt and _test.txt"
        ]
        looked = "split file(s) " + ", ".join(map(str, missing))
        raise missing_data_error("domainnet", looked, layouts, DOMAINNET_HOWTO.format(root=folder.parent))
    split_files: list[Path] = []
    lists: dict[str, tuple[list[Path], list[int]]] = {"train": ([], []), "test": ([], [])}
    for domain in names:
        for split in ("train", "test"):
            file, paths, labels = _read_domainnet_split(folder, domain, split)
            split_files.append(file)
            lists[split][0].extend(paths)
            lists[split][1].extend(labels)
    fp = {
        "root": str(folder),
        "layout": "domainnet split files",
        "domains": names,
        "split_files": _split_fingerprint(split_files),
    }
    return _splits_from_lists(
        "domainnet", lists["train"], lists["test"], image_size=image_size, fingerprint=fp
    )


# ----------------------------------------------------------------------------------------------- CUB-200-2011


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
        i: p for _, i, p in _read_table(folder / "images.txt", (int, str), expected="<image_id> <path>")
    }
    labels = {
        i: c
        for _, i, c in _read_table(
            folder / "image_class_labels.txt", (int, label), expected="<image_id> <class_id>"
        )
    }
    split = {
        i: t
        for _, i, t in _read_table(
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
        rows = _read_table(path, (int, str), expected="<class_id> <name>")
        raw = [name for _, _, name in sorted(rows, key=lambda r: r[1])]
    else:
        raw = _names_from_parents([Path(images[i]) for i in images], [labels[i] - 1 for i in images])
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
    _reject_unknown("cub200", options, [])
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
    _check_first_exists("cub200", lists[1][0], needed[0], folder / "images")
    fp = {
        "root": str(folder),
        "layout": "CUB_200_2011 official split",
        "split_files": _split_fingerprint(needed),
    }
    out = _splits_from_lists("cub200", lists[1], lists[0], image_size=image_size, fingerprint=fp)
    out.class_names = _cub_class_names(folder, labels, images)
    return out
