"""Low-rank factors from dense updates (truncated SVD) and atomic writing of adapter folders.

Eckart-Young: the best rank-``k`` approximation of ``Delta W = U S V^T`` in Frobenius norm keeps the ``k``
largest singular values, and its error is the tail's energy,

    ||Delta W - B' A'||_F / ||Delta W||_F = sqrt(sum_{i>k} s_i^2) / sqrt(sum_i s_i^2),

which is what is reported. The factors split the singular values evenly: ``B' = U_k sqrt(S_k)``,
``A' = sqrt(S_k) V_k^T`` (so ``B' A' = U_k S_k V_k^T``; PEFT scale 1 with ``lora_alpha = r``).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from ..merging.sources import MergeInputError
from ..utils.io import write_json

__all__ = ["low_rank_factors", "numerical_rank", "atomic_folder", "check_out_dir", "error_summary"]

# Above this many entries the SVD runs in float32 (float64 doubles its time on LLM-sized matrices);
# the reported error then carries float32 rounding (~1e-7 relative).
_FLOAT64_SVD_MAX = 1 << 22


def low_rank_factors(delta: Tensor, rank: int) -> tuple[Tensor, Tensor, float, float]:
    """Truncated SVD of ``delta`` (out, in) at ``rank``.

    Args:
        delta: the dense update (2-D).
        rank: ``k``; factors are zero-padded to ``k`` columns/rows when ``min(out, in) < k`` (exact there).

    Returns:
        ``(A', B', tail, total)``: ``A'`` (k, in) and ``B'`` (out, k) in float32 with ``B' A'`` the best
        rank-``k`` approximation, and ``tail`` / ``total`` the squared Frobenius norms of the residual and of
        ``delta`` (from the singular values).
    """
    dt = torch.float64 if delta.numel() <= _FLOAT64_SVD_MAX else torch.float32
    u, s, vh = torch.linalg.svd(delta.to(dt), full_matrices=False)
    k = min(rank, s.numel())
    root = s[:k].sqrt()
    b = torch.zeros(delta.shape[0], rank, dtype=torch.float32)
    a = torch.zeros(rank, delta.shape[1], dtype=torch.float32)
    b[:, :k] = (u[:, :k] * root).float()
    a[:k] = (root[:, None] * vh[:k]).float()
    s2 = s.double().square()
    return a, b, float(s2[k:].sum()), float(s2.sum())


def numerical_rank(delta: Tensor) -> int:
    """Singular values above ``s_max * max(out, in) * eps(float32)`` (numpy's ``matrix_rank`` rule at float32
    precision): the rank at which a truncated SVD reproduces ``delta`` to float32 rounding."""
    s = torch.linalg.svdvals(delta.to(torch.float64))
    if s.numel() == 0 or s[0] == 0:
        return 0
    return int((s > s[0] * max(delta.shape) * torch.finfo(torch.float32).eps).sum())


def relative_error(tail: float, total: float) -> float:
    """``sqrt(tail / total)`` (0 for a zero update)."""
    return math.sqrt(tail / total) if total > 0 else 0.0


def error_summary(per_module: dict[str, tuple[float, float]]) -> dict:
    """Per-module and overall relative Frobenius errors from ``{module: (tail, total)}``."""
    rel = {m: relative_error(t, s) for m, (t, s) in per_module.items()}
    tail, total = sum(t for t, _ in per_module.values()), sum(s for _, s in per_module.values())
    return {"per_module_rel_error": rel, "overall_rel_error": relative_error(tail, total),
            "max_rel_error": max(rel.values(), default=0.0)}


def check_out_dir(out: Path, inputs: list[Path] = ()) -> None:
    """Refuse an ``--out`` that names an input, holds one, or holds something already (a new folder
    inside an input folder is fine: nothing there is read)."""
    out = Path(out)
    resolved = out.resolve()
    for p in inputs:
        p = Path(p).resolve()
        if resolved == p or p.is_relative_to(resolved):
            raise MergeInputError(f"--out {out}: is or contains the input {p}; choose a new folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MergeInputError(f"--out {out}: already exists and is not an empty folder; choose a new one")


def atomic_folder(out: Path, fill: Callable[[Path], dict], report_name: str | None = None) -> dict:
    """Build a folder with ``fill(tmp_dir) -> report`` in a temporary sibling, then rename it to ``out``.

    Nothing is left at ``out`` (or beside it) when ``fill`` fails. ``report`` is also written as
    ``report_name`` in the folder when given.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        report = fill(tmp)
        if report_name:
            write_json(tmp / report_name, report)
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; outputs are meant to be shared
        if out.exists():  # an empty folder (check_out_dir refused anything else)
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report
