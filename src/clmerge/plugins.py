"""``--plugin``: import the user's own modules before the config is read.

A plugin is a Python module, named as an importable module (``--plugin mypkg.methods``) or as a file path
(``--plugin ./my_method.py``). Importing it runs its ``@register_method`` / ``@register_dataset`` /
``@register_backbone`` / ``@register_merge`` decorators, so the config can then name what it registered
(docs/extending.md). This module belongs to the command-line layer: nothing below it imports it. The import
itself, and the record of what was imported (path and sha256, which a run's ``manifest.json`` and a merge's
model card carry), are :mod:`clmerge.utils.provenance`'s; a run directory's recorded plugins are imported
again by :func:`~clmerge.utils.provenance.open_run_plugins` when ``export``, ``eval``, ``report`` or ``run
--resume`` opens it.

A plugin is code: importing it runs the file with the rights of the user who runs clmerge, so name only files
you trust. A plugin that ends the process while it is imported (``sys.exit(...)``, ``raise SystemExit``,
``exit()``) is refused as an :class:`~clmerge.errors.InputError` (exit code 3) naming the plugin and quoting
what it passed, instead of ending clmerge silently with the plugin's code.
"""

from __future__ import annotations

from types import ModuleType

from .utils.provenance import load_plugin, open_run_plugins

__all__ = ["PLUGIN_HELP", "load_plugin", "load_plugins", "open_run_plugins"]

#: The ``--plugin`` help of every command that takes it.
PLUGIN_HELP = ("import a Python module (a name or a .py file path) before the config is read, so its "
               "@register_... methods, datasets and backbones can be named (repeatable). This RUNS the "
               "plugin's code with your rights: name only files you trust (docs/extending.md)")


def load_plugins(specs: list[str]) -> list[ModuleType]:
    """Import every plugin in order (each at most once per process)."""
    return [load_plugin(s) for s in specs]
