"""OPCM and DOP against transcriptions of their definitions (the papers' equations as FusionBench's reference code
computes them), and their streaming merges against the continual protocol's running state."""

from __future__ import annotations

import math

import pytest
import torch

from clmerge import merging
from clmerge.harness.merge_bench_continual import make_merger
from clmerge.merging.methods.dop import dop_fold, dop_matrix, energy_rank, min_norm_weight
from clmerge.merging.methods.opcm import opcm_project, opcm_split_rank


def _full_svd_projection(merged: torch.Tensor, tau: torch.Tensor, alpha: float) -> torch.Tensor:
    """OPCM's projection step by step: full SVD, coefficients in the basis u_i v_j^T, the top-left block and the
    diagonal set to zero, back to the original basis; the split rank is the first index whose cumulative share
    exceeds alpha."""
    u, s, vh = torch.linalg.svd(merged, full_matrices=True)
    v = vh.T
    k = int((s.cumsum(0) / s.sum() > alpha).float().argmax())
    coef = u.T @ tau @ v
    coef.diagonal().fill_(0)
    coef[:k, :k] = 0
    return u @ coef @ v.T


@pytest.mark.parametrize("shape", [(12, 7), (7, 12), (9, 9)])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 0.9])
def test_opcm_projection_is_the_transcription_and_orthogonal_to_the_stored_subspace(shape, alpha):
    g = torch.Generator().manual_seed(1)
    merged = torch.randn(*shape, generator=g, dtype=torch.float64)
    tau = torch.randn(*shape, generator=g, dtype=torch.float64)
    got = opcm_project(merged, tau, alpha=alpha)
    torch.testing.assert_close(got, _full_svd_projection(merged, tau, alpha))
    u, s, vh = torch.linalg.svd(merged, full_matrices=False)
    k = opcm_split_rank(s, alpha)
    coef = u.T @ got @ vh.T
    assert k == 0 or coef[:k, :k].abs().max().item() < 1e-12  # nothing left in the stored subspace
    assert coef.diagonal().abs().max().item() < 1e-12  # nor on any u_i v_i^T
    assert (got - tau).norm() > 0  # something was removed
    # block only: exactly the stored rank-k subspace is removed
    block = opcm_project(merged, tau, alpha=alpha, zero_diagonal=False)
    torch.testing.assert_close(block, tau - u[:, :k] @ (u[:, :k].T @ tau @ vh[:k].T) @ vh[:k])


def test_split_rank_counts_the_shares_up_to_alpha():
    s = torch.tensor([4.0, 2.0, 1.0, 1.0])  # shares 0.5, 0.75, 0.875, 1.0
    assert [opcm_split_rank(s, a) for a in (0.0, 0.49, 0.5, 0.74, 0.9, 0.999)] == [0, 0, 1, 1, 3, 3]
    for a in (0.0, 0.2, 0.5, 0.8, 0.99):
        assert opcm_split_rank(s, a) == int((s.cumsum(0) / s.sum() > a).float().argmax())
    assert opcm_split_rank(torch.zeros(3), 0.5) == 0


def _models(n: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    base = {"blk.fc.weight": torch.randn(10, 6, generator=g), "blk.fc.bias": torch.randn(10, generator=g),
            "blk.norm.weight": torch.randn(6, generator=g), "steps": torch.tensor(3)}
    experts = [{k: (v + 0.2 * torch.randn(v.shape, generator=g)) if v.is_floating_point() else v.clone()
                for k, v in base.items()} for _ in range(n)]
    return base, experts


def _opcm_reference(base, experts, alpha=0.5):
    """FusionBench's recursion: theta^_t = theta_0 + (lambda_(t-1) tau^_(t-1) + P(tau_t)) / lambda_t, with
    lambda_t = ||lambda_(t-1) tau^_(t-1) + P(tau_t)|| / mean_i ||tau_i||."""
    keys = [k for k, v in base.items() if v.is_floating_point()]
    tv = lambda m: {k: m[k].double() - base[k].double() for k in keys}  # noqa: E731
    norm = lambda d: math.sqrt(sum(float(v.pow(2).sum()) for v in d.values()))  # noqa: E731
    merged, lam, norms = tv(experts[0]), 1.0, [norm(tv(experts[0]))]
    for e in experts[1:]:
        tau = tv(e)
        norms.append(norm(tau))
        new = {k: lam * merged[k] + (_full_svd_projection(merged[k], tau[k], alpha) if k == "blk.fc.weight"
                                     else tau[k]) for k in keys}
        lam_new = norm(new) / (sum(norms) / len(norms))
        merged, lam = {k: v / lam_new for k, v in new.items()}, lam_new
    return {k: base[k].double() + merged[k] for k in keys}


def test_opcm_merge_is_fusionbench_recursion_and_the_protocol_state():
    base, experts = _models()
    got = merging.merge("opcm", base=base, experts=experts)
    want = _opcm_reference(base, experts)
    for k, v in want.items():
        torch.testing.assert_close(got[k].double(), v, rtol=1e-5, atol=1e-5)
    assert torch.equal(got["steps"], base["steps"])  # integer buffers from the base
    # the merged task vector has the mean task-vector norm
    tv = sum(float((got[k].double() - base[k].double()).pow(2).sum()) for k in want)
    mean = sum(math.sqrt(sum(float((e[k].double() - base[k].double()).pow(2).sum()) for k in want))
               for e in experts) / len(experts)
    assert math.sqrt(tv) == pytest.approx(mean, rel=1e-5)
    merger = make_merger("opcm", base)  # the protocol's running state gives the same merge at every prefix
    for t, e in enumerate(experts, start=1):
        step = merger.add(e)
        prefix = merging.merge("opcm", base=base, experts=experts[:t])
        for k in want:
            torch.testing.assert_close(step[k], prefix[k], rtol=1e-5, atol=1e-6)
    shuffled = merging.merge("opcm", base=base, experts=experts, shuffle=True, seed=3)
    order = torch.randperm(3, generator=torch.Generator().manual_seed(3)).tolist()
    again = merging.merge("opcm", base=base, experts=[experts[i] for i in order])
    torch.testing.assert_close(shuffled["blk.fc.weight"], again["blk.fc.weight"])


def _dop_reference(w0, wm, wn, steps, lr=1e-4, alpha=0.8, beta=0.999, eps=0.99999):
    """DOP by autograd: losses ||diag(s) U^T D||^2 + ||D V diag(s)||^2, MGDA weights of the loss-normalised
    gradients, moving average, Adam."""
    subs = []
    for t in (wm - w0, wn - w0):
        u, s, vh = torch.linalg.svd(t, full_matrices=True)
        k = int(torch.searchsorted(s.cumsum(0) / s.sum(), torch.tensor(eps, dtype=s.dtype)))
        subs.append((u[:, :k], s[:k], vh.T[:, :k]))
    w = torch.nn.Parameter((wm + wn) / 2)
    opt = torch.optim.Adam([w], lr=lr)
    ema = [alpha, 1 - alpha]

    def loss_i(i, target):
        u, s, v = subs[i]
        d = w - target
        return (torch.linalg.matrix_norm(torch.diag(s) @ u.T @ d) ** 2
                + torch.linalg.matrix_norm(d @ v @ torch.diag(s)) ** 2)

    for _ in range(steps):
        grads, losses = [], []
        for i, target in enumerate((wm, wn)):
            opt.zero_grad()
            li = loss_i(i, target)
            li.backward()
            grads.append(w.grad.clone() / float(li.detach()))
            losses.append(li)
        a, b, c = (float((x * y).sum()) for x, y in ((grads[0], grads[0]), (grads[0], grads[1]), (grads[1], grads[1])))
        gamma = 0.999 if b >= a else 0.001 if b >= c else -(b - c) / (a + c - 2 * b)
        ema = [beta * ema[0] + (1 - beta) * gamma, beta * ema[1] + (1 - beta) * (1 - gamma)]
        opt.zero_grad()
        (ema[0] * loss_i(0, wm) + ema[1] * loss_i(1, wn)).backward()
        opt.step()
    return w.detach()


def test_dop_matrix_is_the_autograd_transcription():
    g = torch.Generator().manual_seed(2)
    w0 = torch.randn(8, 5, generator=g, dtype=torch.float64)
    wm, wn = (w0 + 0.1 * torch.randn(8, 5, generator=g, dtype=torch.float64) for _ in range(2))
    got = dop_matrix(w0, wm, wn, num_steps=30, lr=1e-3)
    torch.testing.assert_close(got, _dop_reference(w0, wm, wn, 30, lr=1e-3))
    assert not torch.allclose(got, (wm + wn) / 2)  # it moved from the start
    torch.testing.assert_close(dop_matrix(w0, wm, wn, num_steps=0), (wm + wn) / 2)


def test_dop_parts():
    assert min_norm_weight(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])) == pytest.approx(0.5)
    assert min_norm_weight(torch.tensor([1.0, 0.0]), torch.tensor([2.0, 0.0])) == 0.999  # g1 is the min norm
    assert min_norm_weight(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0])) == 0.001
    s = torch.tensor([4.0, 2.0, 1.0, 1.0])  # shares 0.5, 0.75, 0.875, 1.0
    assert [energy_rank(s, e) for e in (0.5, 0.6, 0.99999, 1.0)] == [0, 1, 3, 3]
    merged, new, w0 = torch.ones(3), torch.full((3,), 3.0), torch.zeros(3)
    assert torch.equal(dop_fold("x.bias", merged, w0, new, 3), torch.full((3,), 2.0))  # pair mean
    torch.testing.assert_close(dop_fold("x.bias", merged, w0, new, 3, others="running_mean"), torch.full((3,), 5 / 3))


def test_dop_merge_streams_and_matches_the_protocol_state(tmp_path):
    from safetensors.torch import save_file

    base, experts = _models()
    got = merging.merge("dop", base=base, experts=experts, num_steps=5)
    merger = make_merger("dop", base, num_steps=5)
    for e in experts:
        step = merger.add(e)
    for k in ("blk.fc.weight", "blk.fc.bias", "blk.norm.weight"):
        torch.testing.assert_close(got[k], step[k])
    # the pair mean of the non-matrix tensors: the first expert's weight 1/4 after three arrivals
    want = (experts[0]["blk.fc.bias"] + experts[1]["blk.fc.bias"]) / 4 + experts[2]["blk.fc.bias"] / 2
    torch.testing.assert_close(got["blk.fc.bias"], want)
    paths = []
    for i, sd in enumerate([base, *experts]):
        paths.append(tmp_path / f"m{i}.safetensors")
        save_file(sd, str(paths[-1]))
    from_files = merging.merge("dop", base=paths[0], experts=paths[1:], num_steps=5)
    torch.testing.assert_close(from_files["blk.fc.weight"], got["blk.fc.weight"])


@pytest.mark.parametrize("name, sets", [("opcm", ["alpha=0.3"]), ("dop", ["num_steps=4"])])
def test_the_command_streams_the_same_merge_as_the_api(tmp_path, name, sets):
    """`clmerge merge` writes key by key through a sink: OPCM's second pass rescales the written tensors."""
    from checkpoint_helpers import folder_state, invoke
    from safetensors.torch import save_file

    base, experts = _models()
    base = {k: v for k, v in base.items() if v.is_floating_point()}
    experts = [{k: e[k] for k in base} for e in experts]
    paths = []
    for i, sd in enumerate([base, *experts]):
        paths.append(tmp_path / f"m{i}.safetensors")
        save_file(sd, str(paths[-1]))
    r = invoke("--method", name, "--base", paths[0], *[a for p in paths[1:] for a in ("--expert", p)],
               *[a for s in sets for a in ("--set", s)], "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    kw = {k: (float(v) if "." in v else int(v)) for k, v in (s.split("=") for s in sets)}
    want = merging.merge(name, base=base, experts=experts, **kw)
    got = folder_state(tmp_path / "out")
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-6)
