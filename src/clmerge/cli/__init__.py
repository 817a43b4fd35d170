"""The ``clmerge`` command line: one module per command group, no library logic (docs/cli.md).

:mod:`.base` holds the typer app, the root command and the one-line errors; :mod:`.run` (run, report, the
listings), :mod:`.results` (tables across runs), :mod:`.pretrain`, :mod:`.merge` (merge, merges, extract-lora, export), :mod:`.verify` (verify), :mod:`.eval` (eval; merge --tune), :mod:`.bench`
(merge-bench), :mod:`.sweep` (sweep) and :mod:`.study` (study, predict, advise) register their commands on it when imported here.
"""

from . import run, sweep, results, pretrain, merge, verify, eval, bench, study  # noqa: E402, F401  (in the order of ``clmerge --help``)
from .base import app, main

__all__ = ["app", "main"]
