"""``--device``: merges, extract-lora and adapter re-factorisation on a device give the CPU path's results.

Without a GPU the device path runs with the CPU forced as the device (``StrictCpuDevice``: every input moved
by a real copy, every kernel run with the device as PyTorch's default, every result moved back, and any
operation that mixes a device tensor with a host one refused, as CUDA refuses it), and must give the plain
path's bytes exactly. With CUDA visible, the CUDA tests compare with the CPU to the
dtype's precision and check that the peak device memory is reported.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from checkpoint_helpers import folder_state, llama_config, save_variants  # noqa: E402
from clmerge.merging.run import build_recipe, run_merge  # noqa: E402
from device_helpers import StrictCpuDevice  # noqa: E402

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available())")

# (id, method, hyperparameters): the merges the device path must reproduce (the list first)
METHODS = [
    ("task_arithmetic", "task_arithmetic", ["scaling=0.4"]),
    ("ties_per_tensor", "ties", ["density=0.3", "trim_scope=per_tensor"]),
    ("ties_global", "ties", ["density=0.3", "trim_scope=global"]),
    ("ties_global_threshold", "ties", ["density=0.3", "trim_scope=global", "trim_rule=threshold"]),
    ("dare_ta", "dare", ["drop_rate=0.5", "seed=3"]),
    ("dare_ties_global", "dare", ["drop_rate=0.5", "combine=ties", "density=0.5", "trim_scope=global"]),
    ("dare_ties_per_tensor", "dare", ["drop_rate=0.5", "combine=ties", "density=0.5", "trim_scope=per_tensor"]),
    ("tsv_m_randomized", "tsv_m", ["svd=randomized"]),
    ("cart_randomized", "cart", ["svd=randomized", "rank_ratio=0.25"]),
]
# every other merge `clmerge merge` runs from checkpoints alone, with its defaults: (method, sets, experts)
OTHERS = [(m, [], 3) for m in ("breadcrumbs", "breadcrumbs_ties", "consensus", "della", "della_linear", "iso_c",
                               "iso_cts", "karcher", "low_rank_task_arithmetic", "magmax", "model_stock",
                               "multislerp", "sce", "weight_average")]
OTHERS += [(m, ["task=1"], 3) for m in ("emr_merging", "cart_indexing", "tall_mask_ties", "tsv_c")]
OTHERS += [("slerp", ["t=0.3"], 1), ("nearswap", [], 1), ("arcee_fusion", [], 1), ("nuslerp", [], 2)]
OTHERS += [("knots", [], 3), ("opcm", [], 3), ("dop", ["num_steps=2"], 3), ("wudi", ["steps=2"], 3)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("device_models")
    return save_variants(root, llama_config(), ["base", "e1", "e2", "e3"], dtype=torch.bfloat16)


def _merge(models, out, method, sets, device=None, experts=3):
    recipe = build_recipe(None, method, str(models[0]), [str(m) for m in models[1:1 + experts]], sets, {})
    return run_merge(recipe, out, hash_inputs=False, device=device)


@pytest.mark.parametrize("method, sets, experts", [(*m[1:], 3) for m in METHODS] + OTHERS,
                         ids=[m[0] for m in METHODS] + [m[0] for m in OTHERS])
def test_forced_device_path_is_bit_identical(tmp_path, models, method, sets, experts):
    _merge(models, tmp_path / "cpu", method, sets, experts=experts)
    dev = StrictCpuDevice()
    info = _merge(models, tmp_path / "dev", method, sets, device=dev, experts=experts)
    assert dev.moved > 0 and dev.checked > 0  # the inputs took the device path
    assert info.device["device"] == "cpu" and info.device["peak_device_memory_bytes"] is None
    want, got = folder_state(tmp_path / "cpu"), folder_state(tmp_path / "dev")
    assert want.keys() == got.keys()
    for k in want:
        assert want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]), k


def test_plain_cpu_path_reports_no_device(tmp_path, models):
    info = _merge(models, tmp_path / "m", "task_arithmetic", ["scaling=0.4"], device="cpu")
    assert info.device is None


def test_forced_extract_lora_is_bit_identical(tmp_path, models):
    from clmerge.merging.io.extract import extract_lora

    for svd in ("full", "randomized"):
        extract_lora(base=models[0], tuned=models[1], rank=4, out=tmp_path / f"cpu_{svd}", svd=svd)
        dev = StrictCpuDevice()
        res = extract_lora(base=models[0], tuned=models[1], rank=4, out=tmp_path / f"dev_{svd}", svd=svd,
                           device=dev)
        assert dev.moved > 0 and res["device"]["device"] == "cpu"
        want = load_file(str(tmp_path / f"cpu_{svd}" / "adapter_model.safetensors"))
        got = load_file(str(tmp_path / f"dev_{svd}" / "adapter_model.safetensors"))
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), svd
        report = json.loads((tmp_path / f"dev_{svd}" / "extract_report.json").read_text())
        assert report["device"]["device"] == "cpu"


def _adapters(tmp_path):
    peft = pytest.importorskip("peft")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.LlamaModel(cfg).save_pretrained(tmp_path / "base")
    paths = []
    for seed in (1, 2):
        torch.manual_seed(0)
        model = peft.get_peft_model(transformers.LlamaModel(cfg), peft.LoraConfig(r=4, lora_alpha=8,
                                    target_modules=["q_proj", "v_proj"]))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        model.save_pretrained(tmp_path / f"a{seed}")
        paths.append(tmp_path / f"a{seed}")
    return tmp_path / "base", paths


@pytest.mark.parametrize("method, hp", [("ties", {"density": 0.5}), ("dare", {"drop_rate": 0.3, "seed": 1})])
def test_forced_adapter_refactorisation_is_bit_identical(tmp_path, method, hp):
    from clmerge.merging.lora_merge import merge_adapters

    base, paths = _adapters(tmp_path)
    kw = dict(method=method, base=base, adapters=paths, hyperparameters=hp, form="peft", rank=3, svd="randomized")
    merge_adapters(out=tmp_path / "cpu", **kw)
    dev = StrictCpuDevice()
    res = merge_adapters(out=tmp_path / "dev", device=dev, **kw)
    assert dev.moved > 0 and res["device"]["device"] == "cpu"
    want = load_file(str(tmp_path / "cpu" / "adapter_model.safetensors"))
    got = load_file(str(tmp_path / "dev" / "adapter_model.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert json.loads((tmp_path / "dev" / "merge_report.json").read_text())["device"]["device"] == "cpu"


# -- on a CUDA device (skipped without one)

def _close(want: torch.Tensor, got: torch.Tensor, key: str) -> None:
    # bf16 outputs: one rounding step of the output dtype apart at most (the sums may round differently)
    eps = torch.finfo(want.dtype).eps
    tol = 2 * eps * want.float().abs().clamp(min=1e-3)
    assert ((want.float() - got.float()).abs() <= tol).float().mean() > 0.999, key


@CUDA
@pytest.mark.parametrize("method, sets", [m[1:] for m in METHODS[:6]], ids=[m[0] for m in METHODS[:6]])
def test_cuda_merge_agrees_with_cpu_and_reports_peak_memory(tmp_path, models, method, sets):
    _merge(models, tmp_path / "cpu", method, sets)
    info = _merge(models, tmp_path / "gpu", method, sets, device="cuda")
    assert info.device["device"].startswith("cuda") and info.device["peak_device_memory_bytes"] > 0
    want, got = folder_state(tmp_path / "cpu"), folder_state(tmp_path / "gpu")
    for k in want:
        _close(want[k], got[k], k)


@CUDA
def test_cuda_extract_lora_agrees_with_cpu(tmp_path, models):
    from clmerge.merging.io.extract import extract_lora

    a = extract_lora(base=models[0], tuned=models[1], rank=4, out=tmp_path / "cpu", svd="full")
    b = extract_lora(base=models[0], tuned=models[1], rank=4, out=tmp_path / "gpu", svd="full", device="cuda")
    assert b["device"]["peak_device_memory_bytes"] > 0
    assert abs(a["overall_rel_error"] - b["overall_rel_error"]) < 1e-6
