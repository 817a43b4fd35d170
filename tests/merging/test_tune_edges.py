"""``clmerge merge --tune``: a best value at the edge of its range is announced and the grid extended past it
(the rule of a sweep's ``select:``, utils.grid_edge.past_edge), and a tune can maximise a task accuracy."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

import clmerge.merging.tune as tune_mod
from clmerge.merging.lm_eval import load_causal_lm
from clmerge.merging.recipes import load_recipe
from clmerge.merging.task_eval import EvalSpec
from clmerge.merging.tune import Dimension, TuneSpec, load_tune_spec, tune
from clmerge.sweep.executors import LocalExecutor
from clmerge.sweep.select import next_value
from clmerge.sweep.select_spec import SelectSpec
from clmerge.utils.grid_edge import past_edge
from tune_helpers import W_STAR, planted_pair


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    root, data = planted_pair(tmp_path_factory.mktemp("planted"))
    return root, load_recipe("", data)


def _spec(root, low, high, points, **kw) -> TuneSpec:
    return TuneSpec(space=[Dimension("parameters.scaling", low, high)],
                    eval=EvalSpec(str(root / "heldout.txt"), max_length=64, batch_size=8), points=points, **kw)


def test_one_edge_rule_for_select_and_tune():
    assert past_edge([0.0, 0.1, 0.2], [0.0, 0.1, 0.2], 0.2, scale="linear") == 0.3
    assert past_edge([0.0, 0.1, 0.2], [0.0, 0.1, 0.2, 0.3], 0.3, scale="linear") == 0.4
    assert past_edge([0.0, 0.5, 1.0], [0.0, 0.5, 1.0], 0.0, scale="linear") == -0.5
    assert past_edge([0.0, 0.5, 1.0], [0.0, 0.5, 1.0], 0.5, scale="linear") is None
    sel = SelectSpec("optim.lr", [1e-3, 3e-3, 1e-2], extend=2)
    assert next_value(sel, [1e-3, 3e-3, 1e-2], 1e-2) == past_edge(sel.values, [1e-3, 3e-3, 1e-2], 1e-2) == 3e-2


def test_a_best_value_at_the_top_edge_extends_the_range_until_it_is_interior(planted, tmp_path):
    root, recipe = planted
    lines: list[str] = []
    info = tune(recipe, _spec(root, 0.0, 0.2, 3), tmp_path / "out", executor=LocalExecutor(0), log=lines.append)
    warned = [ln for ln in lines if ln.startswith("warning: best parameters.scaling=")]
    assert "extending the range: trying 0.3" in warned[0] and "trying 0.4" in warned[1] and len(warned) == 2
    assert info["best"]["parameters.scaling"] == W_STAR and info["trials"] == 5 and info["at_edge"] == []


def test_without_extend_the_edge_is_a_warning_and_recorded(planted, tmp_path):
    root, recipe = planted
    lines: list[str] = []
    info = tune(recipe, _spec(root, 0.0, 0.2, 3, extend=0), tmp_path / "out", executor=LocalExecutor(0),
                log=lines.append)
    assert info["best"]["parameters.scaling"] == 0.2 and info["trials"] == 3
    assert info["at_edge"] == ["parameters.scaling"]
    assert any("is at the edge of the values tried (0 to 0.2)" in ln and "widen space.parameters.scaling" in ln
               for ln in lines)


def test_a_value_that_fails_past_the_edge_stops_the_extension_with_a_warning(planted, tmp_path, monkeypatch):
    root, recipe = planted
    real = tune_mod.run_trial

    def trial(recipe, values, opts, workdir):  # as a density above 1 fails in the merge kernel
        if values["parameters.scaling"] > 0.25:
            raise ValueError("scaling must be at most 0.25 here")
        return real(recipe, values, opts, workdir)

    monkeypatch.setattr(tune_mod, "run_trial", trial)
    lines: list[str] = []
    info = tune(recipe, _spec(root, 0.0, 0.2, 3), tmp_path / "out", executor=LocalExecutor(0), log=lines.append)
    assert any("parameters.scaling=0.3 past the edge failed (scaling must be at most 0.25 here)" in ln
               for ln in lines)
    assert info["best"]["parameters.scaling"] == 0.2 and info["trials"] == 3
    assert info["at_edge"] == ["parameters.scaling"]


def _mixture(root):
    """The model the held-out text was sampled from: (1 - W_STAR) A + W_STAR B."""
    a, tok = load_causal_lm(root / "A")
    b, _ = load_causal_lm(root / "B")
    sb = b.state_dict()
    a.load_state_dict({k: (1 - W_STAR) * v + W_STAR * sb[k] for k, v in a.state_dict().items()})
    return a, tok


def test_a_tune_maximises_multiple_choice_accuracy(planted, tmp_path):
    root, recipe = planted
    mix, tok = _mixture(root)
    g = torch.Generator().manual_seed(5)
    words = sorted(w for w in tok.get_vocab() if w.startswith("w"))  # (get_vocab's order varies)
    records = []
    for _ in range(40):  # the answer: the mixture's most likely next word; three other words
        q = " ".join(words[int(i)] for i in torch.randint(len(words), (5,), generator=g))
        with torch.no_grad():
            logits = mix(input_ids=torch.tensor([tok(q)["input_ids"]])).logits[0, -1]
        ranked = [tok.convert_ids_to_tokens(int(i)) for i in logits.argsort(descending=True)]
        ranked = [w for w in ranked if w.startswith("w")]
        records.append({"question": q, "choices": [ranked[5], ranked[0], ranked[9], ranked[15]], "answer": 1})
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "tune.yaml").write_text(yaml.safe_dump({"points": 11, "space": {"parameters.scaling": [0.0, 1.0]},
                                                         "eval": {"data": "mc.jsonl", "batch_size": 16}}))
    spec = load_tune_spec(tmp_path / "tune.yaml")
    assert spec.eval.kind == "multiple_choice" and spec.eval.higher_is_better
    lines: list[str] = []
    info = tune(recipe, spec, tmp_path / "out", executor=LocalExecutor(0), log=lines.append)
    assert info["metric_name"] == "acc" and info["metric"] == 100.0  # the mixture itself answers every one
    assert abs(info["best"]["parameters.scaling"] - W_STAR) <= 0.1
    accs = [float(ln.split(" acc ")[1].split()[0]) for ln in lines if ln.startswith("trial ")]
    assert len(accs) == 11 and accs[0] < 100.0 and accs[-1] < 100.0  # A alone and B alone miss some


def test_a_tune_scores_trials_with_lm_evaluation_harness_tasks(planted, tmp_path, monkeypatch):
    """eval: {tasks: [...]} runs each trial's merged model through simple_evaluate (a fake lm_eval here, whose
    accuracy is highest for the model nearest the planted mixture)."""
    import sys
    import types

    root, recipe = planted
    mix, _ = _mixture(root)
    target = mix.lm_head.weight.detach().clone()
    calls = []

    class HFLM:
        def __init__(self, pretrained, tokenizer, batch_size):
            self.model = pretrained

    def simple_evaluate(model, tasks, num_fewshot, limit):
        calls.append((tasks, num_fewshot, limit))
        distance = float((model.model.lm_head.weight.detach() - target).norm())
        return {"results": {t: {"acc,none": 1.0 / (1.0 + distance)} for t in tasks}}

    top, hf = types.ModuleType("lm_eval"), types.ModuleType("lm_eval.models.huggingface")
    top.simple_evaluate, hf.HFLM = simple_evaluate, HFLM
    for name, mod in (("lm_eval", top), ("lm_eval.models", types.ModuleType("lm_eval.models")),
                      ("lm_eval.models.huggingface", hf)):
        monkeypatch.setitem(sys.modules, name, mod)
    (tmp_path / "tune.yaml").write_text(yaml.safe_dump({"points": 5, "space": {"parameters.scaling": [0.0, 1.0]},
                                                         "eval": {"tasks": "hellaswag", "max_samples": 7}}))
    spec = load_tune_spec(tmp_path / "tune.yaml")
    info = tune(recipe, spec, tmp_path / "out", executor=LocalExecutor(0))
    assert calls[0] == (["hellaswag"], None, 7) and len(calls) == 5
    assert info["metric_name"] == "lm_eval acc" and info["best"]["parameters.scaling"] == 0.25  # nearest 0.3
