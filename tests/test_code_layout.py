"""Where code lives: HALRP and the prompt methods as folders under ``methods/``, one-way imports between the
modules that used to import each other, and helpers shared across modules under public names (read from the
source with ``ast``; imports inside functions count too)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "clmerge"

# The packages and modules checked for private imports (checkpoints is checked when it is done).
SCANNED = ("adapters", "data", "engine", "harness", "merging", "methods", "models", "params", "report", "theory",
           "config.py", "recipes.py")
ELSEWHERE: set[tuple[str, str, str]] = set()


def _module_name(path: Path) -> str:
    parts = ("clmerge", *path.relative_to(PKG).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, str]]:
    """``(absolute module, imported name)`` of every import in ``path`` (name ``""`` for ``import x``)."""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out += [(module, a.name) for a in node.names]
    return out


def _imports_module(path: Path, target: str) -> bool:
    return any(m == target or m.startswith(target + ".") or f"{m}.{n}" == target for m, n in _imports(path))


@pytest.mark.parametrize("importer, target", [
    ("adapters/structure.py", "clmerge.methods"),  # wrappers register themselves with the method's modules
    ("adapters/structure.py", "clmerge.adapters.task_modules"),
    ("adapters/task_modules.py", "clmerge.adapters.structure"),
    ("harness/merge_bench_data.py", "clmerge.harness.merge_bench_experts"),
    ("harness/merge_bench_config.py", "clmerge.harness"),
])
def test_imports_run_one_way(importer, target):
    assert not _imports_module(PKG / importer, target)


def test_report_does_not_import_theory():
    assert [p.name for p in (PKG / "report").glob("*.py") if _imports_module(p, "clmerge.theory")] == []


def test_no_private_name_is_imported_from_another_clmerge_module():
    found = set()
    for path in (p for pkg in SCANNED for p in ([PKG / pkg] if pkg.endswith(".py") else (PKG / pkg).rglob("*.py"))):
        me = _module_name(path)
        for module, name in _imports(path):
            if module.startswith("clmerge") and module != me and name.startswith("_") and name != "__version__":
                found.add((me, module, name))
    assert found <= ELSEWHERE, sorted(found - ELSEWHERE)


def test_halrp_and_prompt_methods_are_folders():
    from clmerge.methods import METHODS
    from clmerge.methods.halrp import HALRP, HALRPOptions, low_rank_perturbation
    from clmerge.methods.prompts import HiDePrompt, PromptMethod

    assert METHODS["halrp"] is HALRP and HALRP.Options is HALRPOptions and low_rank_perturbation.residual_svd
    assert issubclass(HiDePrompt, PromptMethod) and METHODS["hide_prompt"] is HiDePrompt
    for old in ("clmerge.adapters.halrp", "clmerge.params.low_rank_perturbation", "clmerge.methods.prompt_methods",
                "clmerge.methods.hide_prompt", "clmerge.report.study"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
