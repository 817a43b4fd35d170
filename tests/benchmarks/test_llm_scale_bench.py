"""The llm_scale benchmark's helpers (benchmarks/merging): agreement statistics, output checks, recipes, variants."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from bench_helpers import load_bench


def _load(name: str):
    return load_bench("merging", name)


def _folder(path: Path, sd: dict[str, torch.Tensor]) -> Path:
    """Two shards and an index, as ``save_pretrained`` writes them."""
    path.mkdir(parents=True)
    keys = list(sd)
    halves = {"model-00001-of-00002.safetensors": keys[:1], "model-00002-of-00002.safetensors": keys[1:]}
    for f, ks in halves.items():
        save_file({k: sd[k] for k in ks}, str(path / f), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, ks in halves.items() for k in ks}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def test_compare_matches_direct_statistics(tmp_path: Path) -> None:
    check = _load("llm_scale_check")
    g = torch.Generator().manual_seed(0)
    shapes = {"w": (6, 5), "b": (7,)}
    base = {k: torch.randn(s, generator=g).bfloat16() for k, s in shapes.items()}
    experts = [{k: (v.float() + 0.1 * torch.randn(v.shape, generator=g)).bfloat16() for k, v in base.items()}
               for _ in range(3)]
    a = {k: (v.float() + 0.05 * torch.randn(v.shape, generator=g)).bfloat16() for k, v in base.items()}
    b = {k: v.clone() for k, v in a.items()}
    b["w"][0, 0] += 0.5
    b["b"][:3] = base["b"][:3]  # three entries unchanged from the base in b
    dirs = [_folder(tmp_path / n, sd) for n, sd in (("a", a), ("b", b), ("base", base))]
    edirs = [_folder(tmp_path / f"e{i}", e) for i, e in enumerate(experts)]
    res = check.compare(dirs[0], dirs[1], dirs[2], edirs, ta_scaling=0.3)

    flat = lambda sd: torch.cat([sd[k].double().flatten() for k in shapes])  # noqa: E731
    da, db = flat(a) - flat(base), flat(b) - flat(base)
    ta = 0.3 * sum(flat(e) - flat(base) for e in experts)
    assert res["entries"] == 37
    assert res["max_abs_diff"] == pytest.approx(float((da - db).abs().max()))
    assert res["differ_fraction"] == pytest.approx(int((da != db).sum()) / 37)
    assert not res["bit_identical"]
    assert res["rel_diff"] == pytest.approx(float((da - db).norm() / db.norm()))
    assert res["delta_cosine"] == pytest.approx(float(da @ db / (da.norm() * db.norm())))
    assert res["b_changed_fraction"] == pytest.approx(int((db != 0).sum()) / 37)
    assert res["a_rel_dist_to_dense_ta"] == pytest.approx(float((da - ta).norm() / ta.norm()), rel=1e-5)

    same = check.compare(dirs[0], dirs[0], dirs[2], [], ta_scaling=None)
    assert same["bit_identical"] and same["max_abs_diff"] == 0.0 and same["delta_cosine"] == pytest.approx(1.0)


def test_loads_checks_keys_and_transformers(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    check = _load("llm_scale_check")
    cfg = LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=32, vocab_size=50)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(tmp_path / "base"))
    model.save_pretrained(str(tmp_path / "out"))
    assert check.loads(tmp_path / "out", tmp_path / "base")["ok"]
    sd = {k: v for k, v in model.state_dict().items() if "lm_head" not in k}
    broken = tmp_path / "broken"
    model.config.save_pretrained(str(broken))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(broken / "model.safetensors"), metadata={"format": "pt"})
    res = check.loads(broken, tmp_path / "base")
    assert not res["keys_shapes_dtypes_match"] and res["first_mismatch"] == "lm_head.weight" and not res["ok"]


def test_mergekit_recipe_and_pending(tmp_path: Path) -> None:
    scale = _load("llm_scale")
    args = argparse.Namespace(data=tmp_path, mergekit=tmp_path / "venv", threads=1, shard="5GB")
    assert scale.mergekit_command(args, "ties_per_tensor", tmp_path / "out").startswith("skipped: no ")
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "mergekit-yaml").touch()
    argv = scale.mergekit_command(args, "ties_per_tensor", tmp_path / "out")
    recipe = (tmp_path / "out.yaml").read_text()
    assert "merge_method: ties" in recipe and f"base_model: {tmp_path / 'base'}" in recipe
    assert recipe.count('{"weight": 1.0, "density": 0.2}') == 3 and '"lambda": 1.0' in recipe
    assert "dtype: float32" in recipe and "out_dtype: bfloat16" in recipe
    assert argv[argv.index("--out-shard-size") + 1] == "5B"  # mergekit 0.1.5 counts bytes: "5B" = 5e9
    linear = scale.mergekit_command(args, "linear", tmp_path / "lin")
    assert "base_model" not in (tmp_path / "lin.yaml").read_text() and linear[0].endswith("mergekit-yaml")


def test_variant_delta_is_sparse_small_and_low_rank() -> None:
    models = _load("llm_models")
    g = torch.Generator().manual_seed(1)
    w = (0.02 * torch.randn(64, 48, generator=g)).bfloat16()
    v = models.variant_tensor(w, torch.Generator().manual_seed(2))
    assert v.dtype == torch.bfloat16 and v.shape == w.shape
    d = v.float() - w.float()
    assert 0 < float(d.abs().max()) < 0.1 * float(w.float().std())
    norm = torch.ones(32, dtype=torch.bfloat16)  # a constant tensor: scale from the mean |w|
    dn = models.variant_tensor(norm, torch.Generator().manual_seed(3)).float() - 1
    assert 0.1 < float((dn != 0).float().mean()) < 0.6  # only the sparse part (no low rank on vectors)


# --- the SVD merges (CART, TSV-M, Iso-CTS) and the FusionBench tool ------------------------------------------

# a stand-in FusionBench checkout: the five files fusionbench_llm.py loads, with FusionBench's signatures; the
# "merges" are the mean task vector and record what they were given
FAKE_FB = {
    "fusion_bench/utils/type.py": "StateDictType = dict\nTorchModelType = object\n",
    "fusion_bench/utils/timer.py": "class timeit_context:\n    def __init__(self, msg=None): pass\n"
                                   "    def __enter__(self): return self\n    def __exit__(self, *a): return False\n",
    "fusion_bench/utils/state_dict_arithmetic.py": (
        "from fusion_bench.utils.type import StateDictType\n"
        "def state_dict_sub(a, b): return {k: a[k] - b[k] for k in a}\n"
        "def state_dict_add(a, b):\n"
        "    assert all(a[k].dtype == b[k].dtype for k in a), 'dtype mismatch'\n"
        "    return {k: a[k] + b[k] for k in a}\n"
        "def state_dict_mul(a, s): return {k: v * s for k, v in a.items()}\n"),
    "fusion_bench/method/task_singular_vector/utils/TSVM_utils.py": (
        "CALLS = []\n"
        "def compute_and_sum_svd_mem_reduction(tvs, exclude_keys=None, accelerator='cpu'):\n"
        "    CALLS.append((exclude_keys, {k: v.dtype for k, v in tvs[0].items()}))\n"
        "    return {k: sum(t[k] for t in tvs) / len(tvs) for k in tvs[0]}\n"),
    "fusion_bench/method/isotropic_merging/iso_utils.py": (
        "from fusion_bench.utils import timeit_context\n"
        "CALLS = []\n"
        "def iso_cts(tvs, common_space_fraction, accelerator='cuda', exclude_keys=None):\n"
        "    CALLS.append((exclude_keys, {k: v.dtype for k, v in tvs[0].items()}, common_space_fraction))\n"
        "    return {k: sum(t[k] for t in tvs) / len(tvs) for k in tvs[0]}\n"),
}


def _fake_fusion_bench(root: Path) -> Path:
    for rel, text in FAKE_FB.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.mark.parametrize("method", ["tsv_m", "iso_cts"])
def test_fusionbench_runner_passes_clmerge_exclusions_and_writes_a_folder(tmp_path: Path,
                                                                           method: str) -> None:
    for m in [m for m in sys.modules if m == "fusion_bench" or m.startswith("fusion_bench.")]:
        del sys.modules[m]  # each case loads its own stand-in checkout
    runner = _load("fusionbench_llm")
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (9, 4), "model.layers.0.mlp.up_proj.weight": (6, 4),
              "model.norm.weight": (4,)}
    base = {k: torch.randn(s, generator=g).bfloat16() for k, s in shapes.items()}
    experts = [{k: (v.float() + 0.1 * torch.randn(v.shape, generator=g)).bfloat16() for k, v in base.items()}
               for _ in range(3)]
    bdir = _folder(tmp_path / "base", base)
    (bdir / "config.json").write_text("{}")
    edirs = [str(_folder(tmp_path / f"e{i}", e)) for i, e in enumerate(experts)]
    out = tmp_path / "out"
    runner.main(["--fusion-bench", str(_fake_fusion_bench(tmp_path / "fb")), "--method", method,
                 "--base", str(bdir), *sum([["--expert", e] for e in edirs], []), "--out", str(out),
                 "--scaling", "2.0"])
    calls = sys.modules["fusion_bench.method.task_singular_vector.utils.TSVM_utils" if method == "tsv_m"
                        else "fusion_bench.method.isotropic_merging.iso_utils"].CALLS
    assert calls[0][0] == ["model.embed_tokens.weight"]  # clmerge's default rule: embeddings averaged
    want_tv = torch.bfloat16 if method == "tsv_m" else torch.float32  # Iso-CTS gets float32 (no bf16 SVD)
    assert set(calls[0][1].values()) == {want_tv}
    from safetensors.torch import load_file

    merged = load_file(str(out / "model.safetensors"))
    assert (out / "config.json").exists() and not (tmp_path / "out.partial").exists()
    for k, b in base.items():
        assert merged[k].dtype == torch.bfloat16
        mean_tv = sum(e[k].float() - b.float() for e in experts) / 3
        assert torch.allclose(merged[k].float(), b.float() + 2.0 * mean_tv, atol=0.05)


def test_svd_cells_commands_and_not_applicable(tmp_path: Path) -> None:
    scale = _load("llm_scale")
    args = argparse.Namespace(data=tmp_path, fusion_bench=None, python="py", threads=1, shard="5GB")
    assert scale.fusionbench_command(args, "iso_cts", tmp_path / "o").startswith("skipped: no --fusion-bench")
    args.fusion_bench = tmp_path / "fb"
    argv = scale.fusionbench_command(args, "iso_cts", tmp_path / "o")
    assert argv[1].endswith("fusionbench_llm.py") and argv.count("--expert") == 3
    assert argv[argv.index("--common-space-fraction") + 1] == "0.8"
    assert argv[argv.index("--method") + 1] == "iso_cts"
    assert scale.METHODS["cart"]["fusionbench"] is None and scale.METHODS["cart"]["mergekit"] is None
    assert scale.METHODS["cart"]["clmerge"][1]["svd"] == "randomized"  # k = 8% of the rank: small


@pytest.mark.slow
def test_tiny_smoke_svd_cells_with_a_fusion_bench_checkout(tmp_path: Path) -> None:
    """``--tiny``: every SVD cell of both tools runs, its output loads, and the report has them."""
    scale = _load("llm_scale")
    js, md = tmp_path / "r.json", tmp_path / "r.md"
    scale.main(["--tiny", "--data", str(tmp_path / "d"), "--methods", "cart", "tsv_m", "iso_cts", "--tools",
                "clmerge", "fusionbench", "mergekit", "--conditions", "idle", "--fusion-bench",
                str(_fake_fusion_bench(tmp_path / "fb")), "--mergekit", str(tmp_path / "none"),
                "--json", str(js), "--out", str(md)])
    cells = json.loads(js.read_text())["cells"]
    for key in ("clmerge/cart", "clmerge/tsv_m", "clmerge/iso_cts", "fusionbench/tsv_m",
                "fusionbench/iso_cts"):
        assert cells[f"idle/{key}"]["status"] == "ok" and cells[f"idle/{key}"]["loads"]["ok"], key
    assert cells["idle/fusionbench/cart"]["status"].startswith("n/a")
    assert cells["idle/mergekit/tsv_m"]["status"].startswith("n/a")
    assert "| tsv_m | fusionbench | ok |" in md.read_text()


def test_svd_error_prints_a_line_per_matrix_with_small_errors(tmp_path: Path, capsys) -> None:
    err = _load("llm_svd_error")
    g = torch.Generator().manual_seed(0)
    key = "model.layers.0.self_attn.k_proj.weight"
    base = torch.randn(40, 36, generator=g)
    for name, delta in (("base", 0), *((f"variant{i}", 1) for i in (1, 2, 3))):
        _folder(tmp_path / name, {key: base + delta * 0.1 * torch.randn(40, 36, generator=g),
                                  "model.norm.weight": torch.ones(36)})
    err.main(["--data", str(tmp_path), "--matrices", "self_attn.k_proj"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])[key]
    assert row["shape"] == [40, 36]
    # CART keeps k = ceil(0.08 * 36) = 3 < 18: randomized, a small error; TSV-M keeps 12 < 18: randomized too
    assert 0 < row["cart"] < 0.5 and 0 < row["tsv_m"] < 0.5 and 0 <= row["iso_cts"] < 0.5
