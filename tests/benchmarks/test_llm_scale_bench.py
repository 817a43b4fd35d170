"""The llm_scale benchmark's helpers (benchmarks/merging): agreement statistics, output checks, recipes, variants."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "merging"


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"merging_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
