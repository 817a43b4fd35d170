"""Every paper config under clmerge/configs/paper parses and validates (keys, method options)."""

from __future__ import annotations

from pathlib import Path

import pytest

from clmerge.config import load_config
from clmerge.paper_configs import PAPER_DIR

_DIR = PAPER_DIR
PAPER = sorted([*_DIR.glob("sd_lora_*.yaml"), *_DIR.glob("pm_*.yaml")])


def test_paper_configs_exist() -> None:
    assert len(PAPER) >= 14


@pytest.mark.parametrize("path", PAPER, ids=[p.stem for p in PAPER])
def test_paper_config_validates(path: Path) -> None:
    cfg = load_config(path)
    options = cfg.method_options()
    assert cfg.model.name == "vit-b16" and options.rank == 10
    assert cfg.scenario.dataset in path.stem.replace("-", "_") or cfg.scenario.dataset.replace("_", "") in path.stem
