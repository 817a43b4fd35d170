"""``clmerge run --plugin``: import the user's own modules before the config is resolved.

A plugin is a Python module, named as an importable module (``--plugin mypkg.methods``) or as a file path
(``--plugin ./my_method.py``). Importing it runs its ``@register_method`` / ``@register_dataset`` /
``@register_backbone`` / ``@register_merge`` decorators, so the config can then name what it registered
(docs/extending.md). This module belongs to the command-line layer: nothing below it imports it.

A plugin is code: importing it runs the file with the rights of the user who runs clmerge, so name only files
you trust. A plugin that ends the process while it is imported (``sys.exit(...)``, ``raise SystemExit``,
``exit()``) is refused as an :class:`~clmerge.errors.InputError` (exit code 3) naming the plugin and quoting
what it passed, instead of ending clmerge silently with the plugin's code.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from .errors import InputError, clip

__all__ = ["PLUGIN_HELP", "load_plugin", "load_plugins"]

#: The ``--plugin`` help of every command that takes it.
PLUGIN_HELP = ("import a Python module (a name or a .py file path) before the config is read, so its "
               "@register_... methods, datasets and backbones can be named (repeatable). This RUNS the "
               "plugin's code with your rights: name only files you trust (docs/extending.md)")

_LOADED_FILES: dict[Path, ModuleType] = {}  # a file imported twice in one process would register twice


def _is_path(spec: str) -> bool:
    return spec.endswith(".py") or "/" in spec or "\\" in spec


def _import_file(spec: str) -> ModuleType:
    path = Path(spec).expanduser().resolve()
    if path in _LOADED_FILES:
        return _LOADED_FILES[path]
    if not path.is_file():
        raise InputError(f"--plugin {spec}: no such file ({path}); give a .py file or an importable module name")
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:8]
    name = f"clmerge_plugin_{path.stem}_{digest}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise InputError(f"--plugin {spec}: not a Python module file (expected a .py file)")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pydantic models look their module up while it executes
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    _LOADED_FILES[path] = module
    return module


def _import_name(spec: str) -> ModuleType:
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as exc:
        if exc.name is not None and spec.split(".")[0] != exc.name and not spec.startswith(exc.name + "."):
            raise  # a module the plugin itself imports is missing: reported as the plugin's failure
        raise InputError(f"--plugin {spec}: no module named {spec!r} on the Python path; give an importable "
                         "module name or a file path such as ./my_plugin.py") from exc


def load_plugin(spec: str) -> ModuleType:
    """Import one plugin (a module name or a ``.py`` path); its failure is an :class:`InputError` naming it."""
    keep, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no __pycache__ beside the user's files
    try:
        return _import_file(spec) if _is_path(spec) else _import_name(spec)
    except InputError:
        raise
    except SystemExit as exc:  # sys.exit() in a plugin would end clmerge with the plugin's code, silently
        code = exc.code
        said = "no code" if code is None else clip(repr(code), 120)
        raise InputError(f"--plugin {spec}: the plugin called sys.exit ({said}) while it was imported; a "
                         "plugin must only define and register its names") from None
    except Exception as exc:  # noqa: BLE001  (the user's code: any failure is reported with the plugin's name)
        raise InputError(f"--plugin {spec}: importing it failed: {type(exc).__name__}: {exc}") from exc
    finally:
        sys.dont_write_bytecode = keep


def load_plugins(specs: list[str]) -> list[ModuleType]:
    """Import every plugin in order (each at most once per process)."""
    return [load_plugin(s) for s in specs]
