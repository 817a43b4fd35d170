"""KnOTS against a transcription of its equations (the official code's SVDMerger steps, written out), the
identities it implies, and the PEFT adapter path end to end."""

from __future__ import annotations

import re

import pytest
import torch

from clmerge import merging
from clmerge.merging.methods.dare import dare_generator

W1, W2, B = "blk.fc1.weight", "blk.fc2.weight", "blk.fc1.bias"


def models(num_tasks=3, seed=0, rank=None, dtype=torch.float64):
    """Base + experts; with ``rank``, each matrix update is a product of rank-``rank`` factors (a LoRA)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {W1: (7, 5), W2: (5, 7), B: (7,)}
    base = {k: torch.randn(s, generator=g, dtype=dtype) for k, s in shapes.items()}

    def update(s):
        if rank is None or len(s) == 1:
            return 0.1 * torch.randn(s, generator=g, dtype=dtype)
        return 0.3 * torch.randn(s[0], rank, generator=g, dtype=dtype) @ torch.randn(rank, s[1], generator=g,
                                                                                     dtype=dtype)

    return base, [{k: v + update(v.shape) for k, v in base.items()} for _ in range(num_tasks)]


def ref_basis(ds):
    """Paper Sec. 3 / official ``apply_svd``: SVD of [D_1 ... D_T] (concatenated along the input axis), the
    support s > 1e-5, then each task's block of S V^T."""
    u, s, vh = torch.linalg.svd(torch.cat(ds, dim=1), full_matrices=False)
    keep = s > 1e-5
    u, s, vh = u[:, keep], s[keep], vh[keep]
    n = ds[0].shape[1]
    return u, [torch.diag(s) @ vh[:, t * n:(t + 1) * n] for t in range(len(ds))]


def ref_ties(vectors, top_k, scaling):
    """Official ``ties_masking`` + ``masked_merge(mean)`` on flattened task vectors ``(T, d)``."""
    d = vectors.shape[1]
    kth = vectors.abs().kthvalue(d - int(d * top_k), dim=1, keepdim=True).values if top_k < 1 else 0.0
    pruned = vectors * (vectors.abs() >= kth)
    sign = torch.sign(pruned.sum(0))
    sign[sign == 0] = torch.sign(sign.sum())
    mask = torch.where(sign > 0, pruned > 0, pruned < 0)
    sel = vectors * mask * scaling
    return sel.sum(0) / (sel != 0).sum(0).clamp(min=1)


def ref_knots_ties(base, experts, top_k, scaling, reps_fn=lambda key, reps: reps):
    """KnOTS-TIES: the trim over all matrices of a task at once, merge, rebuild ``U R_m``."""
    out, bases, flat, sizes = {}, {}, [], []
    for key in (W1, W2):
        u, reps = ref_basis([e[key] - base[key] for e in experts])
        reps = reps_fn(key, reps)
        bases[key] = (u, reps[0].shape)
        flat.append(torch.stack([r.reshape(-1) for r in reps]))
        sizes.append(reps[0].numel())
    merged = ref_ties(torch.cat(flat, dim=1), top_k, scaling).split(sizes)
    for key, m in zip((W1, W2), merged):
        u, shape = bases[key]
        out[key] = base[key] + u @ m.reshape(shape)
    tb = torch.stack([e[B] - base[B] for e in experts])
    out[B] = base[B] + ref_ties(torch.stack(reps_fn(B, list(tb))), top_k, scaling)
    return out


def close(a, b, tol=1e-9):
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("rank, num_tasks", [(None, 3), (2, 3), (None, 1)])  # T = 1: a 7 x 5 matrix is taller
def test_knots_ties_matches_the_transcription(rank, num_tasks):  # than its concatenation (the SVD route)
    base, ex = models(num_tasks, rank=rank)
    out = merging.merge("knots", base=base, experts=ex, density=0.3, scaling=0.6)
    want = ref_knots_ties(base, ex, 0.3, 0.6)
    for key in (W1, W2, B):
        close(out[key], want[key])


def test_knots_dare_ties_matches_the_transcription():
    p, seed = 0.25, 7

    def drop(key, reps):
        return [r * (torch.rand(r.shape, generator=dare_generator(seed, key, t)) >= p) / (1 - p)
                for t, r in enumerate(reps)]

    base, ex = models(3, rank=2)
    out = merging.merge("knots", base=base, experts=ex, merge="dare", drop_rate=p, seed=seed, density=1.0,
                        scaling=0.7)
    want = ref_knots_ties(base, ex, 1.0, 0.7, reps_fn=drop)
    for key in (W1, W2, B):
        close(out[key], want[key])


def test_knots_ta_is_task_arithmetic_and_defaults_are_the_official_configs():
    base, ex = models(3, rank=2)
    out = merging.merge("knots", base=base, experts=ex, merge="ta", scaling=0.4)
    want = merging.merge("task_arithmetic", base=base, experts=ex, scaling=0.4)
    for key in want:
        close(out[key], want[key])
    default = merging.merge("knots", base=base, experts=ex)
    explicit = merging.merge("knots", base=base, experts=ex, merge="ties", density=0.2, scaling=0.6)
    assert all(torch.equal(default[k], explicit[k]) for k in base)


def test_knots_per_tensor_trim_differs_from_global_and_matches_per_matrix_transcription():
    base, ex = models(3)
    out = merging.merge("knots", base=base, experts=ex, density=0.3, scaling=1.0, trim_scope="per_tensor")
    for key in (W1, W2):
        u, reps = ref_basis([e[key] - base[key] for e in ex])
        m = ref_ties(torch.stack([r.reshape(-1) for r in reps]), 0.3, 1.0)
        close(out[key], base[key] + u @ m.reshape(reps[0].shape))
    glob = merging.merge("knots", base=base, experts=ex, density=0.3, scaling=1.0)
    assert not torch.allclose(glob[W1], out[W1])


def test_knots_one_task_ta_at_scaling_1_is_the_expert_and_dare_masks_repeat():
    base, ex = models(1, rank=2)
    out = merging.merge("knots", base=base, experts=ex, merge="ta", scaling=1.0)
    for key in base:
        close(out[key], ex[0][key])
    base, ex = models(2, rank=2)
    a, b, c = (merging.merge("knots", base=base, experts=ex, merge="dare", drop_rate=0.5, seed=s)
               for s in (1, 1, 2))
    assert all(torch.equal(a[k], b[k]) for k in base) and not torch.equal(a[W1], c[W1])


def test_knots_basis_spans_a_low_rank_concatenation_with_its_rank():
    from clmerge.merging.methods.knots import knots_basis

    base, ex = models(3, rank=1)
    taus = torch.stack([e[W1] - base[W1] for e in ex])  # three rank-1 updates of a 7 x 5 matrix
    u, reps = knots_basis(taus)
    assert u.shape == (7, 3) and reps.shape == (3, 3, 5)  # rank 3: the zero directions are dropped
    close(u.T @ u, torch.eye(3, dtype=torch.float64))
    close(torch.einsum("mr,trn->tmn", u, reps), taus)


@pytest.mark.parametrize("kw, words", [({"merge": "magmax"}, "merge must be one of ties, dare, ta"),
                                       ({"density": 0.0}, "density must be in (0, 1]"),
                                       ({"drop_rate": 1.0}, "drop_rate must be in [0, 1)"),
                                       ({"trim_scope": "layer"}, "trim_scope")])
def test_knots_bad_arguments(kw, words):
    base, ex = models(2)
    with pytest.raises(ValueError, match=re.escape(words)):
        merging.merge("knots", base=base, experts=ex, **kw)


# -- PEFT adapters: the path every adapter merge takes (Delta W = s B A over the base) --------------------

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")


def test_knots_one_adapter_ta_reproduces_the_adapter(tmp_path):
    from test_peft_adapters import _llama, make_adapter, peft_deltas

    from clmerge.merging.io import open_checkpoint
    from clmerge.merging.io.peft import AdapterSource
    from clmerge.merging.lora_merge import merge_adapters

    _llama().save_pretrained(tmp_path / "base")
    want = peft_deltas(make_adapter(tmp_path / "a", 3))
    base = open_checkpoint(tmp_path / "base")
    full = merging.merge("knots", base=base, experts=[AdapterSource(tmp_path / "a", base)], merge="ta",
                         scaling=1.0)
    for key in base.keys():
        delta = full[key].double() - base.get(key).double()
        torch.testing.assert_close(delta, want.get(key, torch.zeros_like(delta)).double(), atol=1e-6, rtol=0)
    res = merge_adapters(method="knots", base=base, adapters=[tmp_path / "a"], out=tmp_path / "p",
                         hyperparameters={"merge": "ta", "scaling": 1.0})
    assert res["rank"] == 4 and res["max_rel_error"] < 1e-6
    got = peft_deltas(peft.PeftModel.from_pretrained(_llama(), tmp_path / "p"))
    assert set(got) == set(want)
    for key, d in want.items():
        torch.testing.assert_close(got[key], d, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("merge", ["ties", "dare"])
def test_cli_merges_two_adapters_as_a_full_model_and_as_a_loadable_peft_adapter(tmp_path, merge):
    from checkpoint_helpers import folder_state, invoke
    from test_peft_adapters import _llama, make_adapter

    from clmerge.merging.io.peft import AdapterSource

    _llama().save_pretrained(tmp_path / "base")
    make_adapter(tmp_path / "a1", 1)
    make_adapter(tmp_path / "a2", 2, r=2, lora_alpha=6, target_modules=["q_proj", "k_proj"])
    args = ["--method", "knots", "--set", f"merge={merge}", "--base", tmp_path / "base",
            "--expert", tmp_path / "a1", "--expert", tmp_path / "a2"]
    r = invoke(*args, "--adapter-out", "full", "--out", tmp_path / "full")
    assert r.exit_code == 0, r.output
    r = invoke(*args, "--adapter-out", "peft", "--adapter-rank", "6", "--out", tmp_path / "peft")
    assert r.exit_code == 0, r.output
    base = folder_state(tmp_path / "base")
    full = folder_state(tmp_path / "full")
    loaded = peft.PeftModel.from_pretrained(_llama(), tmp_path / "peft")
    from test_peft_adapters import peft_deltas

    got = peft_deltas(loaded)
    changed = {k for k in base if not torch.equal(full[k], base[k])}
    assert changed and changed <= set(got)
    for key, d in got.items():  # rank 6 = the sum of the input ranks: the merged update exactly
        torch.testing.assert_close(d, full[key] - base[key], atol=1e-5, rtol=1e-4)
    # the adapter path's sources: Delta W of each adapter over the base, merged by the API the same way
    from clmerge.merging.io import open_checkpoint

    b = open_checkpoint(tmp_path / "base")
    api = merging.merge("knots", base=b, experts=[AdapterSource(tmp_path / p, b) for p in ("a1", "a2")],
                        merge=merge)
    for key in changed:
        torch.testing.assert_close(full[key], api[key].to(full[key].dtype), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("live", [0, 2])
def test_a_task_that_leaves_a_matrix_unchanged_is_no_agreeing_vote(dtype, live):
    """An adapter that does not target a module: its representation there is exactly 0 (``U^T 0``), so TIES's
    disjoint mean over the other tasks is not diluted by the rounding noise of the SVD's ``V`` block."""
    base, ex = models(3, rank=2, dtype=dtype)
    for t, e in enumerate(ex):
        if t != live:
            e[W1] = base[W1].clone()
    out = merging.merge("knots", base=base, experts=ex, merge="ties", density=1.0, scaling=1.0)
    tol = 1e-5 if dtype == torch.float32 else 1e-9
    torch.testing.assert_close(out[W1], ex[live][W1], atol=tol, rtol=tol)
