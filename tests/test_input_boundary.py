"""The input boundary (docs/cli_errors.md, "One rule for every input"): code outside
``clmerge.utils.inpaths`` does not open files itself. Every read of a file goes through that module (or through
``utils.io.read_json`` / ``utils.yaml_io.read_yaml``, which call it), so a new command inherits containment,
the regular-file check and the size caps instead of having to remember them. A reader that must open a path
itself (safetensors, ``torch.load``) is handed one by ``with inpaths.checked_path(p) as real:``; a call on
``real`` is not a direct read. An ``open`` in a write mode is the output guard's business, not a read.

Read from the source with ``ast``. A call is a direct read when it is the builtin ``open``, a method named
``open`` / ``read_text`` / ``read_bytes`` (``Path``'s), ``json.load``, ``yaml.load`` / ``yaml.safe_load`` /
``yaml.full_load``, ``safe_open``, safetensors' ``load_file``, ``torch.load`` or ``np.load``. The few places
that read something no user named (``/proc``, a file this process just wrote in its own temporary folder, a
pickle-free image file a dataset loader hands to PIL) are listed in ``ALLOWED`` with the reason; the list may
only shrink.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "clmerge"
BOUNDARY = {"utils/inpaths.py"}

_METHODS = {"open", "read_text", "read_bytes", "safe_load", "full_load", "load_file", "safe_open"}
_QUALIFIED = {("json", "load"), ("yaml", "load"), ("torch", "load"), ("np", "load"), ("numpy", "load")}

# (file, function) -> why this read needs no boundary. Keep it short; every entry is reviewed.
ALLOWED: dict[tuple[str, str], str] = {
    ("utils/yaml_io.py", "load_yaml"): "parses text, not a file: read_yaml reads the file through inpaths first",
}


def _writes(call: ast.Call) -> bool:
    """``open(p, "w")`` / ``p.open("a")``: a literal mode that writes and does not read."""
    args = list(call.args) + [k.value for k in call.keywords if k.arg == "mode"]
    modes = [a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return any(set(m) & set("wax") and "r" not in m and "+" not in m for m in modes)


def _direct_reads(path: Path) -> list[tuple[str, int, str]]:
    tree = ast.parse(path.read_text())
    found = []
    stack: list[str] = []
    checked: set[str] = set()  # names bound by `with ...checked_path(...) as name`: the boundary's own path

    class V(ast.NodeVisitor):
        def _fn(self, node):
            stack.append(node.name)
            self.generic_visit(node)
            stack.pop()

        visit_FunctionDef = visit_AsyncFunctionDef = _fn

        def _with(self, node):
            for item in node.items:
                f = item.context_expr.func if isinstance(item.context_expr, ast.Call) else None
                called = getattr(f, "attr", None) or getattr(f, "id", None)
                if called == "checked_path" and isinstance(item.optional_vars, ast.Name):
                    checked.add(item.optional_vars.id)
            self.generic_visit(node)

        visit_With = visit_AsyncWith = _with

        def visit_Call(self, node: ast.Call):
            f = node.func
            name = None
            if isinstance(f, ast.Name) and f.id in {"open", "safe_open", "load_file"}:
                name = f.id
            elif isinstance(f, ast.Attribute):
                owner = f.value.id if isinstance(f.value, ast.Name) else None
                if (owner, f.attr) in _QUALIFIED:
                    name = f"{owner}.{f.attr}"
                elif f.attr in _METHODS and owner not in {"inpaths", "os", "Image", "tarfile", "zipfile", "gzip",
                                                           "webbrowser"}:
                    name = f".{f.attr}"
            first = node.args[0] if node.args else None
            if name and isinstance(first, ast.Name) and first.id in checked:
                name = None  # reads the descriptor inpaths.checked_path opened and checked
            if name in {"open", ".open"} and _writes(node):
                name = None  # a write: the output guard's business (utils.outpaths, utils.io writers)
            if name:
                found.append((stack[-1] if stack else "<module>", node.lineno, name))
            self.generic_visit(node)

    V().visit(tree)
    return found


def _violations() -> list[str]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in BOUNDARY:
            continue
        for fn, line, name in _direct_reads(path):
            if (rel, fn) not in ALLOWED:
                out.append(f"{rel}:{line} {fn}: {name}(...)")
    return out


def test_input_boundary():
    bad = _violations()
    assert not bad, ("these read files outside clmerge.utils.inpaths; read through it (read_bytes, read_json, "
                     "read_text, open_input, checked_path) or add a justified ALLOWED entry:\n" + "\n".join(bad))


def test_allowed_entries_still_exist():
    """A stale ALLOWED entry would let a later read slip through under its name."""
    live = {(p.relative_to(SRC).as_posix(), fn) for p in SRC.rglob("*.py") for fn, _, _ in _direct_reads(p)}
    assert not set(ALLOWED) - live, sorted(set(ALLOWED) - live)


def test_the_checker_catches_each_kind_of_read(tmp_path):
    """The checker itself can fail: each forbidden form is found in a sample."""
    sample = tmp_path / "m.py"
    sample.write_text("import json, torch, yaml\nfrom pathlib import Path\n"
                      "def f(p):\n    open(p)\n    Path(p).read_text()\n    p.read_bytes()\n    json.load(p)\n"
                      "    open(p, 'w')\n    with checked_path(p) as q:\n        torch.load(q)\n    torch.load(p)\n    yaml.safe_load(p)\n    safe_open(p, 'pt')\n    p.open()\n")
    assert len(_direct_reads(sample)) == 8
