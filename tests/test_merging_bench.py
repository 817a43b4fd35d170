"""The merging benchmark on a tiny setting: random-init 1-layer ViT, 3 digit tasks, a few samples."""

from __future__ import annotations

import json

import pytest

from clmerge.merging import bench

TINY_ARCH = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cfg = bench.BenchConfig(suite="tiny", pretrained=False, arch=TINY_ARCH, epochs=1, max_train=64, max_eval=48,
                            batch_size=32)
    grids = {"weight_average": {}, "task_arithmetic": {"scaling": [0.3, 1.0]},
             "ties": {"density": [0.2], "scaling": [1.0]}, "cart": {"rank_ratio": [0.0, 0.5], "scaling": [1.0]}}
    res = bench.run_benchmark(cfg, out, grids=grids, log=lambda *_: None)
    return out, cfg, grids, res


def test_tables_and_selection_on_validation(tiny_run):
    out, cfg, grids, res = tiny_run
    md = (out / "results.md").read_text()
    for name in ("pretrained", "individual", "weight_average", "task_arithmetic", "ties", "cart"):
        assert f"| {name} |" in md
    saved = json.loads((out / "results.json").read_text())
    assert saved["tasks"] == ["digits-identity", "digits-rot90", "digits-invert"]
    ta = saved["search"]["task_arithmetic"]
    assert saved["rows"]["task_arithmetic"]["hp"] == max(ta, key=lambda r: r["val"])["hp"]
    assert saved["rows"]["individual"]["normalized"] == pytest.approx(100.0)


def test_experts_are_cached_with_their_config(tiny_run, monkeypatch):
    out, cfg, grids, res = tiny_run
    files = sorted((out / "experts").glob("*.safetensors"))
    assert len(files) == 3 and all(f.with_suffix(".json").exists() for f in files)
    meta = json.loads(files[0].with_suffix(".json").read_text())
    assert meta["config"]["epochs"] == 1 and len(meta["sha256"]) == 64
    monkeypatch.setattr(bench.torch.optim, "AdamW", lambda *a, **k: (_ for _ in ()).throw(AssertionError("retrained")))
    again = bench.run_benchmark(cfg, out, grids={"weight_average": {}}, log=lambda *_: None)
    assert again["rows"]["weight_average"]["test"] == res["rows"]["weight_average"]["test"]
