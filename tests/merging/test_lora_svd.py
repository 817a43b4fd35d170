"""Truncated SVD for adapters: full (Eckart-Young optimum) and randomized (Halko et al. 2011) factors."""

from __future__ import annotations

import pytest
import torch

from clmerge.merging.io import lora_svd
from clmerge.merging.io.lora_svd import low_rank_factors, numerical_rank
from clmerge.errors import UsageError


def _decaying(m: int, n: int, seed: int = 0) -> torch.Tensor:
    """An (m, n) matrix with singular values 0.8^i, i < min(m, n, 64)."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n, 64)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    return (u * 0.8 ** torch.arange(k, dtype=torch.float64)) @ v.T


def test_full_svd_error_is_the_tail_share_and_factors_are_optimal():
    d = _decaying(40, 30)
    low = low_rank_factors(d, 5, "full")
    s = torch.linalg.svdvals(d)
    assert low.svd == "full" and low.a.shape == (5, 30) and low.b.shape == (40, 5)
    assert low.tail == pytest.approx(float(s[5:].square().sum()), rel=1e-9)
    assert low.total == pytest.approx(float(s.square().sum()), rel=1e-12)
    resid = d - (low.b.double() @ low.a.double())
    assert float(resid.square().sum()) == pytest.approx(low.tail, rel=1e-5)
    # singular values split evenly between the factors
    torch.testing.assert_close(low.b.norm(dim=0).square(), s[:5].float(), rtol=1e-5, atol=0)
    # rank above min(out, in): clamped to it (exact), no zero-padded rows or columns
    full = low_rank_factors(d, 40, "full")
    assert full.tail < 1e-20 and full.a.shape[0] == full.b.shape[1] == min(d.shape)


def test_randomized_svd_near_the_optimum_and_exact_on_low_rank(monkeypatch):
    monkeypatch.setattr(lora_svd, "_RANDOMIZED_MIN_SIDE", 256)  # "auto" switches at 1024; smaller is faster
    d = _decaying(300, 280).float()
    rnd, opt = low_rank_factors(d, 16), low_rank_factors(d, 16, "full")
    assert rnd.svd == "randomized" and opt.svd == "full"
    err_r, err_o = (rnd.tail / rnd.total) ** 0.5, (opt.tail / opt.total) ** 0.5
    assert err_o * (1 - 1e-5) <= err_r <= 1.005 * err_o
    resid = d.double() - rnd.b.double() @ rnd.a.double()
    assert float(resid.square().sum()) == pytest.approx(rnd.tail, rel=1e-4)  # the reported error is measured
    g = torch.Generator().manual_seed(1)
    lr = torch.randn(300, 8, generator=g) @ torch.randn(8, 280, generator=g)
    exact = low_rank_factors(lr, 8, "randomized")
    assert (exact.tail / exact.total) ** 0.5 < 1e-5
    assert numerical_rank(lr) == 8


def test_svd_mode_checked():
    with pytest.raises(UsageError, match="--svd 'fast'"):
        low_rank_factors(torch.ones(3, 3), 1, "fast")
