"""Start-up: the command line imports torch, transformers and the method modules only when a command needs them.

``clmerge --version``, ``clmerge --help`` and every command's ``--help`` run without them, so they return in a
fraction of torch's own import time (benchmarks/startup.md has the measured ratios). A new command inherits the
rule: its module is imported by ``clmerge.cli``, and this test imports ``clmerge.cli`` and asks every command
for its help in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "transformers", "clmerge.merging.methods", "clmerge.methods")

_PROBE = """
import contextlib, io, json, sys
import clmerge.cli
from typer.main import get_command
from clmerge.cli import app, main
names = sorted(get_command(app).commands)
for argv in [["--version"], ["--help"]] + [[name, "--help"] for name in names]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main(argv)
heavy = [m for m in {heavy!r} if m in sys.modules]
print(json.dumps({{"commands": names, "heavy": heavy}}))
"""


def _probe() -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE.format(heavy=HEAVY)], capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_cli_and_every_help_imports_neither_torch_nor_transformers_nor_the_methods():
    res = _probe()
    assert len(res["commands"]) >= 10 and "merge" in res["commands"]
    assert res["heavy"] == [], f"imported at start-up: {res['heavy']} (import them inside the command)"

