"""Reader for the IDX format of MNIST and Fashion-MNIST (``.gz`` or raw).

The format: a 4-byte magic number (two zero bytes, a type code, the number of dimensions), one big-endian
uint32 per dimension, then the data. Only unsigned bytes (type 0x08) are used by these datasets.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

__all__ = ["read_idx", "find_idx_files", "IDX_ENV_VAR", "DEBIAN_DATASET_DIR"]

IDX_ENV_VAR = "CLMERGE_DATA"
DEBIAN_DATASET_DIR = Path("/usr/share/datasets")

_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file into a numpy array; raise ``ValueError`` naming the file if it is malformed."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            raw = fh.read()
    except (OSError, EOFError) as exc:
        raise ValueError(f"{path}: cannot read IDX file ({exc})") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _DTYPES:
        raise ValueError(f"{path}: not an IDX file (bad magic number {raw[:4]!r})")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header")
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(_DTYPES[raw[2]])
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(
            f"{path}: IDX payload has {len(raw) - header} bytes, header shape {shape} needs {expected}"
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).copy()


def find_idx_files(
    dataset: str, stems: list[str], *, data_root: str | Path | None = None, hint: str = ""
) -> list[Path]:
    """Locate IDX files for ``dataset``, trying in order: ``data_root``, ``$CLMERGE_DATA``, the Debian location.

    Each candidate directory is ``<dir>/<dataset>/``; each stem may exist as ``stem.gz`` or ``stem``.
    """
    dirs: list[Path] = []
    if data_root:
        dirs.append(Path(data_root) / dataset)
        dirs.append(Path(data_root))
    if os.environ.get(IDX_ENV_VAR):
        dirs.append(Path(os.environ[IDX_ENV_VAR]) / dataset)
    dirs.append(DEBIAN_DATASET_DIR / dataset)
    for d in dirs:
        found = []
        for stem in stems:
            for cand in (d / f"{stem}.gz", d / stem):
                if cand.exists():
                    found.append(cand)
                    break
        if len(found) == len(stems):
            return found
    looked = ", ".join(str(d) for d in dirs)
    raise FileNotFoundError(
        f"{dataset}: data not found: looked for {', '.join(s + '[.gz]' for s in stems)} in {looked}\nfix: {hint}"
    )
