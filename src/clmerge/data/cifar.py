"""CIFAR-100, python version (``cifar-100-python/{train,test,meta}``), read without unpickling arbitrary code.

The CIFAR files are pickled dicts. :class:`RestrictedUnpickler` only lets through the few numpy globals that
rebuild an ``ndarray`` / ``dtype`` (plus a latin-1-only ``_codecs.encode``, which Python 3 protocol-2 pickles
of arrays use for the raw bytes); any other global (``os.system``, ``builtins.eval``, ...) is refused with a
``ValueError`` naming the file, so a tampered file cannot run code.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clmerge.data.base import DataSplits, TensorData, register_dataset
from clmerge.data.folders import missing_data_error, resolve_data_root
from clmerge.data.lookalike import LookalikeSpec, register_lookalike
from clmerge.utils.io import sha256_file
from clmerge.errors import InputError
from clmerge.utils.inpaths import open_input

__all__ = ["RestrictedUnpickler", "load_cifar_pickle", "cifar100", "CIFAR100_HOWTO", "write_cifar100_lookalike"]

CIFAR100_HOWTO = (
    "Get it: download the CIFAR-100 python version tarball cifar-100-python.tar.gz "
    "(https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz) and extract it into {root} "
    "(it creates cifar-100-python/ with train, test and meta)."
)

_LABEL_KEYS = {
    "fine": ("fine_labels", "fine_label_names", 100),
    "coarse": ("coarse_labels", "coarse_label_names", 20),
}


class _ForbiddenGlobal(ValueError):
    """A pickle asked for a global outside the allow-list."""


def _latin1_encode(text: str, encoding: str = "utf-8") -> bytes:
    """``_codecs.encode`` restricted to the latin-1 use Python 3 pickles make of it."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise _ForbiddenGlobal(f"_codecs.encode is only allowed with latin1, got encoding {encoding!r}")
    return text.encode("latin1")


def _allowed_globals() -> dict[tuple[str, str], Any]:
    """The allow-list: ``(module, name)`` as written in the pickle -> the object to use."""
    try:  # numpy >= 2
        from numpy._core import multiarray, numeric
    except ImportError:  # numpy 1.x
        from numpy.core import multiarray, numeric  # type: ignore[no-redef]
    allowed: dict[tuple[str, str], Any] = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    for mod in ("numpy.core", "numpy._core"):
        allowed[(f"{mod}.multiarray", "_reconstruct")] = multiarray._reconstruct
        allowed[(f"{mod}.numeric", "_frombuffer")] = numeric._frombuffer
    allowed[("_codecs", "encode")] = _latin1_encode
    return allowed


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the numpy globals needed to rebuild arrays.

    Args:
        file: binary file object.
        path: the file's path, for error messages.
    """

    def __init__(self, file: io.BufferedIOBase, path: Path) -> None:
        super().__init__(file, encoding="bytes")
        self.path = path
        self.allowed = _allowed_globals()

    def find_class(self, module: str, name: str) -> Any:
        """Return an allow-listed global; raise ``ValueError`` naming the file and the global otherwise."""
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        raise _ForbiddenGlobal(
            f"{self.path}: refusing to unpickle forbidden global {module}.{name} (only numpy array globals "
            f"are allowed; the file is not a genuine CIFAR-100 pickle or has been tampered with)"
        )


def load_cifar_pickle(path: str | Path) -> dict[str, Any]:
    """Load one CIFAR pickle safely; keys are returned as ``str``.

    Args:
        path: the pickle file.

    Returns:
        The top-level dict, with ``bytes`` keys decoded.

    Raises:
        ValueError: the file is not a readable pickle of a dict, or references a forbidden global.
    """
    path = Path(path)
    try:  # through the input boundary: a regular file under the data cap, never a FIFO or a folder
        with open_input(path, kind="data") as fh:
            obj = RestrictedUnpickler(fh, path).load()
    except _ForbiddenGlobal as exc:
        raise ValueError(str(exc) if str(exc).startswith(str(path)) else f"{path}: {exc}") from None
    except (FileNotFoundError, InputError):
        raise
    except (
        Exception
    ) as exc:  # a corrupt pickle can fail in many ways (UnpicklingError, EOFError, TypeError, ...)
        raise ValueError(f"{path}: not a readable CIFAR-100 pickle ({type(exc).__name__}: {exc})") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a pickled dict, got {type(obj).__name__}")
    return {k.decode("latin1") if isinstance(k, bytes) else str(k): v for k, v in obj.items()}


def _images_and_labels(path: Path, label_kind: str) -> tuple[torch.Tensor, np.ndarray]:
    """Read ``data`` (N, 3072) uint8 and the chosen labels from one split file; validate shapes and ranges."""
    d = load_cifar_pickle(path)
    key, _, n_classes = _LABEL_KEYS[label_kind]
    if "data" not in d or key not in d:
        raise ValueError(f"{path}: missing key 'data' or {key!r} (found keys: {sorted(d)})")
    data = d["data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        shape = getattr(data, "shape", None)
        raise ValueError(
            f"{path}: 'data' must be a uint8 array of shape (N, 3072), got {type(data).__name__} {shape}"
        )
    try:
        labels = np.asarray(d[key], dtype=np.int64).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {key!r} is not a list of integers ({exc})") from exc
    if len(labels) != len(data):
        raise ValueError(f"{path}: {len(data)} images but {len(labels)} entries in {key!r}")
    if len(labels) and (labels.min() < 0 or labels.max() >= n_classes):
        raise ValueError(
            f"{path}: {key!r} must lie in [0, {n_classes - 1}], got [{labels.min()}, {labels.max()}]"
        )
    images = torch.from_numpy(np.ascontiguousarray(data).reshape(-1, 3, 32, 32).copy())
    return images, labels


def _class_names(path: Path, label_kind: str) -> list[str]:
    """Read the label names for ``label_kind`` from ``meta`` (empty list if absent)."""
    names = load_cifar_pickle(path).get(_LABEL_KEYS[label_kind][1], [])
    if not isinstance(names, (list, tuple)):
        raise ValueError(f"{path}: {_LABEL_KEYS[label_kind][1]!r} must be a list of names")
    return [n.decode("utf-8") if isinstance(n, bytes) else str(n) for n in names]


def _cifar_files(root: Path) -> dict[str, Path]:
    """Paths of ``train``, ``test``, ``meta`` in ``root/cifar-100-python``; raise if train/test is missing."""
    folder = root / "cifar-100-python"
    files = {name: folder / name for name in ("train", "test", "meta")}
    missing = [str(p) for name, p in files.items() if name != "meta" and not p.is_file()]
    if missing:
        layouts = [
            f"{folder}/train, {folder}/test and {folder}/meta (the python version, not binary or matlab)"
        ]
        raise missing_data_error("cifar100", ", ".join(missing), layouts, CIFAR100_HOWTO.format(root=root))
    return files


@register_dataset(
    "cifar100", "CIFAR-100 python version, 100 fine classes or 20 superclasses (label_kind=coarse)"
)
def cifar100(
    *,
    data_root: str | None = None,
    image_size: int | None = 224,
    seed: int = 0,
    label_kind: str = "fine",
    **options: Any,
) -> DataSplits:
    """CIFAR-100 from ``<root>/cifar-100-python/{train,test,meta}``, as in-memory uint8 images (N, 3, 32, 32).

    Args:
        data_root: folder holding ``cifar-100-python/``; see :func:`~clmerge.data.folders.resolve_data_root`.
        image_size: unused: images stay 32x32 (the backbone resizes); accepted for a uniform signature.
        seed: unused (the split is official); accepted for a uniform signature.
        label_kind: ``"fine"`` (100 classes) or ``"coarse"`` (20 superclasses, e.g. CIFAR100-SuperClass).
        **options: rejected (``ValueError``) if any.

    Returns:
        The splits, with the fine (or coarse) label names as ``class_names`` when ``meta`` is present.
    """
    if options:
        raise ValueError(f"cifar100: unknown option(s) {sorted(options)}; accepted options: label_kind")
    if label_kind not in _LABEL_KEYS:
        raise ValueError(f"cifar100: label_kind must be 'fine' or 'coarse', got {label_kind!r}")
    files = _cifar_files(resolve_data_root(data_root))
    x_tr, y_tr = _images_and_labels(files["train"], label_kind)
    x_te, y_te = _images_and_labels(files["test"], label_kind)
    names = _class_names(files["meta"], label_kind) if files["meta"].is_file() else []
    used = [p for p in files.values() if p.is_file()]
    fingerprint = {
        "root": str(files["train"].parent),
        "layout": "cifar-100-python",
        "label_kind": label_kind,
        "n_train": len(y_tr),
        "n_test": len(y_te),
        "files": {p.name: sha256_file(p) for p in used},
    }
    return DataSplits(
        train=TensorData(x_tr, y_tr, name="cifar100/train"),
        test=TensorData(x_te, y_te, name="cifar100/test"),
        class_names=names,
        fingerprint=fingerprint,
    )


@register_lookalike("cifar100", classes=lambda options: 20 if options.get("label_kind") == "coarse" else 100)
def write_cifar100_lookalike(root: Path, spec: LookalikeSpec) -> None:
    """``cifar-100-python/{train,test,meta}``: the python-version pickles (plain dicts, lists and a uint8
    array), with all 100 fine classes whatever ``spec.classes`` is."""
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, n in (("train", spec.n_train), ("test", spec.n_test)):
        fine = [c for c in range(100) for _ in range(n)]
        d = {"fine_labels": fine, "coarse_labels": [c % 20 for c in fine],
             "data": rng.integers(0, 256, size=(len(fine), 3072), dtype=np.uint8)}
        (folder / name).write_bytes(pickle.dumps(d, protocol=2))
    meta = {"fine_label_names": [f"fine{i}" for i in range(100)], "coarse_label_names": [f"c{i}" for i in range(20)]}
    (folder / "meta").write_bytes(pickle.dumps(meta, protocol=2))
