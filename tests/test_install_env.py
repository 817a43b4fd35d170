"""docs/install.md, "Into an existing environment": the wheel installs next to a torch and transformers that
are already there without pip changing either (or anything else), and without any package of an extra.

The work is ``benchmarks/install_env.py``'s ``check`` (which also writes benchmarks/install_env.md): a fresh
virtual environment with torch (the version constraints.txt names) and transformers, then the wheel without
``-c constraints.txt``. Needs the package index, or the local wheels pip is configured with; minutes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _bench():
    spec = importlib.util.spec_from_file_location("install_env", REPO / "benchmarks" / "install_env.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_wheel_installs_into_an_environment_with_torch_and_transformers_and_changes_neither(tmp_path):
    bench = _bench()
    res = bench.check(tmp_path)
    assert all(k in res["before"] for k in bench.STACK)
    assert res["changed"] == {}, res["changed"]  # torch, transformers and every other package as they were
    assert res["pip_said_uninstalling"] == []
    assert "clmerge" in res["added"] and res["extras_present"] == [], res["extras_present"]
    assert res["version"].startswith("clmerge ")
    assert res["merge_exit_code"] == 0, res["merge"]
    assert res["merge"].startswith("wrote merged") and "config.json" in res["merged_files"]
