"""Where code lives: HALRP and the prompt methods as folders under ``methods/``, one-way imports between the
modules of one layer that used to import each other (read from the source with ``ast``; imports inside
functions count too). The rules between layers, and that no module imports another's private name, are
tests/test_architecture.py's, for every module."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "clmerge"


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
    ("adapters/structure.py", "clmerge.adapters.task_modules"),
    ("adapters/task_modules.py", "clmerge.adapters.structure"),
    ("harness/merge_bench_data.py", "clmerge.harness.merge_bench_experts"),
    ("harness/merge_bench_config.py", "clmerge.harness"),
    ("merging/methods/trim.py", "clmerge.merging.methods.ties"),  # kth_smallest lives in trim, the lowest of ties/kernels/trim
    ("merging/methods/trim.py", "clmerge.merging.methods.ties_kernels"),
    ("merging/methods/ties_kernels.py", "clmerge.merging.methods.ties"),
])
def test_imports_run_one_way(importer, target):
    assert not _imports_module(PKG / importer, target)


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


# -- the merge library: checkpoint I/O under merging/io, export in engine, its commands in cli/merge.py --

def test_checkpoint_io_lives_under_merging_io_and_export_in_engine():
    from clmerge import merging
    from clmerge.engine.export import export_run, load_run_model
    from clmerge.merging.io import MergeInputError, ParamSource, ShardedWriter, as_source, open_checkpoint
    from clmerge.merging.lora_merge import merge_adapters
    from clmerge.merging.recipes import load_recipe

    assert merging.MergeInputError is MergeInputError and merging.ParamSource is ParamSource
    assert all(callable(f) for f in (export_run, load_run_model, as_source, open_checkpoint, merge_adapters,
                                     load_recipe, ShardedWriter))
    for old in ("clmerge.checkpoints", "clmerge.recipes", "clmerge.merging.io.sources"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)


@pytest.mark.parametrize("importer, target", [
    ("merging/io/base.py", "clmerge.merging.io.readers"),  # the base types import nothing back
    ("merging/io/base.py", "clmerge.merging.io.peft"),
    ("merging/io/peft.py", "clmerge.merging.io.readers"),
    ("merging/io/readers.py", "clmerge.merging.methods.registry"),
])
def test_merge_io_imports_run_one_way(importer, target):
    assert not _imports_module(PKG / importer, target)


def test_base_io_module_imports_no_other_merging_module():
    assert [m for m, _ in _imports(PKG / "merging/io/base.py") if m.startswith("clmerge.merging")] == []


def test_merge_commands_hold_only_the_typer_commands():
    tree = ast.parse((PKG / "cli/merge.py").read_text())
    defs = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert defs == {"merge_command", "list_methods", "extract_lora_command", "export_command", "moe_command",
                    "_summary"}
    assert not [n for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign)) and
                not any(getattr(t, "id", "") == "__all__" for t in getattr(n, "targets", []))]  # no module state


def test_thread_setting_is_process_wide_with_a_public_api():
    import torch

    from clmerge.utils.threads import default_threads, io_threads, set_threads

    before = torch.get_num_threads()
    try:
        set_threads(3)
        assert io_threads() and torch.get_num_threads() == 2
        set_threads(1)
        assert not io_threads() and torch.get_num_threads() == 1
        assert 1 <= default_threads() <= 4
    finally:
        torch.set_num_threads(before)
        set_threads(1)
