"""Look-alike datasets: a few tiny files in the on-disk layout a reader expects (``clmerge run --dry-run``).

The layout of a source is known in one place, beside its reader: each reader module registers a writer of its
layout here (``@register_lookalike("cub200", classes=200)``), and the dry run asks :func:`write_lookalike` for
"a look-alike of dataset X under this folder". Sources that need no files (bundled ones) register none.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..registry import Registry

__all__ = ["LOOKALIKES", "LookalikeSpec", "register_lookalike", "lookalike_class_count", "write_lookalike",
           "png_pool", "write_class_dirs", "write_presplit"]


@dataclass(frozen=True)
class LookalikeSpec:
    """What a writer is asked for: ``classes`` classes of ``n_train`` + ``n_test`` images each, and the
    dataset's ``scenario.options`` (a writer reads the options that change its layout, e.g. a subfolder)."""

    classes: int
    n_train: int
    n_test: int
    options: dict[str, Any] = field(default_factory=dict)


class LookalikeEntry(NamedTuple):
    """A registered writer and the source's class count (a number, a function of the options, or None)."""

    fn: Callable[[Path, LookalikeSpec], None]
    classes: int | Callable[[dict[str, Any]], int] | None


LOOKALIKES: Registry = Registry("look-alike dataset", key="scenario.dataset")  # name -> LookalikeEntry


def register_lookalike(name: str, *, classes: int | Callable[[dict[str, Any]], int] | None = None) -> Callable:
    """Register ``fn(root, spec)``, the writer of dataset ``name``'s layout under ``root``; ``classes`` is
    the source's own class count when a config does not fix it (None: the dry run derives one)."""

    def deco(fn):
        LOOKALIKES.register(name, LookalikeEntry(fn, classes), description=f"look-alike files of {name}",
                            module=fn.__module__)
        return fn

    return deco


def lookalike_class_count(name: str, options: dict[str, Any]) -> int | None:
    """The class count of dataset ``name``'s real files (None: unknown, or the source has no look-alike)."""
    entry = LOOKALIKES.get(name, None)
    if entry is None or entry.classes is None:
        return None
    return entry.classes(options) if callable(entry.classes) else int(entry.classes)


def write_lookalike(name: str, root: Path, spec: LookalikeSpec) -> bool:
    """Write the look-alike files of dataset ``name`` under ``root``; False when the source needs none."""
    entry = LOOKALIKES.get(name, None)
    if entry is None:
        return False
    entry.fn(Path(root), spec)
    return True


def png_pool(n: int = 8, size: int = 8) -> list[bytes]:
    """A few distinct tiny PNG images (bytes), reused for every file (fast to write); the readers resize them
    to the backbone's input size as they would real images."""
    from ..utils.extras import require_extra

    Image = require_extra("PIL.Image", what="look-alike image files")
    out = []
    for i in range(n):
        arr = np.full((size, size, 3), (37 * i) % 256, dtype=np.uint8)
        arr[: size // 2, :, i % 3] = 255 - arr[0, 0, 0]
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def write_class_dirs(folder: Path, names: list[str], n: int, pool: list[bytes], prefix: str = "img") -> list[str]:
    """Write ``folder/<name>/<prefix><i>.png`` for every class; return the relative paths."""
    rel = []
    for c, name in enumerate(names):
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            (folder / name / f"{prefix}{i}.png").write_bytes(pool[(c + i) % len(pool)])
            rel.append(f"{name}/{prefix}{i}.png")
    return rel


def write_presplit(folder: Path, names: list[str], n_train: int, n_test: int, pool: list[bytes]) -> None:
    """``folder/{train,test}/<class>/*.png``: the pre-split class-folder layout."""
    write_class_dirs(folder / "train", names, n_train, pool)
    write_class_dirs(folder / "test", names, n_test, pool)
