"""DomainNet (345 classes, 6 domains) with its standard <domain>_{train,test}.txt split files."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from clmerge.data.base import DataSplits, register_dataset
from clmerge.data.lookalike import LookalikeSpec, png_pool, register_lookalike, write_class_dirs
from clmerge.data.folders import (
    DOMAINNET_DOMAINS,
    DOMAINNET_HOWTO,
    check_first_exists,
    nonneg_int,
    read_table,
    reject_unknown,
    split_fingerprint,
    splits_from_lists,
    missing_data_error,
    resolve_data_root,
)

__all__ = ["domainnet", "write_domainnet_lookalike"]


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
    rows = read_table(path, (str, nonneg_int), expected="<relative/path.jpg> <label>", right=True)
    paths = [folder / rel for _, rel, _ in rows]
    check_first_exists("domainnet", paths, path, folder)
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
    reject_unknown("domainnet", options, ["domains"])
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
        "split_files": split_fingerprint(split_files),
    }
    return splits_from_lists(
        "domainnet", lists["train"], lists["test"], image_size=image_size, fingerprint=fp
    )


# ----------------------------------------------------------------------------------------------- CUB-200-2011


@register_lookalike("domainnet", classes=345)
def write_domainnet_lookalike(root: Path, spec: LookalikeSpec) -> None:
    """``domainnet/<domain>/<class>/*.png`` plus the ``<domain>_{train,test}.txt`` split files, for the
    domains of ``options.domains`` (all six when not given)."""
    folder, pool = root / "domainnet", png_pool()
    names = [f"class{c:03d}" for c in range(spec.classes)]
    domains = spec.options.get("domains")
    for d in ([domains] if isinstance(domains, str) else (domains or DOMAINNET_DOMAINS)):
        d = str(d).strip()
        for split, n in (("train", spec.n_train), ("test", spec.n_test)):
            rel = write_class_dirs(folder / d, names, n, pool, prefix=f"{split}_")
            lines = [f"{d}/{r} {i // n}" for i, r in enumerate(rel)]
            (folder / f"{d}_{split}.txt").write_text("\n".join(lines) + "\n")
