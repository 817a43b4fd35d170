"""``lae``: online PET, its EMA as the offline PET, calibration epochs, and the max-probability ensemble,
transcribed from the official code (gqk/LAE at 1680e496b7ac7ffa408b13d3b1a53a9be9b87696, ``main.py``) and
LAMDA-PILOT's port (sun-hailong/LAMDA-PILOT at 264745534fc2233f5a50b020e50a3472c47eb756, ``models/lae.py``)."""

from __future__ import annotations


import pytest
import torch

from clmerge.config import load_config, parse_config
from clmerge.engine import run as run_mod
from clmerge.engine.run import prepare, run_experiment
from clmerge.methods.lae import LAEEnsemble, compensated_prefix_attention, ema_update, ensemble_logits
from _lora_cl_helpers import assert_same_checkpoint, resume_killed_copy
from conftest import tiny_config


def _cfg(n_tasks: int = 3, **method):
    return tiny_config(**{"method": {"name": "lae", "adapt_blocks": [0], **method}, "scenario.n_tasks": n_tasks,
                          "scenario.classes_per_task": [2] * n_tasks, "run.keep_checkpoints": n_tasks})


def test_the_ensemble_is_the_official_max_of_probabilities():
    """main.py lines 228-240 (eval_epoch): softmax of the online output, softmax of each offline output,
    ``torch.stack(output_emas, dim=-1).max(dim=-1)[0]``; PILOT models/lae.py _eval_cnn does the same."""
    g = torch.Generator().manual_seed(0)
    on, off = torch.randn(16, 7, generator=g), torch.randn(16, 7, generator=g) * 3
    official = torch.stack([on.softmax(dim=1), off.softmax(dim=1)], dim=-1).max(dim=-1)[0]
    ours = ensemble_logits(on, off, "max_prob")
    assert torch.allclose(ours.exp(), official, atol=1e-7)
    assert torch.equal(ours.argmax(1), official.argmax(1))
    energy = ensemble_logits(on, off, "energy")
    pick_on = torch.logsumexp(on, 1) >= torch.logsumexp(off, 1)
    assert torch.equal(energy[pick_on], on[pick_on]) and torch.equal(energy[~pick_on], off[~pick_on])


def test_the_offline_pet_is_timms_model_ema_v2():
    """timm ModelEmaV2._update (main.py line 211, post_train_step): ema = decay * ema + (1 - decay) * model;
    PILOT models/lae.py: param_ema.data * ema_decay + param * (1 - ema_decay)."""
    g = torch.Generator().manual_seed(1)
    online = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g)}
    ema = {k: torch.randn_like(v) for k, v in online.items()}
    expected = {k: ema[k] * 0.9 + (1.0 - 0.9) * online[k] for k in ema}
    ema_update(ema, online, 0.9)
    assert all(torch.equal(ema[k], expected[k]) for k in ema)


def _fit_recorder(monkeypatch):
    calls, real = [], run_mod.fit

    def fit(model, data, *, groups, **kw):
        calls.append({"groups": [g.get("name") for g in groups], "epochs": kw.get("epochs"),
                      "n": sum(len(g["params"]) for g in groups)})
        return real(model, data, groups=groups, **kw)

    monkeypatch.setattr(run_mod, "fit", fit)
    return calls


def test_calibration_trains_the_head_alone_for_num_freeze_epochs_after_the_first_task(tmp_path, monkeypatch):
    """main.py lines 183-194 (pre_train_epoch): no freezing in task 0; later tasks freeze the PETs for the
    first num_freeze_epochs epochs."""
    calls = _fit_recorder(monkeypatch)
    run_experiment(parse_config(_cfg(3, num_freeze_epochs=2)), tmp_path / "run")
    assert [c["groups"] for c in calls] == [["body", "head"], ["head"], ["body", "head"], ["head"], ["body", "head"]]
    assert [c["epochs"] for c in calls if c["groups"] == ["head"]] == [2, 2]
    calls.clear()
    run_experiment(parse_config(_cfg(2, num_freeze_epochs=1, freeze_first_task=True)), tmp_path / "run2")
    assert [c["groups"] for c in calls] == [["head"], ["body", "head"], ["head"], ["body", "head"]]


def test_the_offline_pet_starts_at_the_second_task_as_a_copy_and_follows_the_online_one(tmp_path):
    scenario, model, m, _ = prepare(parse_config(_cfg(2, ema_decay=0.5)))
    from _lora_cl_helpers import context

    assert m.ema == {} and m.pet_names and all(p.requires_grad for p in m._pet_params())
    assert not any(p.requires_grad for n, p in model.backbone.named_parameters() if f"backbone.{n}" not in
                   m.pet_names)
    ctx = context(scenario, 0)
    m.begin_task(scenario.tasks[0], ctx)
    assert m.ema == {}  # official: no offline PET in the first task
    with torch.no_grad():
        for p in m._pet_params():
            p.add_(0.1)
    m.after_step(model, ctx)  # nothing to update yet
    ctx1 = context(scenario, 1)
    m.options = m.options.model_copy(update={"num_freeze_epochs": 0})
    m.begin_task(scenario.tasks[1], ctx1)
    online = {n: p.detach().clone() for n, p in m._online().items()}
    assert all(torch.equal(m.ema[n], online[n]) for n in online)  # ModelEmaV2(self.pets): a copy
    with torch.no_grad():
        for p in m._pet_params():
            p.add_(1.0)
    m.after_step(model, ctx1)
    assert all(torch.allclose(m.ema[n], online[n] + 0.5) for n in online)
    # the ensemble runs the model twice: online PET, then the offline one swapped in; the live weights stay
    x = torch.randn(3, *scenario.tasks[0].train.batches(3).__next__()[0].shape[1:])
    model.eval()
    ens = LAEEnsemble(model, m)
    on = model(x)
    saved = {n: p.detach().clone() for n, p in m._online().items()}
    with torch.no_grad():
        for n, p in m._online().items():
            p.copy_(m.ema[n])
        off = model(x)
        for n, p in m._online().items():
            p.copy_(saved[n])
    assert torch.allclose(ens(x), ensemble_logits(on, off, "max_prob"), atol=1e-6)
    assert all(torch.equal(p, saved[n]) for n, p in m._online().items())


def test_ema_from_first_task_is_pilots():
    scenario, model, m, _ = prepare(parse_config(_cfg(2, ema_from="first_task")))
    assert m.ema and all(torch.equal(m.ema[n], p) for n, p in m._online().items())


def test_defaults_are_the_official_codes():
    cfg = load_config(None, ["method.name=lae"])
    o = cfg.method_options()
    assert (o.pet, o.adapt_blocks, o.bottleneck, o.rank, o.ema_decay, o.num_freeze_epochs, o.freeze_first_task,
            o.ema_from, o.ensemble) == ("adapter", [0, 1, 2, 3, 4], 5, 5, 0.9999, 3, False, "second_task",
                                        "max_prob")
    assert (cfg.optim.lr, cfg.head.loss) == (0.0028125, "local")
    with pytest.raises(Exception, match="pet"):
        load_config(None, ["method.name=lae", "method.pet=vpt"])
    assert load_config(None, ["method.name=lae", "method.pet=prefix"]).method_options().prefix_length == 10


@pytest.mark.parametrize("pet", ["adapter", "lora", "prefix"])
def test_blocks_the_backbone_lacks_are_refused(pet, tmp_path):
    with pytest.raises(ValueError, match=r"method.adapt_blocks=\[0, 3\]"):
        prepare(parse_config(_cfg(2, pet=pet, adapt_blocks=[0, 3])))


@pytest.mark.parametrize("pet", ["adapter", "lora", "prefix"])
def test_a_resumed_lae_run_gives_the_same_numbers(tmp_path, pet):
    data = _cfg(3, pet=pet, num_freeze_epochs=1, ema_decay=0.9)
    full = run_experiment(parse_config(data), tmp_path / "full")
    resumed = resume_killed_copy(parse_config(data), tmp_path / "full", "task_002.safetensors")  # killed after the second task
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    a, b = assert_same_checkpoint(tmp_path / "full", tmp_path / "resumed", "task_002.safetensors")  # the model (online PET, head) and the offline PET
    assert any(k.startswith("ema/") for k in a[1])


def _official_prefix_attention(x_q, k, v, prefix_k, prefix_v, num_heads):
    """LAE libml/model/backbone/vit.py lines 333-356 (Attention.forward) with the Prefix of
    libml/model/pet/prefix.py: the prefix tokens inserted at position 1 of the projected keys and values
    (pet/prompt.py Prompt.forward, lines 35-42), softmax, dropout (none), then Prefix.compensate (lines 34-46):
    the prefix columns divided by their sum."""
    B, N, C = x_q.shape
    k = torch.cat([k[:, :1], prefix_k.expand(B, -1, -1), k[:, 1:]], dim=1)
    v = torch.cat([v[:, :1], prefix_v.expand(B, -1, -1), v[:, 1:]], dim=1)
    q = x_q.reshape(B, N, num_heads, C // num_heads).permute(0, 2, 1, 3)
    k = k.reshape(B, -1, num_heads, C // num_heads).permute(0, 2, 1, 3)
    v = v.reshape(B, -1, num_heads, C // num_heads).permute(0, 2, 1, 3)
    attn = (q @ k.transpose(-2, -1)) * (C // num_heads) ** -0.5
    attn = attn.softmax(dim=-1)
    s, t = 1, 1 + prefix_k.shape[0]
    lamb = attn[..., s:t].sum(dim=-1, keepdim=True)
    attn = torch.cat([attn[..., :s], attn[..., s:t] / lamb.clamp(min=1e-12), attn[..., t:]], dim=-1)
    return (attn @ v).transpose(1, 2).reshape(B, N, C)


def test_the_prefix_attention_is_laes_compensated_one():
    g = torch.Generator().manual_seed(3)
    B, N, C, H, L = 2, 5, 8, 2, 3
    q, k, v = (torch.randn(B, N, C, generator=g) for _ in range(3))
    pk, pv = torch.rand(L, C, generator=g) * 0.5, torch.rand(L, C, generator=g)
    official = _official_prefix_attention(q, k, v, pk, pv, H)

    def heads(t):
        return t.reshape(t.shape[0], -1, H, C // H).transpose(1, 2)

    out, _ = compensated_prefix_attention(heads(q), heads(k), heads(v), heads(pk.expand(B, -1, -1)),
                                          heads(pv.expand(B, -1, -1)), scaling=(C // H) ** -0.5)
    assert torch.allclose(out.transpose(1, 2).reshape(B, N, C), official, atol=1e-6)


def test_the_prefix_pet_changes_the_backbone_and_trains(tmp_path):
    scenario, model, m, _ = prepare(parse_config(_cfg(2, pet="prefix")))
    assert sorted(m.pet_names) == ["backbone.lae_prefix.key", "backbone.lae_prefix.key_scale",
                                   "backbone.lae_prefix.value", "backbone.lae_prefix.value_scale"]
    x = next(scenario.tasks[0].train.batches(4))[0]
    model.eval()
    with_prefix = model.forward_features(x)
    with model.backbone.lae_prefix.mechanism.disabled():
        plain = model.forward_features(x)
    assert not torch.allclose(with_prefix, plain)
    w = torch.randn(with_prefix.shape, generator=torch.Generator().manual_seed(0))
    (with_prefix * w).sum().backward()  # (a plain sum of LayerNorm outputs has no gradient)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m._pet_params())

