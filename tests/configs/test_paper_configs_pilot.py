"""The PILOT-protocol configs (docs/pilot.md): PILOT's class order (seed 1993, legacy generator), IN21K ViT-B/16,
B0-Inc20 on ImageNet-R and B0-Inc10 on CIFAR-100. Their dry runs are in tests/engine/test_dry_run.py."""

from __future__ import annotations

import pytest

from clmerge.config import load_config
from clmerge.paper_configs import PAPER_DIR, describe_config

PILOT = ["simplecil_imagenet_r_10", "simplecil_cifar100_10", "mos_imagenet_r_10", "mos_cifar100_10"]
CLASSES = {"imagenet_r": 200, "cifar100": 100}


@pytest.mark.parametrize("name", PILOT)
def test_pilot_config_follows_the_protocol(name):
    path = PAPER_DIR / f"{name}.yaml"
    cfg = load_config(path)
    s = cfg.scenario
    assert (s.seed, s.class_order_rng, s.shuffle_classes, s.class_order) == (1993, "legacy_seed", True, None)
    assert cfg.model.name == "vit-b16" and cfg.model.source == "google/vit-base-patch16-224-in21k"
    per_task = {"imagenet_r": 20, "cifar100": 10}[s.dataset]  # B0-Inc20 / B0-Inc10
    assert s.n_tasks * per_task == CLASSES[s.dataset] and s.classes_per_task is None
    assert cfg.method.name in name and "PILOT protocol" in path.read_text().splitlines()[0]
    assert "(no paper named)" not in describe_config(path)
