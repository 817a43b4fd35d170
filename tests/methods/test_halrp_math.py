"""HALRP closed forms (Li et al., TKDE 2024): Eqs. 19-20 vs a generic least-squares solve, Eq. 1, the
global cut (Eq. 11)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from clmerge.methods.halrp import low_rank_perturbation as lrp


def _lstsq_scalar(a: torch.Tensor, b: torch.Tensor) -> float:
    """argmin_x ||b - x a||^2 by a generic least-squares solver."""
    return float(torch.linalg.lstsq(a.reshape(-1, 1), b.reshape(-1, 1)).solution)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.sampled_from([0, 1, 3]), st.integers(0, 10_000))
def test_scalings_equal_generic_least_squares(J, I, d, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (J, I) if d == 0 else (J, I, d, d)
    wb = torch.randn(shape, generator=g, dtype=torch.float64)
    wf = torch.randn(shape, generator=g, dtype=torch.float64)
    r, s = lrp.least_squares_scalings(wf, wb)
    for j in range(J):  # Eq. 19: row j of W^free against row j of W^base (kernel positions included)
        assert abs(float(r[j]) - _lstsq_scalar(wb[j], wf[j])) < 1e-8
    rwb = r.view(-1, *[1] * (wb.dim() - 1)) * wb
    for i in range(I):  # Eq. 20: column i of W^free against column i of R W^base
        assert abs(float(s[i]) - _lstsq_scalar(rwb[:, i], wf[:, i])) < 1e-8


def test_scalings_recover_exact_transition():
    g = torch.Generator().manual_seed(0)
    wb = torch.randn(5, 4, 3, 3, generator=g, dtype=torch.float64)
    r0, s0 = torch.rand(5, generator=g, dtype=torch.float64) + 0.5, torch.ones(4, dtype=torch.float64)
    wf = lrp.scaled_base(wb, r0, s0)
    r, s = lrp.least_squares_scalings(wf, wb)
    torch.testing.assert_close(r, r0)
    torch.testing.assert_close(lrp.residual_matrix(wf, wb, r, s), torch.zeros(5, 4, dtype=torch.float64))


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 7), st.integers(1, 7), st.integers(0, 7), st.integers(0, 10_000))
def test_svd_truncation_error_is_the_tail(J, I, k, seed):
    b = torch.randn(J, I, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    k = min(k, min(J, I))
    u, v, sigma = lrp.svd_factors(b, k)
    err = torch.linalg.norm(b - u @ v)  # Frobenius
    assert abs(float(err) - float(lrp.truncation_error(sigma, k))) < 1e-9
    assert abs(float(err) ** 2 - float(sigma[k:].pow(2).sum())) < 1e-9


def test_conv_residual_is_spatial_mean():
    wb = torch.randn(3, 2, 2, 2, dtype=torch.float64)
    wf = wb.clone()
    wf[:, :, 0, 0] += 4.0  # one kernel position moved: B^free = mean over d x d = 1
    r, s = torch.ones(3, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    torch.testing.assert_close(lrp.residual_matrix(wf, wb, r, s), torch.ones(3, 2, dtype=torch.float64))


def test_global_selection_hand_example():
    # layer A: g=1, sigma^2 = [50, 10, 1]; layer B: g=2 (conv, c=4 -> x8), sigma^2 = [4, 2, 0.5]
    sig_a, sig_b = torch.tensor([50.0, 10.0, 1.0]).sqrt(), torch.tensor([4.0, 2.0, 0.5]).sqrt()
    scores = lrp.component_scores([sig_a, sig_b], [1.0, 2.0], [1, 4])
    torch.testing.assert_close(scores[1], torch.tensor([32.0, 16.0, 4.0], dtype=torch.float64))
    # pooled, sorted: 50 (A), 32 (B), 16 (B), 10 (A), 4 (B), 1 (A); total 113
    # cumulative shares: .442, .726, .867, .956, .991, 1.0
    assert lrp.global_rank_selection(scores, 0.7) == [1, 1]  # first share > .7 is the 2nd -> keep 50, 32
    assert lrp.global_rank_selection(scores, 0.8) == [1, 2]  # > .8 at the 3rd -> keep 50, 32, 16
    assert lrp.global_rank_selection(scores, 0.9) == [2, 2]  # > .9 at the 4th -> 50, 32, 16, 10
    assert lrp.global_rank_selection(scores, 0.95) == [2, 2]  # .956 > .95 at the 4th as well
    assert lrp.global_rank_selection(scores, 0.99) == [2, 3]  # .991 at the 5th
    assert lrp.global_rank_selection(scores, 1.0) == [3, 3]
    assert lrp.global_rank_selection(scores, 0.3) == [1, 1]  # layer B clamped up to rank 1
    assert lrp.global_rank_selection(scores, 1.0, upper_rank=2) == [2, 2]  # clamped down to upper_rank
