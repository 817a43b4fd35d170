"""Loading a script under ``benchmarks/`` as a module in a test (the scripts are not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_bench(folder: str, name: str) -> ModuleType:
    """``benchmarks/<folder>/<name>.py`` as a fresh module named ``<folder>_<name>``; its folder goes on
    ``sys.path`` first, so the script's imports of its sibling scripts resolve."""
    where = BENCHMARKS / folder
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))
    spec = importlib.util.spec_from_file_location(f"{folder}_{name}", where / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
