"""WUDI-Merging: the objective against a transcription of the paper's, the closed-form gradient against
autograd, the optimiser against FusionBench's loop written out, the known minimisers, streaming and
determinism."""

from __future__ import annotations

import pytest
import torch

from clmerge import merging
from clmerge.merging.methods.wudi import wudi_matrix, wudi_objective

W, B, E = "blk.fc.weight", "blk.fc.bias", "embed_tokens.weight"


def models(num_tasks=3, shape=(6, 4), seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    shapes = {W: shape, B: (shape[0],), E: (5, shape[1])}
    base = {k: torch.randn(s, generator=g, dtype=dtype) for k, s in shapes.items()}
    return base, [{k: v + 0.1 * torch.randn(v.shape, generator=g, dtype=dtype) for k, v in base.items()}
                  for _ in range(num_tasks)]


def ref_objective(tau_m, taus):
    """The paper's loss, term by term: sum_i ||(tau_m - tau_i) tau_i^T||_F^2 / ||tau_i||_F^2."""
    total = 0.0
    for t in taus:
        total = total + torch.linalg.matrix_norm((tau_m - t) @ t.T) ** 2 / torch.linalg.matrix_norm(t) ** 2
    return total


def ref_wudi(taus, steps, lr):
    """FusionBench's ``wudi_merging`` loop on one matrix: init sum, Adam(lr, no weight decay), autograd."""
    p = torch.nn.Parameter(torch.stack(taus).sum(0))
    opt = torch.optim.Adam([p], lr=lr, weight_decay=0)
    tvs = torch.stack(taus)
    norms = torch.square(torch.norm(tvs.reshape(len(taus), -1), p=2, dim=-1))
    for _ in range(steps):
        loss = torch.sum(torch.square((p.unsqueeze(0) - tvs) @ tvs.transpose(1, 2)) / norms[:, None, None])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return p.detach()


def taus_of(base, ex, key=W):
    return [e[key] - base[key] for e in ex]


def test_objective_is_the_papers_and_the_gradient_is_autograds():
    base, ex = models(3)
    taus = torch.stack(taus_of(base, ex))
    tau_m = torch.randn(taus.shape[1:], dtype=torch.float64, requires_grad=True)
    obj = wudi_objective(tau_m, taus)
    torch.testing.assert_close(obj, ref_objective(tau_m.detach(), list(taus)))
    obj.backward()
    from clmerge.merging.methods.wudi import _quadratic

    h, c = _quadratic(taus)
    torch.testing.assert_close(2 * (tau_m.detach() @ h - c), tau_m.grad)


@pytest.mark.parametrize("shape", [(6, 4), (4, 6)])
def test_merge_matches_fusionbench_loop_and_lowers_the_objective(shape):
    base, ex = models(3, shape)
    out = merging.merge("wudi", base=base, experts=ex, steps=50, lr=1e-3)
    taus = taus_of(base, ex)
    want = ref_wudi(taus, 50, 1e-3)
    torch.testing.assert_close(out[W] - base[W], want, atol=1e-10, rtol=1e-10)
    stacked = torch.stack(taus)
    init = wudi_objective(stacked.sum(0), stacked)
    assert wudi_objective(want, stacked) < 0.9 * init
    default = merging.merge("wudi", base=base, experts=ex)[W] - base[W]  # 300 Adam steps at lr 1e-5
    assert wudi_objective(default, stacked) < init
    for key in (B, E):  # non-matrix tensors (the embedding, by the default rule): the mean task vector
        torch.testing.assert_close(out[key], base[key] + torch.stack(taus_of(base, ex, key)).mean(0))


def test_defaults_are_fusionbench_and_a_long_run_reaches_the_closed_form_minimiser():
    hp = merging.get_method("wudi").hyperparameters()
    assert (hp["steps"], hp["lr"], hp["optimizer"]) == (300, 1e-5, "adam")
    base, ex = models(3, (6, 4))
    taus = torch.stack(taus_of(base, ex))
    from clmerge.merging.methods.wudi import _quadratic

    h, c = _quadratic(taus)
    star = torch.linalg.solve(h, c.T).T  # tau_m H = C, H symmetric positive definite here (n = 4 < 3 * 6)
    got = wudi_matrix(taus, steps=3000, lr=1e-2)
    torch.testing.assert_close(got, star, atol=1e-6, rtol=1e-6)
    assert wudi_objective(star, taus) <= wudi_objective(got, taus) + 1e-12


def test_one_task_is_a_minimiser_and_stays_put():
    base, ex = models(1)
    tau = torch.stack(taus_of(base, ex))
    assert float(wudi_objective(tau[0], tau)) == 0.0  # the minimum of a sum of squares
    out = merging.merge("wudi", base=base, experts=ex, steps=20, lr=1e-2)
    for key in base:
        torch.testing.assert_close(out[key], ex[0][key], atol=1e-12, rtol=0)


def test_sgd_option_and_a_zero_task_vector_has_no_term():
    base, ex = models(2)
    ex.append({k: v.clone() for k, v in base.items()})  # a third "expert" equal to the base
    out = merging.merge("wudi", base=base, experts=ex, steps=5, lr=1e-3, optimizer="sgd")
    assert torch.isfinite(out[W]).all()
    taus = torch.stack(taus_of(base, ex))
    p = taus.sum(0)
    for _ in range(5):  # plain gradient descent on the two nonzero terms
        q = p.clone().requires_grad_(True)
        ref_objective(q, list(taus[:2])).backward()
        p = p - 1e-3 * q.grad
    torch.testing.assert_close(out[W] - base[W], p, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("kw, words", [({"steps": -1}, "steps must be an integer >= 0"),
                                       ({"lr": 0.0}, "lr must be > 0"),
                                       ({"optimizer": "lbfgs"}, "optimizer must be one of adam, sgd")])
def test_bad_arguments(kw, words):
    base, ex = models(2)
    with pytest.raises(ValueError, match=words):
        merging.merge("wudi", base=base, experts=ex, **kw)


def test_the_command_streams_an_hf_folder_and_repeats_exactly(tmp_path):
    transformers = pytest.importorskip("transformers")
    from checkpoint_helpers import folder_state, invoke

    from clmerge.merging.io import open_checkpoint

    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    for i, name in enumerate(["base", "e0", "e1"]):
        torch.manual_seed(0)  # the experts start from the base's weights
        model = transformers.LlamaModel(cfg)
        if name != "base":
            g = torch.Generator().manual_seed(i)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * torch.randn(p.shape, generator=g))
        model.save_pretrained(tmp_path / name)
    args = ["--method", "wudi", "--set", "steps=10", "--set", "lr=1e-4", "--base", tmp_path / "base",
            "--expert", tmp_path / "e0", "--expert", tmp_path / "e1"]
    for out in ("m1", "m2"):
        r = invoke(*args, "--out", tmp_path / out)
        assert r.exit_code == 0, r.output
    a, b = folder_state(tmp_path / "m1"), folder_state(tmp_path / "m2")
    assert all(torch.equal(a[k], b[k]) for k in a)  # no randomness: bit for bit the same
    base = open_checkpoint(tmp_path / "base")
    want = merging.merge("wudi", base=base, experts=[open_checkpoint(tmp_path / e) for e in ("e0", "e1")],
                         steps=10, lr=1e-4)
    key = "layers.0.mlp.down_proj.weight"
    torch.testing.assert_close(a[key], want[key], atol=0, rtol=0)
    assert not torch.equal(a[key], base.get(key))
