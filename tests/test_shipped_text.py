"""Shipped code, configs, benchmarks and tests cite what a reader can check (a paper's section, equation or
table; the official code; a file in the repository), never internal tickets or documents that are not in the
repository: no "issue N", no numbered implementation notes ("spec 003", "spec 2.10", "seed 004", "(002)"),
no ``DESIGN.md``. The user docs have their own check in ``tests/test_docs.py``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

INTERNAL = re.compile(
    r"\bissues? #?\d+|\bissue-\d+|\bissues \d+ and \d+|\bspecs? \d|\bspecs?[ _]?0\d\d\b|\bspec (section|flag|[A-Z]\d)"
    r"|\bseeds? 0\d\d\b|\bseed file|\(00[0-4]\)|\bDESIGN[.]md|\bspecs[/]", re.I)

def _shipped() -> list[str]:
    files = [*(ROOT / "src" / "clmerge").rglob("*.py"), *(ROOT / "src" / "clmerge" / "configs").rglob("*.yaml"),
             *(ROOT / "tests").rglob("*.py")]
    files += [p for ext in ("py", "md", "yaml") for p in (ROOT / "benchmarks").rglob(f"*.{ext}")]
    rel = sorted(p.relative_to(ROOT).as_posix() for p in files)
    own = Path(__file__).resolve().relative_to(ROOT).as_posix()  # its examples are internal references on purpose
    return [r for r in rel if r != own]


def test_the_scan_covers_code_configs_benchmarks_and_tests():
    files = _shipped()
    assert "src/clmerge/methods/sd_lora.py" in files and "benchmarks/lora_cl/README.md" in files
    assert any(f.startswith("src/clmerge/configs/") for f in files) and "tests/test_docs.py" in files


@pytest.mark.parametrize("name", _shipped())
def test_shipped_text_carries_no_internal_references(name):
    text = (ROOT / name).read_text(encoding="utf-8")
    hits = [f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for m in INTERNAL.finditer(text)]
    assert not hits, f"{name}: {hits} (describe things by what they are; cite the paper, its section or equation)"


@pytest.mark.parametrize("text", ["see issue 11", "(issues 4 and 11)", "issue-4 selection", "spec 003 section 4.1",
                                  "spec 2.10 #3", "spec A5", "spec flag 7", "spec 4.C", "Seed 004, the framework",
                                  "seed file 001", "claim (002)", "see DESIGN.md", "specs/001_cart.md"])
def test_the_pattern_finds_each_kind_of_internal_reference(text):
    assert INTERNAL.search(text)


@pytest.mark.parametrize("text", ["the study spec", "a TIES trim spec", "seeds 0, 1, 2", "seed 0", "Eq. 14",
                                  "1.000 (1.00-1.00)", "docs/architecture.md", "StudySpec(**spec)"])
def test_the_pattern_leaves_ordinary_words_alone(text):
    assert not INTERNAL.search(text)
