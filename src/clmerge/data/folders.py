"""Image folders on disk: the generic ``image_folder`` source and the helpers the other folder sources use
(``imagenet.py``, ``domainnet.py``, ``cub.py``).

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
from clmerge.data.lookalike import LookalikeSpec, png_pool, register_lookalike, write_presplit
from clmerge.utils.io import sha256_file
from clmerge.utils.inpaths import read_bytes as read_input_bytes

__all__ = [
    "DATA_ENV_VAR",
    "IMAGE_EXTENSIONS",
    "DOMAINNET_DOMAINS",
    "resolve_data_root",
    "missing_data_error",
    "split_per_class",
    "image_folder",
    "write_image_folder_lookalike",
    # the building blocks of the folder-based sources (cub, domainnet, imagenet, omniglot, tinyimagenet)
    "reject_unknown",
    "subdirs",
    "images_in",
    "scan_classes",
    "check_same_classes",
    "splits_from_classes",
    "splits_from_lists",
    "names_from_parents",
    "read_utf8_text",
    "nonneg_int",
    "read_table",
    "check_first_exists",
    "split_fingerprint",
]

DATA_ENV_VAR = "CLMERGE_DATA"
# raster formats Pillow reads without extra libraries; images are converted to RGB (or L) on load
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff", ".ppm", ".pgm", ".pbm",
                    ".pnm", ".tga")
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
    """Build the uniform "data not found" error: three lines (what and where, the fix, the accepted layouts),
    so the command line shows it whole (``print_error`` keeps at most three).

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
        f"{dataset}: data not found: looked for {looked_for} "
        f"(the root is data_root, else ${DATA_ENV_VAR}, else ./data)\n"
        f"fix: {howto.removeprefix('Get it: ')}\n"
        f"Accepted layouts: {accepted}"
    )


def reject_unknown(dataset: str, options: dict[str, Any], accepted: Iterable[str]) -> None:
    """Raise ``ValueError`` if ``options`` holds keys the builder does not understand."""
    if options:
        known = ", ".join(sorted(accepted)) or "none"
        raise ValueError(f"{dataset}: unknown option(s) {sorted(options)}; accepted options: {known}")


def _is_image(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS and not path.name.startswith(".")


def subdirs(folder: Path) -> list[Path]:
    """Visible sub-folders of ``folder``, sorted by name."""
    return sorted(
        (p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")), key=lambda p: p.name
    )


def images_in(folder: Path) -> list[Path]:
    """Image files anywhere below ``folder`` (hidden entries skipped), sorted by relative path."""
    found = [p for p in folder.rglob("*") if _is_image(p)]
    found = [p for p in found if not any(part.startswith(".") for part in p.relative_to(folder).parts)]
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def scan_classes(folder: Path, *, exclude: Iterable[str] = ()) -> ByClass:
    """Map each class sub-folder name of ``folder`` (sorted) to its sorted image files."""
    skip = set(exclude)
    return {d.name: images_in(d) for d in subdirs(folder) if d.name not in skip}


def check_same_classes(dataset: str, train: ByClass, test: ByClass, root: Path) -> None:
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


def splits_from_classes(
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


def splits_from_lists(
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
    names = names_from_parents(train[0] + test[0], train[1] + test[1])
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


def names_from_parents(paths: Sequence[Path], labels: Sequence[int]) -> list[str]:
    """Class names from the files' parent folders; ``[]`` if a label maps to several folders or to none."""
    by_label: dict[int, str] = {}
    for path, label in zip(paths, labels, strict=True):
        if by_label.setdefault(int(label), path.parent.name) != path.parent.name:
            return []
    if not by_label or set(by_label) != set(range(max(by_label) + 1)):
        return []
    return [by_label[i] for i in range(len(by_label))]


def read_utf8_text(path: Path) -> str:
    """Read a UTF-8 text file; raise ``ValueError`` naming it if it is not text."""
    data = read_input_bytes(path, kind="text")  # a regular file under the text cap (utils.inpaths)
    try:
        return data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")  # as text mode reads it
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a UTF-8 text file ({exc})") from exc


def nonneg_int(text: str) -> int:
    """``text`` as an int >= 0; raise ``ValueError`` otherwise."""
    value = int(text)
    if value < 0:
        raise ValueError(f"negative value {value}")
    return value


def read_table(
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
    for lineno, line in enumerate(read_utf8_text(path).splitlines(), 1):
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


def check_first_exists(dataset: str, paths: Sequence[Path], split_file: Path, base: Path) -> None:
    """Fail early, with a clear message, if the first file named by a split file is missing."""
    if paths and not paths[0].exists():
        raise FileNotFoundError(
            f"{dataset}: {split_file} names {paths[0]}, which does not exist; the paths in that file are "
            f"read relative to {base}. Extract the images there (or fix data_root)."
        )


def split_fingerprint(files: Sequence[Path]) -> dict[str, str]:
    """``{file name: sha256}`` for the split files used."""
    return {f.name: sha256_file(f) for f in files}


# ----------------------------------------------------------------------------------------------- image_folder


def _folder_layout(
    dataset: str, root: Path, test_fraction: float, seed: int
) -> tuple[ByClass, ByClass, dict]:
    """Read ``root/{train,test}/<class>/`` or ``root/<class>/`` (then split); return the splits and layout."""
    has_train, has_test = (root / "train").is_dir(), (root / "test").is_dir()
    if has_train and has_test:
        train, test = scan_classes(root / "train"), scan_classes(root / "test")
        check_same_classes(dataset, train, test, root)
        return train, test, {"layout": "train/test class folders"}
    if has_train or has_test:
        present, absent = ("train", "test") if has_train else ("test", "train")
        raise FileNotFoundError(
            f"{dataset}: found {root / present} but not {root / absent}; a pre-split folder needs both "
            f"(or put the class folders directly under {root} for a seeded per-class split)"
        )
    by_class = {k: v for k, v in scan_classes(root).items() if v}
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
    reject_unknown("image_folder", options, ["test_fraction", "split_seed", "subdir"])
    seed = seed if split_seed is None else split_seed
    root = resolve_data_root(data_root) / subdir if subdir else resolve_data_root(data_root)
    layouts = [
        f"{root}/train/<class>/*.jpg and {root}/test/<class>/*.jpg",
        f"{root}/<class>/*.jpg (seeded split)",
    ]
    howto = f"Point data_root at the folder (image extensions: {', '.join(IMAGE_EXTENSIONS)})."
    if not root.is_dir() or not subdirs(root):
        raise missing_data_error("image_folder", f"class folders under {root}", layouts, howto)
    train, test, fp = _folder_layout("image_folder", root, test_fraction, seed)
    if not train:
        raise missing_data_error(
            "image_folder", f"image files in the class folders under {root}", layouts, howto
        )
    return splits_from_classes(
        "image_folder", train, test, image_size=image_size, fingerprint={"root": str(root), **fp}
    )


# ------------------------------------------------------------------------------------------- ImageNet-R / -A


@register_lookalike("image_folder")
def write_image_folder_lookalike(root: Path, spec: LookalikeSpec) -> None:
    """``<root>[/<options.subdir>]/{train,test}/class<NNN>/*.png``."""
    sub = spec.options.get("subdir")
    names = [f"class{c:03d}" for c in range(spec.classes)]
    write_presplit(root / sub if sub else root, names, spec.n_train, spec.n_test, png_pool())
