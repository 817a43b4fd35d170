"""HALRP growth accounting: total = U'V' part + fixed part (r, s, BN, heads); what the pruning budget governs."""

from __future__ import annotations

import pytest

from clmerge.config import parse_config
from clmerge.engine.run import run_experiment

from method_helpers import tiny_cfg


@pytest.mark.parametrize("budget_mode", ["code", "total"])
def test_growth_parts_and_budget(tmp_path, budget_mode):
    q = 0.7  # budget 1 - q = 30% growth
    data = tiny_cfg("halrp", prune_q=q, prune_budget=budget_mode)
    mm = run_experiment(parse_config(data), tmp_path / budget_mode)["method_metrics"]
    for tot, low, fix in list(zip(mm["growth"], mm["growth_lowrank"], mm["growth_fixed"]))[1:]:  # task 0 = base
        assert tot == pytest.approx(low + fix) and low > 0 and fix > 0
    budget = 1 - q
    assert mm["pruned_entries"][-1] > 0
    if budget_mode == "code":
        # the code's rate 1 - b/growth keeps a share b/growth of U'V' (per task), so the U'V' part ends within
        # the budget, but r, s, BN and heads are never pruned and the total can exceed it
        assert mm["growth_lowrank"][-1] <= budget + 1e-9
    else:
        assert mm["growth"][-1] <= budget + 1e-3  # percentile ties can leave a handful of extra entries
