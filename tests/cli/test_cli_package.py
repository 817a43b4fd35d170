"""The command line is one package, ``clmerge.cli``, with one module per command group and no library logic
(docs/cli.md): no module outside it imports typer or the command line, and the old command modules are gone."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "src" / "clmerge"
GROUPS = {"base", "run", "sweep", "results", "pretrain", "merge", "verify", "eval", "bench", "study"}


def _imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out.add("." * node.level + (node.module or ""))
    return out


def test_the_cli_is_one_package_with_a_module_per_command_group():
    assert {p.stem for p in (PKG / "cli").glob("*.py")} == GROUPS | {"__init__", "__main__"}
    for old in ("clmerge.cli_support", "clmerge.study_cli", "clmerge.export_cli", "clmerge.merging.cli",
                "clmerge.harness.merge_bench_cli"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)


def test_no_library_module_imports_typer_or_the_cli():
    found = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG)
        if rel.parts[0] == "cli" or rel.name == "__main__.py":
            continue
        mods = _imported_modules(path)
        found += [f"{rel}: {m}" for m in mods if m.split(".")[0] == "typer" or m.endswith("cli") or ".cli." in m
                  or m in ("clmerge.cli", "..cli", ".cli")]
    assert not found, found


def test_every_command_module_registers_commands_and_holds_no_public_library_function():
    for group in GROUPS - {"base"}:
        tree = ast.parse((PKG / "cli" / f"{group}.py").read_text())
        public = [n for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
        commands = [n for n in public if any("app.command" in ast.unparse(d) for d in n.decorator_list)]
        others = {n.name for n in public} - {n.name for n in commands}
        assert commands, group
        # how run prints and names a run; how sweep and run --seeds run a sweep spec; merge --tune's body (eval)
        assert others <= {"print_results", "default_run_dir", "run_spec", "dry_run_spec", "run_tune", "next_commands"}, (group, others)


@pytest.mark.parametrize("module", ["clmerge", "clmerge.cli"])
def test_python_dash_m_runs_the_cli(module):
    res = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True,
                         cwd=PKG.parents[1])
    assert res.returncode == 0 and res.stdout.startswith("clmerge "), res.stderr


def test_the_script_entry_point_is_the_cli_main():
    from clmerge.cli import main

    line = next(ln for ln in (PKG.parents[1] / "pyproject.toml").read_text().splitlines()
                if ln.startswith("clmerge = "))
    module, _, name = line.split("=", 1)[1].strip().strip('"').partition(":")
    assert getattr(importlib.import_module(module), name) is main
