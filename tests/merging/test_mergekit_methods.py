"""mergekit's other methods (nuslerp, multislerp, karcher, sce, della_linear, breadcrumbs_ties, nearswap,
arcee_fusion, task arithmetic's normalize), each against a direct transcription of its definition on small
tensors or a hand-checked value."""

from __future__ import annotations

import math

import pytest
import torch

from clmerge import merging
from clmerge.merging.methods.sparse_family import breadcrumbs_mask

from merging_helpers import float_keys, make_models

R2 = math.sqrt(0.5)


def one(name, xs, base=None, **hp):
    """Merge single-key models ``{"w": x}`` and return the merged ``w``."""
    b = None if base is None else {"w": base}
    return merging.merge(name, base=b, experts=[{"w": x} for x in xs], **hp)["w"]


def slerp_ref(t, a, b):
    """Shoemake's slerp of two flat vectors, written out."""
    a, b = a.double(), b.double()
    om = math.acos(float(a @ b / (a.norm() * b.norm())))
    return (math.sin((1 - t) * om) * a + math.sin(t * om) * b) / math.sin(om)


# ---- nuslerp ---------------------------------------------------------------------------------------------

def test_nuslerp_orthogonal_unit_vectors_half_way():
    out = one("nuslerp", [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])])
    torch.testing.assert_close(out, torch.tensor([R2, R2]))


def test_nuslerp_weights_give_t_and_base_gives_task_vectors():
    a, b, base = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([0.5, -2.0])
    # t = w_1 / (w_0 + w_1) = 0.75: sin(pi/8) a + sin(3 pi/8) b
    want = torch.tensor([math.sin(math.pi / 8), math.sin(3 * math.pi / 8)])
    torch.testing.assert_close(one("nuslerp", [a, b], weights=[1.0, 3.0]), want)
    torch.testing.assert_close(one("nuslerp", [a + base, b + base], base=base, weights=[1.0, 3.0]), want + base)


def test_nuslerp_per_row_and_per_column():
    g = torch.Generator().manual_seed(0)
    x0, x1 = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    rows = torch.stack([slerp_ref(0.3, x0[i], x1[i]) for i in range(3)]).float()
    cols = torch.stack([slerp_ref(0.3, x0[:, j], x1[:, j]) for j in range(4)], dim=1).float()
    torch.testing.assert_close(one("nuslerp", [x0, x1], weights=[0.7, 0.3], flatten=False), rows)
    torch.testing.assert_close(one("nuslerp", [x0, x1], weights=[0.7, 0.3], flatten=False, row_wise=True), cols)
    flat = slerp_ref(0.3, x0.reshape(-1), x1.reshape(-1)).reshape(3, 4).float()
    torch.testing.assert_close(one("nuslerp", [x0, x1], weights=[0.7, 0.3]), flat)


def test_nuslerp_needs_two_experts():
    with pytest.raises(ValueError, match="exactly two experts"):
        one("nuslerp", [torch.ones(2)] * 3)


# ---- multislerp ------------------------------------------------------------------------------------------

def multislerp_ref(xs, w, eps=1e-8):
    """The Multi-SLERP definition, one step per line."""
    xs = [x.double().reshape(-1) for x in xs]
    w = [wi / sum(w) for wi in w]
    us = [x / (x.norm() + eps) for x in xs]
    m = sum(wi * u for wi, u in zip(w, us))
    m = m / m.norm()
    v = sum(wi * (u - (u @ m) * m) for wi, u in zip(w, us))
    n = v.norm() + eps
    return (m * torch.cos(n) + v * torch.sin(n) / n) * sum(wi * x.norm() for wi, x in zip(w, xs))


def test_multislerp_of_two_equal_norms_equal_weights_is_slerp():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(7, generator=g), torch.randn(7, generator=g)
    b = b * (a.norm() / b.norm())
    torch.testing.assert_close(one("multislerp", [a, b]), slerp_ref(0.5, a, b).float())


def test_multislerp_three_weighted_with_base_matches_definition():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(2, 3, generator=g)
    xs = [base + torch.randn(2, 3, generator=g) for _ in range(3)]
    w = [0.2, 0.5, 0.3]
    want = (base.double() + multislerp_ref([x - base for x in xs], w).reshape(2, 3)).float()
    torch.testing.assert_close(one("multislerp", xs, base=base, weights=w), want)


def test_multislerp_balanced_opposites_is_an_error_beyond_two():
    a = torch.tensor([1.0, 0.0])
    torch.testing.assert_close(one("multislerp", [a, -a]), torch.zeros(2))  # two: linear fallback
    with pytest.raises(ValueError, match="weighted mean of the directions is zero"):
        one("multislerp", [a, -a, a, -a])


# ---- karcher ---------------------------------------------------------------------------------------------

def test_karcher_of_identical_inputs_is_the_input():
    x = torch.tensor([[0.3, -1.2], [2.0, 0.5]])
    torch.testing.assert_close(one("karcher", [x, x, x]), x)


def test_karcher_symmetric_points_and_norms():
    e = torch.eye(3)
    # the Karcher mean of three orthogonal unit vectors is their bisector; norms 1, 2, 3 average to 2
    out = one("karcher", [e[0], 2 * e[1], 3 * e[2]])
    torch.testing.assert_close(out, 2 * torch.ones(3) / math.sqrt(3))
    # two points: the geodesic midpoint
    torch.testing.assert_close(one("karcher", [e[0], e[1]]), torch.tensor([R2, R2, 0.0]))


def test_karcher_is_a_stationary_point_of_the_weighted_distances():
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(5, generator=g).double() for _ in range(4)]
    w = [0.1, 0.2, 0.3, 0.4]
    m = one("karcher", xs, weights=w, max_iter=200, tol=1e-12)
    m = m / m.norm()
    # the Riemannian gradient sum_i w_i log_m(u_i) vanishes at the mean
    grad = torch.zeros(5, dtype=torch.float64)
    for wi, x in zip(w, xs):
        u = x / x.norm()
        c = float(u @ m)
        th = math.acos(max(-1.0, min(1.0, c)))
        grad += wi * th / math.sin(th) * (u - c * m)
    assert float(grad.norm()) < 1e-9


# ---- sce -------------------------------------------------------------------------------------------------

def sce_ref(base, xs, topk):
    """FuseChat's Select / Calculate / Erase on one small tensor, entry by entry."""
    d = [(x - base).double().reshape(-1) for x in xs]
    n, t = d[0].numel(), len(d)
    if topk < 1:
        var = [float(torch.tensor([di[j] for di in d]).var(unbiased=False)) for j in range(n)]
        m = sum(v != 0 for v in var)
        k = math.floor(topk * m + 0.5) if m else n  # no variance anywhere: nothing to select, all kept
        order = sorted(range(n), key=lambda j: (-var[j], j))[:k]
        d = [torch.tensor([di[j] if j in order else 0.0 for j in range(n)], dtype=torch.float64) for di in d]
    energy = [float((di ** 2).sum()) for di in d]
    eta = [e / sum(energy) for e in energy]
    out = torch.zeros(n, dtype=torch.float64)
    for j in range(n):
        s = sum(float(di[j]) for di in d)
        sign = 1.0 if s >= 0 else -1.0
        num = sum(eta[i] * float(d[i][j]) for i in range(t) if math.copysign(1, d[i][j]) == sign and d[i][j] != 0)
        den = sum(eta[i] for i in range(t) if math.copysign(1, d[i][j]) == sign and d[i][j] != 0)
        out[j] = num / (den if den != 0 else 1.0)
    return (base.double().reshape(-1) + out).reshape(base.shape).float()


@pytest.mark.parametrize("topk", [1.0, 0.5, 0.25])
def test_sce_matches_definition(topk):
    g = torch.Generator().manual_seed(4)
    base = torch.randn(4, 3, generator=g)
    xs = [base + torch.randn(4, 3, generator=g) * s for s in (0.1, 0.5, 1.0)]
    torch.testing.assert_close(one("sce", xs, base=base, select_topk=topk), sce_ref(base, xs, topk))


def test_sce_with_one_expert_is_the_expert():
    # one expert has no variance to rank: Select keeps everything, and the weight of the only expert is 1
    base, ex = make_models(1, seed=5)
    out = merging.merge("sce", base=base, experts=ex, select_topk=0.3)
    for k in float_keys(base):
        torch.testing.assert_close(out[k], ex[0][k])


# ---- della_linear, breadcrumbs_ties, task arithmetic's normalize -------------------------------------------

def test_della_linear_at_density_one_is_task_arithmetic():
    base, ex = make_models(3, seed=6)
    a = merging.merge("della_linear", base=base, experts=ex, density=1.0, epsilon=0.0, scaling=0.4)
    b = merging.merge("task_arithmetic", base=base, experts=ex, scaling=0.4)
    for k in float_keys(base):
        torch.testing.assert_close(a[k], b[k])


def test_della_linear_is_unbiased_and_uses_della_masks():
    from clmerge.merging.methods.dare import dare_generator
    from clmerge.merging.methods.sparse_family import magprune_tensor

    base, ex = make_models(2, seed=7)
    out = merging.merge("della_linear", base=base, experts=ex, density=0.4, epsilon=0.3, scaling=0.5, seed=3)
    k = "blk.fc1.weight"
    want = base[k] + 0.5 * sum(magprune_tensor(e[k] - base[k], 0.4, 0.3, generator=dare_generator(3, k, t))
                               for t, e in enumerate(ex))
    torch.testing.assert_close(out[k], want)
    # E[tau~] = tau: the mean over seeds approaches task arithmetic with scaling 1
    big = {"w": torch.zeros(40, 40)}
    exp = [{"w": torch.randn(40, 40, generator=torch.Generator().manual_seed(8))}]
    mean = sum(merging.merge("della_linear", base=big, experts=exp, density=0.5, epsilon=0.4, seed=s)["w"]
               for s in range(200)) / 200
    assert float((mean - exp[0]["w"]).abs().mean()) < 0.1 * float(exp[0]["w"].abs().mean())


@pytest.mark.parametrize("merge_fn", ["sum", "mean"])
def test_breadcrumbs_ties_at_beta_zero_is_per_tensor_ties(merge_fn):
    base, ex = make_models(3, seed=9)
    a = merging.merge("breadcrumbs_ties", base=base, experts=ex, density=0.4, beta=0.0, scaling=0.7,
                      merge_fn=merge_fn)
    b = merging.merge("ties", base=base, experts=ex, density=0.4, scaling=0.7, trim_scope="per_tensor",
                      merge_fn=merge_fn)
    for k in float_keys(base):
        torch.testing.assert_close(a[k], b[k])


def test_breadcrumbs_ties_matches_mergekit_formula():
    g = torch.Generator().manual_seed(10)
    base = torch.randn(5, 4, generator=g)
    xs = [base + torch.randn(5, 4, generator=g) for _ in range(3)]
    d = torch.stack([(x - base) * breadcrumbs_mask(x - base, 0.5, 0.1) for x in xs])
    major = torch.where(d.sum(0) >= 0, 1.0, -1.0)
    want = base + 0.8 * (d * (torch.sign(d) == major)).sum(0)  # consensus by sum, not normalised
    torch.testing.assert_close(one("breadcrumbs_ties", xs, base=base, density=0.5, beta=0.1, scaling=0.8), want)


def test_task_arithmetic_normalize_is_the_mean_task_vector():
    base, ex = make_models(3, seed=11)
    for scaling in (0.3, 2.0):
        out = merging.merge("task_arithmetic", base=base, experts=ex, scaling=scaling, normalize=True)
        for k in float_keys(base):
            torch.testing.assert_close(out[k], base[k] + sum(e[k] - base[k] for e in ex) / 3)
    zero = merging.merge("task_arithmetic", base=base, experts=ex, scaling=0.0, normalize=True)
    torch.testing.assert_close(zero["blk.fc1.weight"], base["blk.fc1.weight"])  # a zero weight sum divides by 1


# ---- nearswap, arcee_fusion ------------------------------------------------------------------------------

def test_nearswap_matches_definition():
    v0 = torch.tensor([1.0, 1.0, 1.0, 0.0, -2.0])
    v1 = torch.tensor([1.0, 1.05, 3.0, -0.2, -2.0 + 1e-3])
    t = 0.1
    want = []
    for a, b in zip(v0.tolist(), v1.tolist()):
        w = 1.0 if a == b else min(1.0, t / abs(a - b))
        want.append(w * b + (1 - w) * a)
    # hand values: equal -> 1; |d| 0.05 <= t -> v1; |d| 2 -> moves by t; |d| 0.2 -> moves by t; tiny -> v1
    torch.testing.assert_close(one("nearswap", [v1], base=v0, t=t), torch.tensor(want))
    torch.testing.assert_close(torch.tensor(want), torch.tensor([1.0, 1.05, 1.1, -0.1, -2.0 + 1e-3]))


def test_nearswap_and_arcee_fusion_need_one_expert():
    for name in ("nearswap", "arcee_fusion"):
        with pytest.raises(ValueError, match="exactly one expert"):
            one(name, [torch.ones(3), torch.zeros(3)], base=torch.ones(3))


def arcee_ref(base, x):
    """Arcee Fusion written out: importance per entry, Tukey fence on sorted quantiles, keep the change."""
    rows_b, rows_x = base.double().reshape(-1, base.shape[-1]), x.double().reshape(-1, base.shape[-1])
    imp = []
    for rb, rx in zip(rows_b, rows_x):
        p = [math.exp(v) / sum(math.exp(u) for u in rx.tolist()) + 1e-8 for v in rx.tolist()]
        q = [math.exp(v) / sum(math.exp(u) for u in rb.tolist()) + 1e-8 for v in rb.tolist()]
        kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
        imp += [abs(a - b) * kl for a, b in zip(rx.tolist(), rb.tolist())]
    s = sorted(imp)
    qv = [s[int(q * (len(s) - 1))] for q in (0.25, 0.5, 0.75)]
    thr = qv[1] + 1.5 * (qv[2] - qv[0])
    keep = torch.tensor([i >= thr for i in imp]).reshape(base.shape)
    return torch.where(keep, x, base), int(keep.sum())


def test_arcee_fusion_matches_definition():
    g = torch.Generator().manual_seed(12)
    base = torch.randn(6, 8, generator=g)
    x = base + 0.05 * torch.randn(6, 8, generator=g)
    x[2, 3] += 3.0  # an important change: large, in a row whose distribution it shifts
    want, kept = arcee_ref(base, x)
    assert 0 < kept < base.numel() and bool(want[2, 3] == x[2, 3])
    torch.testing.assert_close(one("arcee_fusion", [x], base=base), want)


# ---- on a tiny real-architecture model, streamed through the command line ---------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """bf16 Llama base + 2 variants saved with ``save_pretrained`` in 4 KB shards."""
    import transformers as tf

    from checkpoint_helpers import llama_config, save_variants

    tmp = tmp_path_factory.mktemp("llama")
    return save_variants(tmp, llama_config(), ["base", "a", "b"], dtype=torch.bfloat16, shard="4KB",
                         auto=tf.AutoModelForCausalLM)


STREAMED = [("nuslerp", 2, ["weights=[1,3]"]), ("multislerp", 2, []), ("karcher", 2, []),
            ("sce", 2, ["select_topk=0.5"]), ("della_linear", 2, ["density=0.5"]),
            ("breadcrumbs_ties", 2, ["density=0.3"]), ("task_arithmetic", 2, ["normalize=true"]),
            ("nearswap", 1, ["t=0.01"]), ("arcee_fusion", 1, [])]


@pytest.mark.parametrize("name, n_experts, sets", STREAMED, ids=[s[0] for s in STREAMED])
def test_streamed_merge_of_a_llama_loads_and_equals_the_api(llama, tmp_path, name, n_experts, sets):
    import transformers as tf
    import yaml

    from checkpoint_helpers import folder_state, invoke

    base, *experts = llama
    experts = experts[:n_experts]
    args = ["--method", name, "--base", base, *[a for e in experts for a in ("--expert", e)],
            *[a for s in sets for a in ("--set", s)], "--out", tmp_path / "m"]
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    hp = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in sets)}
    want = merging.merge(name, base=folder_state(base), experts=[folder_state(e) for e in experts], **hp)
    got = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "m").state_dict()
    assert got.keys() == want.keys()
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k]) for k in want), name
