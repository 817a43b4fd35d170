"""The prompt mechanism (adapters.prompt) and L2P / DualPrompt / CODA-Prompt (methods.prompts.methods)."""

import json

import pytest
import torch
import torch.nn.functional as F

from clmerge.adapters.prompt import PromptInput, attach_prompts
from clmerge.config import parse_config
from clmerge.engine.run import prepare, run_experiment
from clmerge.methods.base import TaskContext
from clmerge.models.backbones import hf_vision_from_config

from conftest import tiny_config

VIT3 = {"num_hidden_layers": 3, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}
METHODS = {
    "l2p": {"name": "l2p", "pool_size": 4, "length": 2, "top_n": 2},
    "dualprompt": {"name": "dualprompt", "g_layers": [0], "e_layers": [1, 2], "e_pool_size": 3, "g_length": 2,
                   "e_length": 2},
    "coda_prompt": {"name": "coda_prompt", "pool_size": 6, "length": 2, "layers": [0, 1], "ortho_mu": 0.1},
}


def _vit(impl: str = "eager", layers: int = 2):
    torch.manual_seed(0)
    cfg = dict(num_hidden_layers=layers, hidden_size=32, num_attention_heads=2, intermediate_size=64, image_size=16,
               patch_size=4, num_channels=1, attn_implementation=impl)
    return hf_vision_from_config("vit", cfg, mean=[0.5], std=[0.5])


# -- the mechanism ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_zero_length_prompts_are_bit_identical(impl):
    bb = _vit(impl)
    x = torch.rand(3, 1, 16, 16)
    plain = bb(x)
    mech = attach_prompts(bb, prefix_layers=[0, 1])
    empty = torch.zeros(3, 0, 32)
    with mech.using(PromptInput(tokens=empty, prefixes={0: (empty, empty), 1: (empty, empty)})):
        assert torch.equal(bb(x), plain)
    assert torch.equal(bb(x), plain) and torch.equal(mech.query(x), plain)  # no prompts armed: the plain backbone
    p = torch.randn(3, 4, 32)
    with mech.using(PromptInput(tokens=p, prefixes={0: (p, p)})):
        assert not torch.allclose(bb(x), plain)
        assert torch.equal(mech.query(x), plain)  # the query never sees the prompts
    mech.remove()
    assert torch.equal(bb(x), plain)


def test_prefix_matches_direct_transcription():
    """One block with a prefix: softmax(q [p_K; k]^T / sqrt(d)) [p_V; v] written out (DualPrompt Eq. 3)."""
    bb = _vit("eager", layers=1)
    inner = bb.inner
    x = torch.rand(2, 1, 16, 16)
    pk, pv = torch.randn(2, 3, 32), torch.randn(2, 3, 32)
    mech = attach_prompts(bb, prefix_layers=[0])
    with mech.using(PromptInput(prefixes={0: (pk, pv)})), torch.no_grad():
        got = bb(x)
    with torch.no_grad():
        h = inner.embeddings(bb.preprocess(x))  # (B, T, D)
        blk = inner.layers[0]
        a = blk.attention
        z = blk.layernorm_before(h)
        heads = lambda t: t.reshape(2, t.shape[1], 2, 16).transpose(1, 2)  # noqa: E731  (B, H, T, d)
        q, k, v = heads(a.q_proj(z)), heads(torch.cat([pk, a.k_proj(z)], 1)), heads(torch.cat([pv, a.v_proj(z)], 1))
        att = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1) @ v  # (B, H, T, d)
        h = h + a.o_proj(att.transpose(1, 2).reshape(2, -1, 32))
        h = h + blk.mlp(blk.layernorm_after(h))
        want = inner.layernorm(h)[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("feature", ["cls", "prompt_mean"])
def test_prompt_tokens_enter_after_the_embeddings(feature):
    bb = _vit("sdpa")
    x, p = torch.rand(2, 1, 16, 16), torch.randn(2, 3, 32)
    mech = attach_prompts(bb, feature=feature)
    with mech.using(PromptInput(tokens=p)), torch.no_grad():
        got = bb(x)
    with torch.no_grad():
        e = bb.inner.embeddings(bb.preprocess(x))
        h = torch.cat([e[:, :1], p, e[:, 1:]], 1)
        for blk in bb.inner.layers:
            h = blk(h)
        h = bb.inner.layernorm(h)
        want = h[:, 0] if feature == "cls" else h[:, 1:4].mean(1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_clip_vision_zero_prefix_identity():
    torch.manual_seed(0)
    bb = hf_vision_from_config("clip", dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                            intermediate_size=64, image_size=16, patch_size=4, num_channels=3),
                               mean=[0.5], std=[0.5])
    x = torch.rand(2, 3, 16, 16)
    plain = bb(x)
    mech = attach_prompts(bb, prefix_layers=[1])
    empty = torch.zeros(2, 0, 32)
    with mech.using(PromptInput(tokens=empty, prefixes={1: (empty, empty)})):
        assert torch.equal(bb(x), plain)


# -- the methods ----------------------------------------------------------------------------------------------
def _setup(method: dict, n_tasks: int = 2):
    cfg = parse_config(tiny_config(**{"scenario.n_tasks": n_tasks, "scenario.classes_per_task": [2] * n_tasks,
                                      "method": method, "model.config": VIT3}))
    scenario, model, meth, _ = prepare(cfg)
    return scenario, model, meth


def _train(model, meth, task, tasks, *, steps=12, lr=0.05, weight_decay=0.0):
    ctx = TaskContext(task=task, seen_tasks=tasks[: task.index + 1], device=torch.device("cpu"),
                      generator=torch.Generator().manual_seed(task.index), n_tasks=len(tasks))
    meth.begin_task(task, ctx)
    params = [p for g in meth.parameter_groups(model) for p in g["params"]]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    model.train()
    gen = torch.Generator().manual_seed(1)
    for i, (x, y) in enumerate(task.train.batches(16, shuffle=True, generator=gen)):
        if i == steps:
            break
        opt.zero_grad()
        meth.loss(model, x, y, ctx).backward()
        opt.step()
        meth.after_step(model, ctx)
    model.eval()
    return ctx


def _queries(meth, task) -> torch.Tensor:
    return torch.cat([meth.mechanism.query(x) for x, _ in task.train.batches(64)])


def test_l2p_selected_keys_move_toward_their_queries():
    scenario, model, meth = _setup(METHODS["l2p"] | {"pull_weight": 1.0})
    task = scenario.tasks[0]
    q = _queries(meth, task)

    def selected_cos() -> float:
        sim = F.normalize(q, dim=1) @ F.normalize(model.prompts.keys.detach(), dim=1).t()
        return float(torch.topk(sim, 2, dim=1).values.mean())

    before = selected_cos()
    _train(model, meth, task, scenario.tasks)
    assert selected_cos() > before + 0.05
    assert model.backbone.inner.embeddings.cls_token.grad is None  # the backbone stays frozen


def test_dualprompt_task_key_moves_toward_its_queries_and_others_stay():
    scenario, model, meth = _setup(METHODS["dualprompt"])
    task = scenario.tasks[0]
    q = F.normalize(_queries(meth, task), dim=1)
    keys0 = model.prompts.keys.detach().clone()
    e0 = model.prompts.e_prompts.detach().clone()
    before = float((q @ F.normalize(keys0[0], dim=0)).mean())
    _train(model, meth, task, scenario.tasks)
    keys = model.prompts.keys.detach()
    assert float((q @ F.normalize(keys[0], dim=0)).mean()) > before + 0.05
    assert torch.equal(keys[1:], keys0[1:])  # only the true task's key and E-prompt train (paper, code mask)
    assert torch.equal(model.prompts.e_prompts[:, :, 1:], e0[:, :, 1:])


def test_coda_old_components_unchanged_and_new_ones_orthogonal():
    scenario, model, meth = _setup(METHODS["coda_prompt"])
    pool = model.prompts
    _train(model, meth, scenario.tasks[0], scenario.tasks)
    after0 = [p.detach().clone() for p in (pool.components, pool.keys, pool.attention)]
    ctx = _train(model, meth, scenario.tasks[1], scenario.tasks, weight_decay=0.1)  # decay cannot move them either
    for p, old in zip((pool.components, pool.keys, pool.attention), after0):
        assert torch.equal(p[:, :3], old[:, :3])  # components of task 0: pool 6 / 2 tasks = 3 each
        assert not torch.equal(p[:, 3:], old[:, 3:])
    # Gram-Schmidt init of task 1's block: orthonormal and orthogonal to task 0's (trained) block
    fresh = _setup(METHODS["coda_prompt"])[1].prompts
    fresh.start_task(0, 2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        fresh.keys[:, :3] += 0.3  # stand-in for training: old rows no longer orthonormal
    fresh.start_task(1, 2, torch.Generator().manual_seed(1))
    k = fresh.keys[0].detach().double()
    torch.testing.assert_close(k[3:] @ k[3:].t(), torch.eye(3, dtype=torch.float64), atol=1e-6, rtol=0)
    assert float((k[3:] @ k[:3].t()).abs().max()) < 1e-6
    assert ctx.task.index == 1


def test_coda_prompt_is_the_attention_weighted_sum():
    """alpha_m = cos(q * A_m, K_m), p = sum_m alpha_m P_m, split into key/value halves (CODA-Prompt Eq. 4-6)."""
    scenario, model, meth = _setup(METHODS["coda_prompt"] | {"length": 4})
    pool = model.prompts
    pool.start_task(1, 2, torch.Generator().manual_seed(0))
    pool.eval()
    q = torch.randn(5, 32)
    out = pool.select(q)
    i, f = 1, 6
    a, k, comps = pool.attention[i, :f], pool.keys[i, :f], pool.components[i, :f]
    alpha = torch.stack([torch.stack([F.cosine_similarity(q[b] * a[m], k[m], dim=0) for m in range(f)])
                         for b in range(5)])
    p = (alpha[:, :, None, None] * comps[None]).sum(1)
    torch.testing.assert_close(out.prefixes[1][0], p[:, :2])
    torch.testing.assert_close(out.prefixes[1][1], p[:, 2:])


@pytest.mark.parametrize("name", list(METHODS))
def test_end_to_end_run_records_selection(tmp_path, name):
    cfg = parse_config(tiny_config(**{"method": METHODS[name], "model.config": VIT3}))
    metrics = run_experiment(cfg, tmp_path / "r")
    rec = metrics["method_metrics"]["prompt_selection"]
    assert [r["task"] for r in rec] == [0, 1]
    assert len(rec[1]["test_counts"]) == 2 and len(rec[1]["task_id_acc"]) == 2
    assert all(0.0 <= a <= 100.0 for a in rec[1]["task_id_acc"])
    assert len(metrics["accuracy_matrix"]) == 2
    if name == "dualprompt":  # training uses the true task's E-prompt: all counts on its index
        assert rec[0]["train_counts"][0] > 0 and rec[0]["train_counts"][1:] == [0.0, 0.0]


def test_bad_layer_index_is_a_clear_error():
    with pytest.raises(ValueError, match=r"method.e_layers: layer\(s\) \[5\]"):
        _setup(METHODS["dualprompt"] | {"e_layers": [1, 5]})


def test_resume_after_crash_gives_identical_metrics(tmp_path, monkeypatch):
    from clmerge.methods.prompts.methods import CodaPrompt

    cfg = parse_config(tiny_config(**{"scenario.n_tasks": 3, "scenario.classes_per_task": [2, 2, 2],
                                      "method": METHODS["coda_prompt"], "model.config": VIT3}))
    full = run_experiment(cfg, tmp_path / "full")
    original = CodaPrompt.end_task

    def crash_on_task_2(self, task, ctx):
        if task.index == 2:
            raise RuntimeError("simulated crash")
        return original(self, task, ctx)

    monkeypatch.setattr(CodaPrompt, "end_task", crash_on_task_2)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_experiment(cfg, tmp_path / "crashed")
    monkeypatch.setattr(CodaPrompt, "end_task", original)
    resumed = run_experiment(cfg, tmp_path / "crashed", resume=True)
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    assert resumed["method_metrics"] == full["method_metrics"]
    events = lambda d: [json.loads(x)["event"] for x in (d / "events.jsonl").read_text().splitlines()]  # noqa: E731
    assert events(tmp_path / "full") == events(tmp_path / "crashed")
