"""The user docs stay true: docs/extending.md's example plugin runs as documented, and the README and docs/
name papers, not internal ticket, spec or seed numbers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from clmerge import merging
from clmerge.cli import app
from clmerge.data.base import DATASETS
from clmerge.merging.methods.registry import MERGES
from clmerge.methods.base import METHODS
from clmerge.models.backbones import BACKBONES

ROOT = Path(__file__).resolve().parents[1]
EXTENDING = ROOT / "docs" / "extending.md"
REGISTERED = {"median_tv": MERGES, "head_only": METHODS, "noise_blobs": DATASETS, "tiny_cnn": BACKBONES}


def _plugin_source() -> str:
    """The python blocks of docs/extending.md that register something, in order: the example plugin file."""
    blocks = re.findall(r"```python\n(.*?)```", EXTENDING.read_text(), flags=re.S)
    return "\n\n".join(b for b in blocks if "@register_" in b)


@pytest.fixture()
def plugin_file(tmp_path, monkeypatch):
    """docs/extending.md's examples as ./my_plugin.py; what they register is removed afterwards."""
    assert not set(REGISTERED) & {n for reg in REGISTERED.values() for n in reg}
    (tmp_path / "my_plugin.py").write_text(_plugin_source())
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for name, registry in REGISTERED.items():
        registry.unregister(name)


def test_extending_examples_run_as_documented(plugin_file):
    source = _plugin_source()
    for deco in ("@register_merge", "@register_method", "@register_dataset", "@register_backbone"):
        assert deco in source
    cfg = {"scenario": {"dataset": "noise_blobs", "n_tasks": 2, "options": {"n_per_class": 10}},
           "model": {"name": "tiny_cnn", "pretrained": False, "config": {"width": 8}},
           "method": {"name": "head_only"}, "train": {"epochs": 1}, "run": {"progress": False, "report": False}}
    (plugin_file / "my.yaml").write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["run", "my.yaml", "--plugin", "./my_plugin.py", "--out", "r"])
    assert result.exit_code == 0, result.output
    metrics = json.loads((plugin_file / "r" / "metrics.json").read_text())
    assert len(metrics["accuracy_matrix"]) == 2 and len(metrics["method_metrics"]["trainable"]) == 2
    manifest = json.loads((plugin_file / "r" / "manifest.json").read_text())
    assert manifest["class_names"] == [f"blob{i}" for i in range(10)]
    base = {"w": torch.zeros(2, 3)}
    experts = [{"w": torch.full((2, 3), v)} for v in (1.0, 2.0, 4.0)]
    merged = merging.merge("median_tv", base=base, experts=experts, scaling=0.5)
    assert torch.equal(merged["w"], torch.full((2, 3), 1.0))  # 0 + 0.5 * median(1, 2, 4)


INTERNAL = re.compile(r"\bissues? \d+|\bissue-\d+|\bspec \d+|\bspec section|\bseed 0\d\d\b|\(flag \d", re.I)


@pytest.mark.parametrize("page", ["README.md", *sorted(p.relative_to(ROOT).as_posix()
                                                       for p in (ROOT / "docs").glob("*.md"))])
def test_user_docs_carry_no_internal_numbers(page):
    text = (ROOT / page).read_text()
    hits = [m.group(0) for m in INTERNAL.finditer(text)]
    assert not hits, f"{page}: {hits} (describe things by what they are, cite papers by name)"


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 210
