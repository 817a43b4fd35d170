"""APER against the official code's rules: LAMDA-PILOT at 2647455 (models/aper_adapter.py, aper_finetune.py,
backbone/linears.py, utils/inc_net.py; the APER repository's method files are PILOT's).

- The first session trains through ``SimpleVitNet`` (models/aper_adapter.py:28, aper_finetune.py:26), whose
  ``fc`` is ``CosineLinear`` (utils/inc_net.py:570-572): ``σ · cos(f, w_c)`` with a learned σ
  (backbone/linears.py:37-67; σ starts at 1, ``w`` uniform in ±1/√d, linears.py:51-55), trained with
  ``F.cross_entropy`` of its logits (models/aper_adapter.py, aper_finetune.py:116-118).
- ``aper_finetune`` optimises ``self._network.parameters()`` (models/aper_finetune.py:91-96): the whole
  backbone, in the first task only (``_train``, :90); then ``construct_dual_branch_network`` (:97, :103-106;
  utils/inc_net.py ``MultiBranchCosineIncrementalNet``) concatenates the pretrained backbone's features with
  the fine-tuned one's, and ``replace_fc`` (:37-61) sets each class's prototype to the mean of those features.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from clmerge.config import load_config, parse_config
from clmerge.engine import run as run_mod
from clmerge.engine.checkpoint import load_checkpoint, load_head_tensors
from clmerge.engine.run import run_experiment
from clmerge.engine.setup import prepare
from clmerge.methods import METHODS
from clmerge.methods.first_session import CosineClassifier, FirstSessionHead
from _lora_cl_helpers import uncommit_checkpoint
from conftest import tiny_config


def _official_cosine_logits(x: torch.Tensor, weight: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """backbone/linears.py:57-67 (nb_proxy 1, no reduction), transcribed."""
    return sigma * F.linear(F.normalize(x, p=2, dim=1), F.normalize(weight, p=2, dim=1))


def test_the_cosine_head_is_pilots_cosine_linear_with_a_learned_scale():
    head = CosineClassifier(24, 5, generator=torch.Generator().manual_seed(0))
    assert head.sigma.requires_grad and float(head.sigma.detach()) == 1.0  # linears.py:45-46, 54-55
    assert head.weight.abs().max() <= 1 / math.sqrt(24)  # linears.py:52-53: uniform in ±1/sqrt(d)
    x = torch.randn(6, 24)
    with torch.no_grad():
        head.sigma.fill_(7.5)
    torch.testing.assert_close(head(x), _official_cosine_logits(x, head.weight, head.sigma))
    F.cross_entropy(head(x), torch.arange(5).repeat(2)[:6]).backward()
    assert head.sigma.grad is not None and float(head.sigma.grad) != 0.0  # sigma is trained


def _recording(monkeypatch) -> tuple[list, list]:
    """The engine's fit calls (group -> model parameter names) and the first-session heads as discarded."""
    calls, heads, real_fit, real_stop = [], [], run_mod.fit, FirstSessionHead.stop

    def fit(model, data, *, groups, **kw):
        names = {id(p): n for n, p in model.named_parameters()}
        calls.append({g["name"]: [names.get(id(p), "<first-session head>") for p in g["params"]]
                      for g in groups})
        return real_fit(model, data, groups=groups, **kw)

    def stop(self):
        heads.append(None if self.cosine is None else {k: v.detach().clone()
                                                        for k, v in self.cosine.state_dict().items()})
        real_stop(self)

    monkeypatch.setattr(run_mod, "fit", fit)
    monkeypatch.setattr(FirstSessionHead, "stop", stop)
    return calls, heads


def _cfg(method: dict, n_tasks: int = 2, **kw):
    return parse_config(tiny_config(**{"method": method, "scenario.n_tasks": n_tasks,
                                       "scenario.classes_per_task": [2] * n_tasks, "run.keep_checkpoints": 2,
                                       **kw}))


@pytest.mark.parametrize("name", ["aper", "aper_finetune"])
def test_the_first_session_trains_the_cosine_head_and_its_scale_by_default(name, tmp_path, monkeypatch):
    assert load_config(None, [f"method.name={name}"]).method_options().adapt_head == "cosine"
    calls, heads = _recording(monkeypatch)
    method = {"name": name, **({"bottleneck": 4} if name == "aper" else {})}
    run_experiment(_cfg(method), tmp_path / "run")
    assert len(calls) == 1 and calls[0]["head"] == ["<first-session head>"] * 2  # weight and sigma
    assert len(heads) == 1 and float(heads[0]["sigma"]) != 1.0  # the scale moved from its initial 1
    # (the model's own linear head is in no group: it trains with the linear option only)


def test_the_linear_first_session_head_is_a_named_option(tmp_path, monkeypatch):
    calls, heads = _recording(monkeypatch)
    run_experiment(_cfg({"name": "aper", "bottleneck": 4, "adapt_head": "linear"}), tmp_path / "run")
    assert len(calls) == 1 and calls[0]["head"] and all(n.startswith("head.") for n in calls[0]["head"])
    assert heads == [None]
    with pytest.raises(Exception, match="adapt_head"):
        load_config(None, ["method.name=aper", "method.adapt_head=ncm"])


def test_aper_finetune_trains_the_whole_backbone_in_the_first_task_only(tmp_path, monkeypatch):
    """models/aper_finetune.py:90-100: all of ``self._network`` in task 0; nothing trains afterwards."""
    assert "aper_finetune" in METHODS and METHODS["aper_finetune"].optim_defaults["lr"] > 0
    calls, _ = _recording(monkeypatch)
    cfg = _cfg({"name": "aper_finetune"}, 3)
    run_experiment(cfg, tmp_path / "run")
    _, model, _, _ = prepare(cfg)
    backbone = sorted(n for n, _ in model.named_parameters() if n.startswith("backbone."))
    assert len(calls) == 1 and sorted(calls[0]["body"]) == backbone
    ck = tmp_path / "run" / "checkpoints"
    s1, s2 = (load_checkpoint(ck / f"task_00{t}.safetensors")[0] for t in (1, 2))
    assert all(torch.equal(s1[k], s2[k]) for k in s1 if k.startswith("backbone."))
    fresh = model.state_dict()
    assert any(not torch.equal(s1[k], fresh[k]) for k in backbone)  # it did fine-tune


def test_aper_finetune_prototypes_are_means_of_pretrained_and_finetuned_features(tmp_path):
    """models/aper_finetune.py:47 and 53-60 on utils/inc_net.py MultiBranchCosineIncrementalNet.forward: the
    prototype of class c is the mean over its training images of [pretrained(x); fine-tuned(x)]."""
    cfg = _cfg({"name": "aper_finetune"})
    run_experiment(cfg, tmp_path / "ft")
    run_experiment(_cfg({"name": "simplecil"}), tmp_path / "simplecil")
    ck = "checkpoints/task_001.safetensors"
    protos, simple = load_head_tensors(tmp_path / "ft" / ck), load_head_tensors(tmp_path / "simplecil" / ck)
    scenario, pretrained, _, _ = prepare(cfg)
    _, tuned, _, _ = prepare(cfg)
    state = load_checkpoint(tmp_path / "ft" / ck)[0]
    tuned.load_state_dict({k: v for k, v in state.items() if not k.startswith("head.")}, strict=False)
    pretrained.eval(), tuned.eval()
    d = pretrained.backbone.feature_dim
    with torch.no_grad():
        for task in scenario.tasks:
            xs, ys = zip(*task.train.batches(50))
            x, y = torch.cat(xs), torch.cat(ys)
            feats = torch.cat([pretrained.forward_features(x), tuned.forward_features(x)], -1).double()
            for c in y.unique().tolist():
                proto = protos[f"stats.mean.{c}"]
                assert proto.shape == (2 * d,)
                torch.testing.assert_close(proto, feats[y == c].mean(0), atol=1e-6, rtol=1e-6)
                torch.testing.assert_close(proto[:d], simple[f"stats.mean.{c}"], atol=1e-6, rtol=1e-6)
                assert not torch.allclose(proto[:d], proto[d:])


def test_a_resumed_aper_finetune_run_gives_the_same_numbers(tmp_path):
    cfg = tiny_config(**{"method": {"name": "aper_finetune"}, "scenario.n_tasks": 2,
                         "scenario.classes_per_task": [2, 2], "run.keep_checkpoints": 2})
    full = run_experiment(parse_config(cfg), tmp_path / "full")
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    (tmp_path / "resumed" / "metrics.json").unlink()
    uncommit_checkpoint(tmp_path / "resumed", "task_001.safetensors")  # killed after the first task
    resumed = run_experiment(parse_config(cfg), tmp_path / "resumed", resume=True)
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    method = load_checkpoint(tmp_path / "full" / "checkpoints" / "task_000.safetensors")[1]
    assert any(k.startswith("pretrained.") for k in method)  # the pretrained branch is checkpointed
