"""Every module of ``clmerge`` imports on its own, in an interpreter where no other ``clmerge`` module was
imported before it: a module that works only after another one was imported (a hidden import order) fails
here, which the layer test (tests/test_architecture.py, read from the source) cannot see.

How, within seconds for some 200 modules: one fresh interpreter imports the third-party libraries clmerge
uses (torch, transformers, pydantic, ...; never clmerge) and then forks one child per module, a few at a
time. Each child starts from that state, with no ``clmerge`` module in ``sys.modules``, imports its one module
and exits; a failure's traceback comes back in a file. Only Linux-like systems fork; elsewhere the test skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Libraries imported once before the forks (a missing one is left out): what the children share, so each
# child pays only for clmerge's own modules. Whatever a module imports beyond these, its child imports itself.
PRELOAD = ["numpy", "torch", "torch.nn", "torch.func", "torch.utils.data", "pydantic", "pydantic.json_schema",
           "yaml", "typer", "rich", "safetensors.torch", "transformers", "huggingface_hub", "PIL.Image",
           "scipy.linalg", "zoneinfo"]

_ZYGOTE = textwrap.dedent("""
    import importlib, json, os, sys, tempfile, traceback
    names, preload, parallel = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    for lib in preload:
        try:
            importlib.import_module(lib)
        except ImportError:
            pass
    loaded = [m for m in sys.modules if m == "clmerge" or m.startswith("clmerge.")]
    assert not loaded, f"a preloaded library imported clmerge: {loaded}"
    out, running, failed = tempfile.mkdtemp(), {}, {}

    def reap():
        pid, status = os.wait()
        name = running.pop(pid)
        if status:
            path = os.path.join(out, name)
            failed[name] = open(path).read() if os.path.exists(path) else f"exit status {status}"

    for name in names:
        if len(running) >= parallel:
            reap()
        pid = os.fork()
        if pid == 0:  # the child: import one module, report, exit without running the parent's handlers
            code = 0
            try:
                importlib.import_module(name)
            except BaseException:
                with open(os.path.join(out, name), "w") as f:
                    f.write(traceback.format_exc())
                code = 1
            os._exit(code)
        running[pid] = name
    while running:
        reap()
    print(json.dumps(failed))
""")


def _module_names() -> list[str]:
    names = []
    for path in sorted(SRC.rglob("*.py")):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        names.append(name)
    return names


def _fresh_env() -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [env.get("PYTHONPATH")])])
    return env


@pytest.mark.slow  # about 35 CPU s: every module, each in a fresh child (CI runs the slow tier)
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_every_module_imports_in_a_fresh_interpreter():
    names = _module_names()
    assert "clmerge.config" in names and len(names) > 100
    parallel = str(max(2, min(4, os.cpu_count() or 1)))
    proc = subprocess.run([sys.executable, "-c", _ZYGOTE, json.dumps(names), json.dumps(PRELOAD), parallel],
                          capture_output=True, text=True, env=_fresh_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    report = "\n".join(f"--- {name}\n{tb.strip().splitlines()[-1]}" for name, tb in sorted(failed.items()))
    assert not failed, f"{len(failed)} module(s) fail when imported first:\n{report}"


def test_the_zygote_sees_a_hidden_import_order(tmp_path):
    """The check itself: a package whose module needs another one imported first is caught."""
    pkg = tmp_path / "orderpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import sys\nVALUE = sys.modules['orderpkg.b'].VALUE\n")  # works only after b
    (pkg / "b.py").write_text("VALUE = 1\n")
    env = {**_fresh_env(), "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _ZYGOTE, json.dumps(["orderpkg.b", "orderpkg.a"]), "[]", "2"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert list(json.loads(proc.stdout.strip().splitlines()[-1])) == ["orderpkg.a"]


# parse_config of a method section in a fresh interpreter is tests/test_config.py's
# test_config_alone_imports_the_methods_only_when_it_checks_a_method (each case here is a fresh interpreter: ~2 CPU s)
@pytest.mark.parametrize("call", ["load_config()", "load_config(None, ['method.name=seq_lora'])"])
def test_the_config_validates_methods_in_a_fresh_interpreter(call):
    """``clmerge.config`` alone (nothing else of clmerge imported first) reads and checks a config: the
    continual methods are found through the provider the package's face names (clmerge.registry)."""
    code = f"from clmerge.config import load_config, parse_config\nprint({call}.method.name)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_fresh_env(),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] in {"ranpac_rp", "seq_lora"}
