"""The package's layers (docs/architecture.md): every import inside ``clmerge`` points to the same or a lower
layer, and no two modules import each other in a loop. Read from the source with ``ast``; imports inside
functions count as well, since a lazy import upward is still a dependency upward."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"

# Low to high. A module belongs to the first prefix that matches it; it may import its own layer and below.
LAYERS: list[tuple[str, ...]] = [
    ("clmerge.errors", "clmerge.registry", "clmerge.utils", "clmerge.version"),
    ("clmerge.config", "clmerge.metrics", "clmerge.paper_configs"),
    ("clmerge.adapters",),
    ("clmerge.params",),
    ("clmerge.models",),
    ("clmerge.data",),
    ("clmerge.report",),
    ("clmerge.merging",),
    ("clmerge.methods",),
    ("clmerge.engine",),
    ("clmerge.harness", "clmerge.pretrain"),
    ("clmerge.theory",),
    ("clmerge.sweep",),
    ("clmerge.cli", "clmerge.__main__", "clmerge.plugins"),  # plugins: imports the modules --plugin names
]
FACE = "clmerge"  # the package's face (its __init__): the top, matched exactly


def _modules() -> dict[str, Path]:
    mods = {}
    for path in SRC.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


@functools.cache
def _tree(path: Path) -> ast.Module:
    """Each source file parsed once for all the tests here."""
    return ast.parse(path.read_text())


def _imports(mods: dict[str, Path]) -> set[tuple[str, str]]:
    """(importer, imported) pairs between clmerge modules."""
    edges = set()
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                while target not in mods and "." in target:
                    target = target.rpartition(".")[0]
                if target.startswith("clmerge") and target != mod and target in mods:
                    edges.add((mod, target))
    return edges


def _layer(mod: str) -> int:
    if mod == FACE:
        return len(LAYERS)
    for i, prefixes in enumerate(LAYERS):
        if any(mod == p or mod.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{mod} is in no layer: add it to LAYERS and docs/architecture.md")


def _as_module(token: str) -> str:
    """``cli/`` or ``plugins.py`` (docs) or ``cli`` (CONTRIBUTING) -> ``clmerge.cli`` / ``clmerge.plugins``."""
    return "clmerge." + token.removesuffix("/").removesuffix(".py")


def _doc_table_layers() -> list[tuple[str, ...]]:
    """The layers of docs/architecture.md's table (written high to low), low to high."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("| layer (high to low) | what it holds |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split("|")[1] for line in table.strip().splitlines()[1:]]
    return [tuple(_as_module(t) for t in re.findall(r"`([^`]+)`", cell)) for cell in reversed(rows)]


def _contributing_layers() -> list[tuple[str, ...]]:
    """The ``from low to high: `a`, `b` < `c` < ...`` sentence of CONTRIBUTING.md."""
    text = " ".join((ROOT / "CONTRIBUTING.md").read_text().split())
    chain = re.search(r"from low to high: (.*?)\.(?: |$)", text).group(1)
    return [tuple(_as_module(t) for t in re.findall(r"`([^`]+)`", part)) for part in chain.split("<")]


def test_the_docs_give_the_same_layers():
    """docs/architecture.md's table and CONTRIBUTING.md's order are ``LAYERS``, so they cannot drift apart."""
    assert _doc_table_layers() == LAYERS
    assert _contributing_layers() == LAYERS


def test_no_module_imports_the_package_face():
    """``clmerge/__init__.py`` sits above every layer: a module names the version through ``clmerge.version``."""
    face = sorted(a for a, b in _imports(_modules()) if b == "clmerge")
    assert not face, face


def test_every_module_has_a_layer():
    for mod in _modules():
        _layer(mod)


def test_no_import_points_to_a_higher_layer():
    mods = _modules()
    upward = sorted(f"{a} -> {b}" for a, b in _imports(mods)
                    if b != "clmerge" and _layer(b) > _layer(a))
    assert not upward, "imports that run up a layer:\n" + "\n".join(upward)


def test_no_import_cycles():
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for a, b in _imports(mods):
        # a package's face (its __init__) re-exports its modules: that is not a loop of the code
        if not (mods[a].name == "__init__.py" and b.startswith(a + ".")):
            graph[a].add(b)
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_private_name_is_imported_from_another_module():
    found = []
    for mod, path in _modules().items():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("clmerge", "")) and node.level + (
                    (node.module or "").startswith("clmerge")):
                found += [f"{mod}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found, "private names imported across modules:\n" + "\n".join(found)
