"""Multi-stage recipes: named intermediate merges used by later stages; the intermediates never outlive the run."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import yaml
from checkpoint_helpers import folder_state, invoke, llama_config, save_variants

from clmerge.merging import pipeline
from clmerge.merging.recipes import load_recipe
from clmerge.merging.run import run_merge


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    import transformers as tf

    tmp = tmp_path_factory.mktemp("stage_llamas")
    cfg = llama_config()
    cfg.num_hidden_layers = 2
    return save_variants(tmp, cfg, ["base", "e1", "e2", "e3"], auto=tf.AutoModelForCausalLM)


def _two_stage(base, e1, e2, e3, second="s1"):
    return {"stages": [{"name": "s1", "method": "task_arithmetic", "base": str(base),
                        "models": [str(e1), str(e2)], "parameters": {"scaling": 0.7}}],
            "method": "ties", "base": str(base), "models": [second, str(e3)], "parameters": {"density": 0.5}}


def _listing(folder):
    return sorted(p.name for p in folder.iterdir())


def test_two_stages_equal_the_two_merges_run_by_hand_and_leave_no_intermediates(llamas, tmp_path):
    base, e1, e2, e3 = llamas
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(_two_stage(base, e1, e2, e3)))
    res = invoke(tmp_path / "r.yaml", "--out", tmp_path / "final")
    assert res.exit_code == 0, res.output
    assert _listing(tmp_path) == ["final", "r.yaml"]  # the stage folder is gone
    recorded = yaml.safe_load((tmp_path / "final" / "clmerge_recipe.yaml").read_text())
    # the stages' names, not their removed folders
    assert recorded["stages"][0]["name"] == "s1" and recorded["models"][0]["model"] == "s1"

    hand = tmp_path / "hand"
    hand.mkdir()
    assert invoke("--method", "task_arithmetic", "--base", base, "--expert", e1, "--expert", e2,
                  "--set", "scaling=0.7", "--out", hand / "s1").exit_code == 0
    assert invoke("--method", "ties", "--base", base, "--expert", hand / "s1", "--expert", e3,
                  "--set", "density=0.5", "--out", hand / "final").exit_code == 0
    got, want = folder_state(tmp_path / "final"), folder_state(hand / "final")
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_a_reference_to_an_unknown_or_later_stage_fails_before_anything_runs(llamas, tmp_path, monkeypatch):
    base, e1, e2, e3 = llamas
    calls = []
    monkeypatch.setattr(pipeline, "execute", lambda *a, **k: calls.append(a))
    for ref, words in (("s9", ["the final merge", "models[0].model", "'s9'", "s1"]),):
        (tmp_path / "r.yaml").write_text(yaml.safe_dump(_two_stage(base, e1, e2, e3, second=ref)))
        res = invoke(tmp_path / "r.yaml", "--out", tmp_path / "final")
        assert res.exit_code == 3, res.output
        assert all(w in res.stderr for w in words), res.stderr
    data = _two_stage(base, e1, e2, e3)
    data["stages"].insert(0, {"name": "s0", "method": "task_arithmetic", "base": str(base), "models": ["s1"]})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    res = invoke(tmp_path / "r.yaml", "--out", tmp_path / "final")
    assert res.exit_code == 3 and "stages[0] (s0)" in res.stderr and "runs later" in res.stderr, res.stderr
    assert calls == [] and _listing(tmp_path) == ["r.yaml"]


def test_the_intermediates_are_removed_on_a_failure_and_on_sigterm(llamas, tmp_path, monkeypatch):
    base, e1, e2, e3 = llamas
    recipe = load_recipe("", _two_stage(base, e1, e2, e3))
    real = pipeline.execute
    seen = []

    def second_call_fails(prep, out, *a, **k):
        seen.append(out)
        if len(seen) == 2:  # the final merge: stage s1 is on disk now
            assert any(p.name.startswith(".final.") for p in tmp_path.iterdir())
            os.kill(os.getpid(), signal.SIGTERM)
        return real(prep, out, *a, **k)

    monkeypatch.setattr(pipeline, "execute", second_call_fails)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exc:
        run_merge(recipe, tmp_path / "final")
    assert exc.value.code == 128 + signal.SIGTERM
    assert _listing(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) == handler  # the run's SIGTERM handler is gone again

    bad = _two_stage(base, e1, e2, e3)
    bad["stages"][0]["parameters"] = {"scaling": 1e39}  # stage s1 comes out Inf: the run fails in stage 1
    with pytest.raises(Exception, match="NaN or Inf"):
        run_merge(load_recipe("", bad), tmp_path / "final")
    assert _listing(tmp_path) == []


def test_a_slice_recipe_can_stack_the_layers_of_a_stage(llamas, tmp_path):
    base, e1, e2, _ = llamas
    data = {"stages": [{"name": "avg", "method": "weight_average", "models": [str(e1), str(e2)]}],
            "method": "passthrough", "slices": [[{"model": "avg", "layer_range": [0, 2]}],
                                                [{"model": str(base), "layer_range": [1, 2]}]]}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    res = invoke(tmp_path / "r.yaml", "--out", tmp_path / "final")
    assert res.exit_code == 0, res.output
    got, s1, s2, sb = (folder_state(p) for p in (tmp_path / "final", e1, e2, base))
    k = "mlp.up_proj.weight"
    torch.testing.assert_close(got[f"model.layers.1.{k}"], (s1[f"model.layers.1.{k}"] + s2[f"model.layers.1.{k}"]) / 2)
    assert torch.equal(got[f"model.layers.2.{k}"], sb[f"model.layers.1.{k}"])
    assert _listing(tmp_path) == ["final", "r.yaml"]
