"""The layout of the merge methods: the sparsification family registers one row per method, and no method
file imports another (families share math modules, which register nothing)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from clmerge import merging
from clmerge.merging.methods import sparse_family

METHODS = Path(merging.__file__).parent / "methods"


def _registers(path: Path) -> bool:
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", "") in ("register_merge", "_registered")
               or isinstance(n, ast.Name) and n.id == "_registered" for n in ast.walk(ast.parse(path.read_text())))


def test_no_method_file_imports_another():
    files = {p.stem: p for p in METHODS.glob("*.py") if p.stem not in ("__init__", "registry")}
    method_files = {name for name, p in files.items() if _registers(p)}
    assert {"sparse_family", "spherical", "tsv"} <= method_files and not {"ties", "dare", "lowrank"} & method_files
    found = []
    for name in sorted(method_files):
        for node in ast.walk(ast.parse(files[name].read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module in method_files - {name}:
                found.append(f"{name} imports {node.module}")
    assert found == []


def test_each_row_is_a_registered_method_with_its_own_signature():
    for name, row in sparse_family.ROWS.items():
        method = merging.get_method(name)
        assert method.description == row.description and method.fn.__module__ == sparse_family.__name__
        assert method.fn is getattr(sparse_family, name)
        assert "Args:" in inspect.getdoc(method.fn) and method.hyperparameters()["scaling"] is not inspect.Parameter.empty
    assert sorted(sparse_family.ROWS) == ["breadcrumbs", "breadcrumbs_ties", "dare", "della", "della_linear", "ties"]
