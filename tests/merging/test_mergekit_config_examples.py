"""mergekit's own example configs (``tests/data/mergekit_examples/``, vendored unchanged) through ``clmerge merge``
on tiny 40-layer Llama / Mistral models: each runs and loads, or is refused with the documented reason; where
mergekit 0.1.5 is installed in its own venv (``CLMERGE_MERGEKIT_VENV``, default ``/work/venvs/mergekit``), the
outputs of both tools are compared (skipped otherwise: CI does not depend on it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from bench_helpers import load_bench

pytestmark = pytest.mark.slow

BENCH = load_bench("merging", "mergekit_configs_vs_mergekit")
VENV = Path(os.environ.get("CLMERGE_MERGEKIT_VENV", "/work/venvs/mergekit"))
EXAMPLES = sorted(p.name for p in BENCH.EXAMPLES.glob("*.yml"))
REFUSED: dict[str, str] = {}  # every example runs (ties.yml: per-model densities and weights)
LAYERS = {"orcamini-platy-44layer.yml": 44}

# float32 runs (dtype set to float32 in both tools): how far apart the outputs may be, and why
# (benchmarks/merging/mergekit_configs_vs_mergekit.md)
F32_TOLERANCE = {
    "orcamini-platy-44layer.yml": 0.0,  # layers copied in both
    "linear.yml": 1e-6,  # the same weighted sum, another order
    "gradient-slerp.yml": 1e-6,  # float64 here, float32 there
    "bio-merge.yml": 1e-6,  # TIES at density 0.5 of even-sized tensors: the same counts
    "arcee_fusion.yml": 0.2,  # an importance within float32 rounding of the threshold moves whole entries
    "ties.yml": 0.08,  # kept counts round(d n) here, int(d n) there (each tensor that differs: test below)
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return BENCH.build_models(tmp_path_factory.mktemp("mergekit_models"))


@pytest.mark.parametrize("name", EXAMPLES)
def test_each_mergekit_example_runs_or_is_refused_with_the_documented_reason(name, models, tmp_path):
    import transformers as tf

    data = BENCH.localize((BENCH.EXAMPLES / name).read_text(), models)
    refused = BENCH.clmerge_merge(data, tmp_path / "out")
    if name in REFUSED:
        assert refused is not None and REFUSED[name] in refused and refused.startswith("config.yml: mergekit config:")
        return
    assert refused is None
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.num_hidden_layers == LAYERS.get(name, BENCH.LAYERS)


@pytest.mark.skipif(not (VENV / "bin" / "mergekit-yaml").exists(), reason=f"no mergekit venv at {VENV}")
@pytest.mark.parametrize("name", sorted(F32_TOLERANCE))
def test_each_example_in_float32_matches_mergekit_as_documented(name, models, tmp_path):
    import yaml

    text = yaml.safe_dump({**yaml.safe_load((BENCH.EXAMPLES / name).read_text()), "dtype": "float32"})
    data = BENCH.localize(text, models)
    cfg = tmp_path / "config.yml"
    cfg.write_text(yaml.safe_dump(data))
    assert BENCH.clmerge_merge(data, tmp_path / "ours") is None
    assert BENCH.mergekit_merge(str(VENV / "bin" / "python"), cfg, tmp_path / "theirs") is None
    worst, _, _, dtype = BENCH.compare(tmp_path / "ours", tmp_path / "theirs")
    assert dtype == "float32" and worst <= F32_TOLERANCE[name], worst


@pytest.mark.skipif(not (VENV / "bin" / "mergekit-yaml").exists(), reason=f"no mergekit venv at {VENV}")
@pytest.mark.parametrize("name", ["karcher_base", "nuslerp", "model_stock", "slerp_models"])
def test_a_config_where_clmerge_follows_mergekit_agrees_to_float32_rounding(name, models, tmp_path):
    import yaml

    data = BENCH.localize(BENCH.EXTRA[name], models)
    cfg = tmp_path / "config.yml"
    cfg.write_text(yaml.safe_dump(data))
    assert BENCH.clmerge_merge(data, tmp_path / "ours") is None
    assert BENCH.mergekit_merge(str(VENV / "bin" / "python"), cfg, tmp_path / "theirs") is None
    assert BENCH.compare(tmp_path / "ours", tmp_path / "theirs")[0] <= 1e-5


@pytest.mark.skipif(not (VENV / "bin" / "mergekit-yaml").exists(), reason=f"no mergekit venv at {VENV}")
def test_ties_yml_in_float32_differs_only_where_a_kept_count_differs(models, tmp_path):
    import yaml

    text = yaml.safe_dump({**yaml.safe_load((BENCH.EXAMPLES / "ties.yml").read_text()), "dtype": "float32"})
    data = BENCH.localize(text, models)
    cfg = tmp_path / "config.yml"
    cfg.write_text(yaml.safe_dump(data))
    assert BENCH.clmerge_merge(data, tmp_path / "ours") is None
    assert BENCH.mergekit_merge(str(VENV / "bin" / "python"), cfg, tmp_path / "theirs") is None
    differ, by_count, equal_differ, _ = BENCH.counts(data, tmp_path / "ours", tmp_path / "theirs")
    assert differ == by_count and equal_differ == 0  # round(d n) vs max(1, int(d n)), nothing else
