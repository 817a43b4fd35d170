"""HALRP fixes from the audit against the official code: the official pruning count and the column-scale quirk."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from clmerge.methods.halrp.layers import halrp_layers, wrap_halrp_layers
from clmerge.adapters.task_modules import TaskBatchNorm, wrap_batchnorms
from clmerge.methods.halrp import HALRP, HALRPOptions
from clmerge.methods.halrp import low_rank_perturbation as lrp


# -- column scalings s: Eq. 20 and the official code's broadcasting quirk --------------------------------------
def _columns_paper(wf: torch.Tensor, wb: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Eq. 20 column by column: s_i = sum_j r_j wf_ji wb_ji / sum_j (r_j wb_ji)^2 (kernel positions summed)."""
    out = []
    for i in range(wb.shape[1]):
        rj = r.view(-1, *[1] * (wb.dim() - 2))  # (J[, 1, 1]) against the slice (J[, d, d])
        out.append(float((rj * wb[:, i] * wf[:, i]).sum() / (rj * wb[:, i]).pow(2).sum()))
    return torch.tensor(out, dtype=torch.float64)


def _columns_code(wf: torch.Tensor, wb: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The official loop as it runs: r viewed with the weight's rank, (J, 1[, 1, 1]), times the column slice
    (J[, d, d]) broadcasts to an outer product (J, J[, d, d]) before the sum."""
    out = []
    for i in range(wb.shape[1]):
        rv = r.view(-1, *[1] * (wb.dim() - 1))
        assert (rv * wb[:, i]).shape == (wb.shape[0], *wb[:, i].shape)  # the quirk: one axis too many
        out.append(float((rv * wb[:, i] * wf[:, i]).sum() / (rv * wb[:, i]).pow(2).sum()))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("shape", [(5, 4), (6, 3, 3, 3)])
def test_column_scale_paper_and_code_match_transcriptions(shape):
    g = torch.Generator().manual_seed(3)
    wb = torch.randn(shape, generator=g, dtype=torch.float64)
    wf = 0.7 * wb + 0.2 * torch.randn(shape, generator=g, dtype=torch.float64)
    r_p, s_p = lrp.least_squares_scalings(wf, wb)  # default: the paper
    r_c, s_c = lrp.least_squares_scalings(wf, wb, column_scale="code")
    torch.testing.assert_close(r_p, r_c)  # Eq. 19 is the same in both
    torch.testing.assert_close(s_p, _columns_paper(wf, wb, r_p), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s_c, _columns_code(wf, wb, r_c), rtol=1e-12, atol=1e-12)
    assert (s_p - s_c).abs().max() > 1e-3  # the two rules differ on generic weights


def test_column_scale_rejects_unknown_rule():
    with pytest.raises(ValueError, match="column_scale"):
        lrp.least_squares_scalings(torch.ones(2, 2), torch.ones(2, 2), column_scale="nope")


# -- the pruning budget: the official count_parameter(sparse=False) -------------------------------------------
class _Heads(nn.Module):
    def __init__(self, n_tasks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 2) for _ in range(n_tasks)])


class _Net(nn.Module):
    def __init__(self, n_tasks: int) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(2, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(32, 16),
                                      nn.BatchNorm1d(16))
        self.head = _Heads(n_tasks)


def _model_with_tasks(n_tasks: int = 3, rank: int = 4) -> tuple[_Net, int]:
    torch.manual_seed(0)
    net = _Net(n_tasks)
    base_size = sum(p.numel() for p in net.backbone.parameters()) + sum(p.numel() for p in net.head.blocks[0]
                                                                        .parameters())  # official baseSize
    wrap_halrp_layers(net.backbone)
    wrap_batchnorms(net.backbone)
    with torch.no_grad():
        for t in range(1, n_tasks):
            for layer in halrp_layers(net.backbone).values():
                f = layer.add_task(t, rank)
                for p in f.parameters():
                    p.normal_()
            for m in net.backbone.modules():
                if isinstance(m, TaskBatchNorm):
                    m.add_task()
    return net, base_size


def _official_dense_growth(net: _Net, base_size: int, t: int) -> float:
    """count_parameter(sparse=False) / baseSize - 1: r, s, every U'/V' entry, BN parameters(), head; no biases."""
    total = base_size
    for k in range(1, t + 1):
        for layer in halrp_layers(net.backbone).values():
            f = layer.factors(k)
            total += f.r.numel() + f.s.numel() + f.u.numel() + f.v.numel()
        for m in net.backbone.modules():
            if isinstance(m, TaskBatchNorm):
                total += sum(p.numel() for p in m.per_task[k].parameters())
        total += sum(p.numel() for p in net.head.blocks[k].parameters())
    return total / base_size - 1


def _method(net: _Net, **options) -> HALRP:
    method = HALRP(HALRPOptions(**options))
    method.model = net
    return method


def test_code_prune_rate_uses_the_official_dense_count():
    net, base_size = _model_with_tasks()
    with torch.no_grad():  # an earlier pruning left zeros: the dense and the non-zero counts now differ
        for layer in halrp_layers(net.backbone).values():
            layer.factors(1).u.zero_()
            layer.factors(1).v[::2] = 0.0
    q = 0.7  # budget 0.3, exceeded
    inc = _official_dense_growth(net, base_size, 2)
    assert _method(net, prune_q=q)._prune_rate(2) == pytest.approx(1 - (1 - q) / inc, rel=1e-12)
    # the pre-fix rule (non-zero count with BN running statistics) gives another rate, kept as an option
    old = _method(net, prune_q=q, prune_budget="nonzero_count")
    assert old._prune_rate(2) == pytest.approx(1 - (1 - q) / old.growth_parts(2)["total"], rel=1e-12)
    assert abs(old._prune_rate(2) - (1 - (1 - q) / inc)) > 0.05


def test_code_prune_rate_none_below_budget():
    net, base_size = _model_with_tasks()
    inc = _official_dense_growth(net, base_size, 2)
    assert _method(net, prune_q=1 - inc * 1.01)._prune_rate(2) is None  # inc < 1 - q: no pruning
    assert _method(net, prune_q=1 - inc * 0.99)._prune_rate(2) is not None


def test_code_pruning_bounds_the_dense_lowrank_part():
    """Re-pruning with the dense count: each task keeps at most a share (1-q)/inc of its U'/V' entries."""
    net, base_size = _model_with_tasks(n_tasks=4)
    method = _method(net, prune_q=0.5, prune_abs=0.0)
    for t in (2, 3):
        rate = method._prune_rate(t)
        assert rate is not None and method._prune(t) > 0
        for k in range(1, t + 1):
            vals = torch.cat([torch.cat([layer.factors(k).u.flatten(), layer.factors(k).v.flatten()])
                              for layer in halrp_layers(net.backbone).values()])
            assert float((vals == 0).double().mean()) >= rate - 1 / len(vals)  # percentile interpolation
