"""The SVD family (TSV-M, TSV-C, Iso-C, Iso-CTS) against direct transcriptions of their papers' equations on
small random matrices, plus the identities the papers imply."""

from __future__ import annotations

import pytest
import torch

from clmerge import merging
from clmerge.merging.methods.iso import iso_cts_ranks
from clmerge.merging.methods.lowrank import polar_factor

W, B, N, E = "blk.fc.weight", "blk.fc.bias", "norm.weight", "embed_tokens.weight"


def models(num_tasks: int = 3, shape=(8, 6), seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    shapes = {W: shape, B: (shape[0],), N: (shape[1],), E: (5, shape[1])}
    base = {k: torch.randn(s, generator=g, dtype=dtype) for k, s in shapes.items()}
    experts = [{k: v + 0.1 * torch.randn(v.shape, generator=g, dtype=dtype) for k, v in base.items()}
               for _ in range(num_tasks)]
    return base, experts


def taus(base, experts, key):
    return [e[key] - base[key] for e in experts]


def whiten(a):
    """``a (a^T a)^{-1/2}`` by an eigendecomposition: the TSV paper's whitening, not the code's SVD route."""
    lam, q = torch.linalg.eigh(a.T @ a)
    return a @ (q * lam.rsqrt()) @ q.T


def ref_tsv_m(ds, alpha):
    """TSV paper Sec. 4.2-4.3: keep the top r/T triplets per task, concatenate, whiten U and V, rebuild."""
    k = min(ds[0].shape) // len(ds)
    svds = [torch.linalg.svd(d, full_matrices=False) for d in ds]
    u = torch.cat([s.U[:, :k] for s in svds], 1)
    sig = torch.cat([s.S[:k] for s in svds])
    v = torch.cat([s.Vh[:k].T for s in svds], 1)
    return alpha * whiten(u) @ torch.diag(sig) @ whiten(v).T


def ref_iso_cts(ds, frac, alpha):
    """Iso-CTS as FusionBench writes it: zero-padded r-column blocks, task blocks first, common last."""
    r, t = min(ds[0].shape), len(ds)
    kc = int(r * frac)
    kc = r - round((r - kc) / t) * t
    s = (r - kc) // t
    u, sv, vh = torch.linalg.svd(sum(ds), full_matrices=False)
    cu, cs, cv = torch.zeros_like(u), torch.zeros_like(sv), torch.zeros_like(vh)
    for i, d in enumerate(ds):
        a, b, c = torch.linalg.svd(d - u[:, :kc] @ u[:, :kc].T @ d, full_matrices=False)
        cu[:, i * s:(i + 1) * s], cs[i * s:(i + 1) * s], cv[i * s:(i + 1) * s] = a[:, :s], b[:s], c[:s]
    cu[:, t * s:], cs[t * s:], cv[t * s:] = u[:, :kc], sv[:kc], vh[:kc]
    pu, _, qu = torch.linalg.svd(cu, full_matrices=False)
    pv, _, qv = torch.linalg.svd(cv, full_matrices=False)
    return alpha * cs.mean() * (pu @ qu) @ (pv @ qv)


def close(a, b, tol=1e-9):
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("shape", [(8, 6), (6, 8), (9, 9)])
def test_tsv_m_matches_the_paper_transcription(shape):
    base, ex = models(3, shape)
    out = merging.merge("tsv_m", base=base, experts=ex, scaling=0.7)
    close(out[W], base[W] + ref_tsv_m(taus(base, ex, W), 0.7))
    for key in (B, N, E):  # non-matrix tensors (the embedding, by the default rule): averaged task vectors
        close(out[key], base[key] + 0.7 * torch.stack(taus(base, ex, key)).mean(0))


def test_tsv_m_include_all_2d_treats_the_embedding_as_a_matrix():
    base, ex = models(3)
    out = merging.merge("tsv_m", base=base, experts=ex, include=".")
    close(out[E], base[E] + ref_tsv_m(taus(base, ex, E), 1.0))


def test_tsv_m_one_task_at_alpha_1_is_the_expert():
    base, ex = models(1)
    out = merging.merge("tsv_m", base=base, experts=ex)
    for key in base:
        close(out[key], ex[0][key])


def test_tsv_m_keeps_nothing_of_a_matrix_whose_rank_is_below_the_task_count():
    base, ex = models(3, (8, 2))  # r = 2 < T = 3: k = 0, as FusionBench's int(r / T)
    out = merging.merge("tsv_m", base=base, experts=ex)
    close(out[W], base[W])


def test_tsv_m_update_has_the_concatenated_singular_values():
    base, ex = models(3, (12, 9))
    delta = merging.merge("tsv_m", base=base, experts=ex)[W] - base[W]
    k = 3
    want = torch.cat([torch.linalg.svdvals(d)[:k] for d in taus(base, ex, W)]).sort(descending=True).values
    close(torch.linalg.svdvals(delta)[:9], want)


@pytest.mark.parametrize("task", [0, 2])
def test_tsv_c_rebuilds_each_task_from_its_own_top_singular_vectors(task):
    base, ex = models(3)
    out = merging.merge("tsv_c", base=base, experts=ex, task=task, scaling=0.9)
    d = ex[task][W] - base[W]
    u, s, vh = torch.linalg.svd(d, full_matrices=False)
    close(out[W], base[W] + 0.9 * u[:, :2] @ torch.diag(s[:2]) @ vh[:2])  # r = 6, T = 3: k = 2
    for key in (B, N, E):
        close(out[key], base[key] + 0.9 * (ex[task][key] - base[key]))


def test_tsv_c_rank_ratio_and_full_rank():
    base, ex = models(3)
    d = ex[1][W] - base[W]
    u, s, vh = torch.linalg.svd(d, full_matrices=False)
    out = merging.merge("tsv_c", base=base, experts=ex, task=1, rank_ratio=0.5)
    close(out[W], base[W] + u[:, :3] @ torch.diag(s[:3]) @ vh[:3])
    close(merging.merge("tsv_c", base=base, experts=ex, task=1, rank_ratio=1.0)[W], ex[1][W])


@pytest.mark.parametrize("kw, words", [({"task": 3}, "task must be in"), ({"rank_ratio": 1.5}, "rank_ratio"),
                                       ({"svd": "fast"}, "svd must be")])
def test_tsv_c_bad_arguments(kw, words):
    base, ex = models(3)
    with pytest.raises(ValueError, match=words):
        merging.merge("tsv_c", base=base, experts=ex, **kw)


@pytest.mark.parametrize("shape", [(8, 6), (6, 8)])
def test_iso_c_matches_the_paper_and_flattens_the_spectrum(shape):
    base, ex = models(3, shape)
    out = merging.merge("iso_c", base=base, experts=ex, scaling=1.3)
    total = sum(taus(base, ex, W))
    u, s, vh = torch.linalg.svd(total, full_matrices=False)
    close(out[W], base[W] + 1.3 * s.mean() * u @ vh)
    sv = torch.linalg.svdvals(out[W] - base[W])
    close(sv, torch.full_like(sv, 1.3 * s.mean().item()))  # every singular value equal: an isotropic update
    for key in (B, N, E):
        close(out[key], base[key] + 1.3 * torch.stack(taus(base, ex, key)).mean(0))


@pytest.mark.parametrize("frac", [0.8, 0.5, 0.0])
@pytest.mark.parametrize("shape", [(8, 6), (6, 8), (12, 12)])
def test_iso_cts_matches_the_paper_transcription(shape, frac):
    base, ex = models(3, shape, seed=1)
    out = merging.merge("iso_cts", base=base, experts=ex, scaling=0.6, common_space_fraction=frac)
    close(out[W], base[W] + ref_iso_cts(taus(base, ex, W), frac, 0.6))
    close(out[B], base[B] + 0.6 * torch.stack(taus(base, ex, B)).mean(0))


def test_iso_cts_with_the_whole_rank_common_is_iso_c():
    base, ex = models(3, (10, 7), seed=2)
    a = merging.merge("iso_cts", base=base, experts=ex, common_space_fraction=1.0, scaling=0.8)
    b = merging.merge("iso_c", base=base, experts=ex, scaling=0.8)
    for key in base:
        close(a[key], b[key])


def test_iso_cts_update_is_isotropic():
    base, ex = models(3, (12, 9), seed=3)
    sv = torch.linalg.svdvals(merging.merge("iso_cts", base=base, experts=ex)[W] - base[W])
    close(sv, torch.full_like(sv, sv.mean().item()))


def test_iso_cts_ranks_follow_the_released_code_and_stay_valid():
    for r in range(1, 80):
        for t in range(1, 9):
            for frac in (0.0, 0.3, 0.8, 0.95, 1.0):
                kc, s = iso_cts_ranks(r, t, frac)
                assert kc >= 0 and s >= 0 and kc + t * s == r
                code_kc = r - round((r - int(r * frac)) / t) * t  # FusionBench's iso_cts
                if code_kc >= 0:
                    assert kc == code_kc, (r, t, frac)
    assert iso_cts_ranks(2, 3, 0.0) == (2, 0)  # the code's k_c would be -1 here


def test_iso_cts_bad_fraction():
    base, ex = models(2)
    with pytest.raises(ValueError, match="common_space_fraction"):
        merging.merge("iso_cts", base=base, experts=ex, common_space_fraction=1.2)


def test_polar_factor_is_the_whitening_of_a_full_rank_matrix():
    a = torch.randn(9, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    close(polar_factor(a), whiten(a))
    close(polar_factor(a).T @ polar_factor(a), torch.eye(4, dtype=torch.float64))


def _decaying(num_tasks=4, shape=(80, 60), seed=0):
    """Task matrices with a fast-decaying spectrum (singular values 0.7^i), as fine-tuning updates have."""
    g = torch.Generator().manual_seed(seed)
    r = min(shape)
    out = []
    for _ in range(num_tasks):
        u = torch.linalg.qr(torch.randn(shape[0], r, generator=g, dtype=torch.float64)).Q
        v = torch.linalg.qr(torch.randn(shape[1], r, generator=g, dtype=torch.float64)).Q
        out.append((u * 0.7 ** torch.arange(r, dtype=torch.float64)) @ v.T)
    return out


# measured relative (Frobenius) differences, seeds 0-2: tsv_m 0.8-1.1e-9, tsv_c 0.6-4e-11, iso_cts 2.2-4.3e-4
# (Iso-CTS's residuals, outside the common subspace, have a flatter spectrum than the task matrices)
@pytest.mark.parametrize("name, kw, tol", [("tsv_m", {}, 1e-8), ("tsv_c", {"task": 1}, 1e-8),
                                           ("iso_cts", {}, 1e-3)])
def test_randomized_svd_is_close_to_exact_on_decaying_spectra(name, kw, tol):
    ds = _decaying()
    base = {W: torch.zeros(80, 60, dtype=torch.float64)}
    ex = [{W: d} for d in ds]
    exact = merging.merge(name, base=base, experts=ex, **kw)[W]
    rand = merging.merge(name, base=base, experts=ex, svd="randomized", **kw)[W]
    rel = ((rand - exact).norm() / exact.norm()).item()
    assert rel < tol, rel  # k = 15 of r = 60 (TSV), 3 per task (Iso-CTS), sketches of k + 10 columns


def test_float32_inputs_match_float64_within_float32_precision():
    base, ex = models(3, (16, 12), seed=4)
    b32 = {k: v.float() for k, v in base.items()}
    e32 = [{k: v.float() for k, v in e.items()} for e in ex]
    for name in ("tsv_m", "iso_c", "iso_cts"):
        a = merging.merge(name, base=base, experts=ex)[W]
        b = merging.merge(name, base=b32, experts=e32)[W]
        assert b.dtype == torch.float32
        torch.testing.assert_close(b.double(), a, atol=1e-5, rtol=1e-5)


@pytest.fixture()
def files(tmp_path):
    """Base + 3 experts (float32) as safetensors files."""
    from safetensors.torch import save_file

    base, ex = models(3, (8, 6), seed=5, dtype=torch.float32)
    paths = []
    for name, sd in zip(["base", "e0", "e1", "e2"], [base, *ex]):
        save_file(sd, str(tmp_path / f"{name}.safetensors"))
        paths.append(tmp_path / f"{name}.safetensors")
    return tmp_path, base, ex, paths


@pytest.mark.parametrize("name, sets", [("tsv_m", ["scaling=0.5"]), ("iso_c", []),
                                        ("iso_cts", ["common_space_fraction=0.5", "svd=randomized"])])
def test_the_command_streams_the_same_merge_as_the_api(files, name, sets):
    from checkpoint_helpers import folder_state, invoke

    tmp, base, ex, (pb, *pe) = files
    r = invoke("--method", name, "--base", pb, *[a for p in pe for a in ("--expert", p)],
               *[a for s in sets for a in ("--set", s)], "--out", tmp / "m")
    assert r.exit_code == 0, r.output
    kw = {k: (float(v) if v[0].isdigit() else v) for k, v in (s.split("=") for s in sets)}
    want = merging.merge(name, base=base, experts=ex, **kw)
    got = folder_state(tmp / "m")
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=0, rtol=0)


def test_tsv_c_needs_task_and_all_writes_every_task(files):
    from checkpoint_helpers import folder_state, invoke

    tmp, base, ex, (pb, *pe) = files
    args = ["--method", "tsv_c", "--base", pb, *[a for p in pe for a in ("--expert", p)]]
    r = invoke(*args, "--out", tmp / "m")
    assert r.exit_code == 2 and "--task" in r.output and not (tmp / "m").exists()
    r = invoke(*args, "--out", tmp / "m", "--task", "all")
    assert r.exit_code == 0, r.output
    for t in range(3):
        want = merging.tsv_c(base=base, experts=ex, task=t)
        got = folder_state(tmp / "m" / f"task_{t}")
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_an_svd_that_fails_to_converge_in_float32_is_retried_in_float64(monkeypatch):
    """LAPACK's divide-and-conquer SVD fails to converge on some float32 task residuals of ViT-B-sized layers
    (seen with iso_cts); the merge retries that matrix in float64 instead of crashing."""
    from clmerge.merging.methods import lowrank

    real, calls = torch.linalg.svd, []

    def flaky(m, full_matrices=True):
        calls.append(m.dtype)
        if m.dtype == torch.float32:
            raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")
        return real(m, full_matrices=full_matrices)

    g = torch.Generator().manual_seed(0)
    base = {"fc.weight": torch.randn(12, 10, generator=g)}
    experts = [{"fc.weight": base["fc.weight"] + 0.1 * torch.randn(12, 10, generator=g)} for _ in range(3)]
    want = merging.merge("iso_cts", base=base, experts=experts)["fc.weight"]
    monkeypatch.setattr(torch.linalg, "svd", flaky)
    got = merging.merge("iso_cts", base=base, experts=experts)["fc.weight"]
    assert torch.float64 in calls and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    u, s, vh = lowrank.thin_svd(torch.randn(5, 4, generator=g))
    assert u.dtype == s.dtype == vh.dtype == torch.float32
# --- memory at LLM scale: no (T, m, n) stacks where one tensor at a time does, no full factors kept alive

def test_exact_svd_factors_do_not_keep_the_full_factors_alive():
    from clmerge.merging.methods.lowrank import svd_factors

    u, s, vh = svd_factors(torch.randn(40, 30), 5, method="exact")
    for f in (u, s, vh):  # a slice of the full U (40 x 30) would hold all of its storage
        assert f.untyped_storage().nbytes() == f.numel() * f.element_size()


def _no_stack(*a, **k):
    raise AssertionError("stacked the experts")


def test_cart_centered_sum_and_averaged_keys_never_stack_the_experts(monkeypatch):
    from clmerge.merging.methods.cart import centered_low_rank_sum

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(12, 9, generator=g).bfloat16() for _ in range(3)]
    want_avg = torch.stack([x.double() for x in xs]).mean(0)
    want = sum(_rank_k((x.double() - want_avg).float(), 2).double() for x in xs)
    monkeypatch.setattr(torch, "stack", _no_stack)
    avg, total = centered_low_rank_sum(xs, 2)
    assert torch.allclose(avg, want_avg) and torch.allclose(total, want, atol=1e-5)


def _rank_k(m, k):
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    return (u[:, :k] * s[:k]) @ vh[:k]


@pytest.mark.parametrize("name", ["cart", "tsv_m", "iso_cts"])
def test_non_matrix_keys_are_averaged_without_a_stack(monkeypatch, name):
    import importlib

    g = torch.Generator().manual_seed(1)
    base = {"model.embed_tokens.weight": torch.randn(10, 4, generator=g),
            "norm.weight": torch.randn(4, generator=g)}
    experts = [{k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(3)]
    mod = {"cart": "cart", "tsv_m": "tsv", "iso_cts": "iso"}[name]
    fn = getattr(importlib.import_module(f"clmerge.merging.methods.{mod}"), name)
    want = fn(base=base, experts=experts, scaling=0.5)
    monkeypatch.setattr(torch, "stack", _no_stack)
    got = fn(base=base, experts=experts, scaling=0.5)
    for k in base:
        mean = sum(e[k].double() for e in experts) / 3
        ref = mean if name == "cart" else base[k].double() + 0.5 * (mean - base[k].double())
        assert torch.allclose(got[k].double(), ref, atol=1e-6) and torch.allclose(got[k], want[k])
