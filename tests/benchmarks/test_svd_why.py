"""benchmarks/merging/svd_why.py: energy at TSV-M's rank budget and top-k subspace overlap on planted task vectors."""

from __future__ import annotations

import pytest
import torch
from bench_helpers import load_bench


def _load():
    return load_bench("merging", "svd_why")


def test_rank_one_updates_in_one_subspace_and_in_orthogonal_ones():
    why = _load()
    g = torch.Generator().manual_seed(0)
    base = {"fc.weight": torch.randn(8, 6, generator=g), "fc.bias": torch.zeros(8)}
    u = torch.linalg.qr(torch.randn(8, 8, generator=g))[0]
    v = torch.randn(6, generator=g)
    same = [{"fc.weight": base["fc.weight"] + c * torch.outer(u[:, 0], v), "fc.bias": base["fc.bias"]} for c in (1.0, 2.0)]
    got = why.measure(base, same)
    assert got["matrices"] == 1 and got["per_key"]["fc.weight"]["k"] == 3  # ceil(6 / 2)
    assert got["energy_at_k"] == pytest.approx(1.0)  # rank 1 <= k: all energy kept
    # top-3 bases of a rank-1 matrix share the first direction (overlap >= 1/3); not orthogonal
    assert got["overlap"] >= 1 / 3 - 1e-9
    ortho = [{"fc.weight": base["fc.weight"] + torch.outer(u[:, i], v), "fc.bias": base["fc.bias"]} for i in (0, 1)]
    assert why.measure(base, ortho)["per_key"]["fc.weight"]["energy_at_k"] == pytest.approx(1.0)
    full = [{"fc.weight": base["fc.weight"] + torch.eye(8, 6), "fc.bias": base["fc.bias"]}] * 2
    assert why.measure(base, full)["energy_at_k"] == pytest.approx(3 / 6)  # flat spectrum: k / r of the energy
