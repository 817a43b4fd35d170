"""``embeddings: union | base`` against mergekit 0.1.5's ``tokenizer_source: union | base`` on tiny Llama
models (slow).

mergekit is an oracle, not a dependency: it runs as ``mergekit-yaml`` from its own venv (``CLMERGE_MERGEKIT_VENV``,
default ``/work/venvs/mergekit``; benchmarks/merging/README.md says how to make it); without it the test is
skipped. Both define the same result for a union: each input's missing rows are filled from the inputs that
have the token (the base's row for a model that lacks it, else the mean of the models that have it), then the
method merges. They differ only in the order of the appended tokens: clmerge appends them in recipe order,
mergekit in the order of a Python ``set`` of the models (its ``referenced_models``), which changes with
``PYTHONHASHSEED``; so rows are compared by token string.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from checkpoint_helpers import folder_state, invoke
from vocab_helpers import CORE, tiny_lm, vocab_of

VENV = Path(os.environ.get("CLMERGE_MERGEKIT_VENV", "/work/venvs/mergekit"))
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (VENV / "bin" / "mergekit-yaml").exists(), reason=f"no mergekit venv at {VENV}")]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    """base; a: + <tool>, zz (added tokens); d: one more word in its tokenizer model's own vocabulary
    (w20) and its vocabulary reordered."""
    d = tmp_path_factory.mktemp("mk_zoo")
    tiny_lm(d / "base", seed=0)
    tiny_lm(d / "a", seed=1, added=["<tool>", "zz"])
    tiny_lm(d / "d", seed=2, core=CORE[:3] + (CORE[3:] + ["w20"])[::-1], added=["<img>"])
    return d


def _mergekit(zoo: Path, method: str, base: bool, mode: str) -> Path:
    cfg = {"merge_method": method, "dtype": "float32", "tokenizer_source": mode,
           "models": [{"model": str(zoo / m), "parameters": {"weight": 1.0}} for m in ("a", "d")]}
    if base:
        cfg["base_model"] = str(zoo / "base")
    (zoo / f"mk_{method}_{mode}.yml").write_text(yaml.safe_dump(cfg))
    out = zoo / f"mk_{method}_{mode}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    subprocess.run([str(VENV / "bin" / "mergekit-yaml"), str(zoo / f"mk_{method}_{mode}.yml"), str(out)], check=True,
                   env=env, capture_output=True, timeout=300)
    return out


def _clmerge(zoo: Path, method: str, base: bool, mode: str) -> Path:
    recipe = {"method": method, "models": [str(zoo / m) for m in ("a", "d")], "embeddings": mode}
    if base:
        recipe.update(base=str(zoo / "base"), parameters={"scaling": 1.0})
    out = zoo / f"cl_{method}_{mode}"
    (zoo / f"{out.name}.yaml").write_text(yaml.safe_dump(recipe))
    res = invoke(zoo / f"{out.name}.yaml", "--out", out, "--no-hash-inputs")
    assert res.exit_code == 0, res.output
    return out


@pytest.mark.parametrize("ours, theirs, base, mode, rows", [
    ("task_arithmetic", "task_arithmetic", True, "union", len(CORE) + 4),
    ("weight_average", "linear", False, "union", len(CORE) + 4),
    ("task_arithmetic", "task_arithmetic", True, "base", len(CORE)),
])
def test_rows_match_mergekit_by_token(zoo, ours, theirs, base, mode, rows):
    cl, mk = _clmerge(zoo, ours, base, mode), _mergekit(zoo, theirs, base, mode)
    vc, vm = vocab_of(cl), vocab_of(mk)
    assert set(vc) == set(vm) and len(vc) == rows
    sc, sm = folder_state(cl), folder_state(mk)
    assert sc.keys() == sm.keys()
    for key in sc:
        if sc[key].shape[0] == len(vc) and sc[key].dim() == 2:  # rows by token string
            order = torch.tensor([vm[t] for t in sorted(vc, key=vc.get)])
            torch.testing.assert_close(sc[key], sm[key][order], rtol=0, atol=1e-6, msg=key)
        else:
            torch.testing.assert_close(sc[key], sm[key], rtol=0, atol=1e-6, msg=key)
