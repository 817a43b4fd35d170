"""clmerge/configs/paper: every HALRP paper setting parses, has 5 valid task orders, and builds its network."""

from __future__ import annotations


import pytest
import torch

from clmerge.config import load_config
from clmerge.models import build_backbone
from clmerge.paper_configs import PAPER_DIR

CONFIGS = sorted(PAPER_DIR.glob("halrp_*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_paper_config_parses_and_builds(path):
    cfg = load_config(path)
    s = cfg.scenario
    assert cfg.method.name == "halrp" and s.kind == "task_incremental"
    assert len(s.task_orders) == 5 and len({tuple(o) for o in s.task_orders}) == 5
    if s.class_order is not None:
        assert sorted(s.class_order) == list(range(100))
    m = cfg.model
    b = build_backbone(m.name, pretrained=m.pretrained, source=m.source, config=m.config)
    assert b(torch.rand(2, 3, 32, 32)).shape[0] == 2


def test_superclass_groups_are_the_cifar100_superclasses():
    cfg = load_config(PAPER_DIR / "halrp_cifar100_superclass_lenet.yaml")
    groups = [cfg.scenario.class_order[5 * k: 5 * k + 5] for k in range(20)]
    assert groups[0] == [4, 30, 55, 72, 95]  # aquatic mammals: beaver, dolphin, otter, seal, whale
