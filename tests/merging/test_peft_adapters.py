"""PEFT LoRA adapters: Delta W against peft's own, merges on Delta W, SVD re-factorisation, factored form."""

from __future__ import annotations

import json

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from clmerge.merging.io import open_checkpoint  # noqa: E402
from clmerge.merging.lora_merge import merge_adapters  # noqa: E402
from clmerge.merging.io.peft import AdapterSource, is_peft_adapter  # noqa: E402
from clmerge.merging import MergeInputError, merge  # noqa: E402
from clmerge.errors import OutputError  # noqa: E402

LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)


def _llama(seed: int = 0):
    torch.manual_seed(seed)
    return transformers.LlamaModel(transformers.LlamaConfig(**LLAMA)).eval()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("base")
    _llama().save_pretrained(d)
    return d


def make_adapter(path, seed: int, **lora_kwargs):
    """A peft adapter on the tiny Llama with random non-zero A and B, saved with ``save_pretrained``."""
    kw = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]) | lora_kwargs
    model = peft.get_peft_model(_llama(), peft.LoraConfig(**kw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(path)
    return model


def peft_deltas(model) -> dict[str, torch.Tensor]:
    """``{base key: get_delta_weight}`` straight from peft's layers."""
    out = {}
    for name, mod in model.base_model.model.named_modules():
        if isinstance(mod, peft.tuners.lora.LoraLayer):
            out[f"{name}.weight"] = mod.get_delta_weight("default").detach().float()
    return out


@pytest.fixture(scope="module")
def two_adapters(tmp_path_factory, base_dir):
    d = tmp_path_factory.mktemp("adapters")
    m1 = make_adapter(d / "a1", 1)
    m2 = make_adapter(d / "a2", 2, r=2, lora_alpha=6, target_modules=["q_proj", "k_proj"])
    return (d / "a1", peft_deltas(m1)), (d / "a2", peft_deltas(m2))


def test_adapter_source_delta_equals_peft(two_adapters, base_dir):
    base = open_checkpoint(base_dir)
    for path, ref in two_adapters:
        assert is_peft_adapter(path)
        src = AdapterSource(path, base)
        assert src.delta_keys == set(ref)
        for k, d in ref.items():
            torch.testing.assert_close(src.delta(k), d, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(src.get(k), base.get(k).float() + d)
            assert src.meta(k) == (tuple(d.shape), torch.float32)
        other = next(k for k in base.keys() if k not in ref)
        assert torch.equal(src.get(other), base.get(other))


@pytest.mark.parametrize("lora_kwargs", [
    dict(use_rslora=True),
    dict(rank_pattern={"layers.1.self_attn.q_proj": 2}, alpha_pattern={"v_proj": 3}),
])
def test_rslora_and_patterns(tmp_path, base_dir, lora_kwargs):
    model = make_adapter(tmp_path / "a", 3, **lora_kwargs)
    src = AdapterSource(tmp_path / "a", open_checkpoint(base_dir))
    for k, d in peft_deltas(model).items():
        torch.testing.assert_close(src.delta(k), d, rtol=1e-6, atol=1e-7)


def test_embedding_lora_and_merge(tmp_path, base_dir):
    """LoRA on embed_tokens (peft's lora_embedding_A/B, Delta W = s (B A)^T): read, merged, written, loaded."""
    base = open_checkpoint(base_dir)
    targets = ["embed_tokens", "q_proj"]
    models = [make_adapter(tmp_path / f"e{i}", 10 + i, target_modules=targets) for i in (1, 2)]
    refs = [peft_deltas(m) for m in models]
    assert "embed_tokens.weight" in refs[0]
    for i, ref in enumerate(refs):
        src = AdapterSource(tmp_path / f"e{i + 1}", base)
        for k, d in ref.items():
            torch.testing.assert_close(src.delta(k), d, rtol=1e-6, atol=1e-7)
    merge_adapters(method="task_arithmetic", base=base, adapters=[tmp_path / "e1", tmp_path / "e2"],
                   hyperparameters={"scaling": 0.5}, out=tmp_path / "m", form="peft", rank=8)
    got = peft_deltas(peft.PeftModel.from_pretrained(_llama(), tmp_path / "m"))
    for k in refs[0]:
        torch.testing.assert_close(got[k], 0.5 * (refs[0][k] + refs[1][k]), rtol=1e-5, atol=1e-6)


def test_fan_in_fan_out_gpt2(tmp_path):
    cfg = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    transformers.GPT2Model(cfg).save_pretrained(tmp_path / "base")
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.GPT2Model(cfg), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["c_attn"], fan_in_fan_out=True))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_()
    model.save_pretrained(tmp_path / "a")
    src = AdapterSource(tmp_path / "a", open_checkpoint(tmp_path / "base"))
    (key, ref), = peft_deltas(model).items()
    assert ref.shape == (16, 48)  # Conv1D stores (in, out)
    torch.testing.assert_close(src.delta(key), ref)


def test_unsupported_and_unmatched_adapters(tmp_path, base_dir):
    base = open_checkpoint(base_dir)
    make_adapter(tmp_path / "pissa", 4, init_lora_weights="pissa")  # DoRA is merged: test_adapter_variants.py
    with pytest.raises(MergeInputError, match="init_lora_weights='pissa' changes the base weights"):
        AdapterSource(tmp_path / "pissa", base)
    make_adapter(tmp_path / "ok", 4)
    cfg = json.loads((tmp_path / "ok" / "adapter_config.json").read_text())
    renamed = {k.replace("layers.0.self_attn.q_proj", "layers.0.self_attn.nope"): v
               for k, v in __import__("safetensors.torch").torch.load_file(
                   str(tmp_path / "ok" / "adapter_model.safetensors")).items()}
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text(json.dumps(cfg))
    __import__("safetensors.torch").torch.save_file(renamed, str(tmp_path / "bad" / "adapter_model.safetensors"))
    with pytest.raises(MergeInputError, match="'layers.0.self_attn.nope' matches no base key"):
        AdapterSource(tmp_path / "bad", base)


def _direct(method, base, deltas, **hp):
    """The method run on plain dicts ``theta_0`` and ``theta_0 + Delta W_t`` (float64), minus ``theta_0``."""
    keys = sorted(set().union(*deltas))
    b = {k: base.get(k).double() for k in keys}
    experts = [{k: b[k] + d[k].double() if k in d else b[k].clone() for k in keys} for d in deltas]
    merged = merge(method, base=b, experts=experts, **hp)
    return {k: merged[k] - b[k] for k in keys}


def _written_deltas(out, base):
    return AdapterSource(out, base)


@pytest.mark.parametrize("method,hp", [("task_arithmetic", {"scaling": 0.7}), ("ties", {"density": 0.3})])
def test_merge_equals_merging_the_deltas(tmp_path, two_adapters, base_dir, method, hp):
    base = open_checkpoint(base_dir)
    deltas = [ref for _, ref in two_adapters]
    ref = _direct(method, base, deltas, **hp)
    res = merge_adapters(method=method, base=base, adapters=[p for p, _ in two_adapters], hyperparameters=hp,
                         out=tmp_path / "m", form="peft", rank=32)  # full rank for 32 x 32 / 48 x 32
    assert res["max_rel_error"] < 1e-6 and res["rank"] == 32
    got = AdapterSource(tmp_path / "m", base)
    assert got.delta_keys == set(ref)
    for k, d in ref.items():
        torch.testing.assert_close(got.delta(k).double(), d, rtol=1e-5, atol=1e-6)
    assert json.loads((tmp_path / "m" / "merge_report.json").read_text())["method"] == method


def test_averaging_factors_separately_is_wrong(tmp_path, two_adapters, base_dir):
    """The old bug: averaging A and B separately. The merged update must be the mean of the Delta W's."""
    base = open_checkpoint(base_dir)
    (p1, d1), _ = two_adapters
    make_adapter(tmp_path / "a3", 7)
    d3 = AdapterSource(tmp_path / "a3", base)
    merge_adapters(method="weight_average", base=base, adapters=[p1, tmp_path / "a3"], out=tmp_path / "m",
                   form="factored")
    got = AdapterSource(tmp_path / "m", base)
    a1, a3 = AdapterSource(p1, base), d3
    for k in d1:
        want = (d1[k] + d3.delta(k)) / 2
        torch.testing.assert_close(got.delta(k), want, rtol=1e-5, atol=1e-6)
        m1, m3 = a1.modules[k], a3.modules[k]
        naive = m1.scale * ((m1.lora_b + m3.lora_b) / 2) @ ((m1.lora_a + m3.lora_a) / 2)
        assert (naive - want).norm() / want.norm() > 0.3


def test_svd_error_is_the_tail_share(tmp_path, two_adapters, base_dir):
    base = open_checkpoint(base_dir)
    paths = [p for p, _ in two_adapters]
    hp = {"scaling": 1.0}
    ref = _direct("task_arithmetic", base, [d for _, d in two_adapters], **hp)
    res = merge_adapters(method="task_arithmetic", base=base, adapters=paths, hyperparameters=hp,
                         out=tmp_path / "m", form="peft", rank=3)
    got = AdapterSource(tmp_path / "m", base)
    tails, totals = 0.0, 0.0
    for k, d in ref.items():
        s = torch.linalg.svdvals(d)
        want = float(s[3:].square().sum().sqrt() / s.square().sum().sqrt())
        mod = got.modules[k].name
        # abs: the reference Delta W's are peft's float32 ones (a rank-2 module's tail is float32 noise there)
        assert res["per_module_rel_error"][mod] == pytest.approx(want, rel=1e-6, abs=1e-7)
        assert float((d - got.delta(k).double()).norm() / d.norm()) == pytest.approx(want, rel=1e-4, abs=1e-6)
        tails, totals = tails + float(s[3:].square().sum()), totals + float(s.square().sum())
    assert res["overall_rel_error"] == pytest.approx((tails / totals) ** 0.5, rel=1e-6)
    assert res["max_rel_error"] == max(res["per_module_rel_error"].values()) > 0.05
    # rank sum of the inputs (4 + 2) is exact for task arithmetic: error 0
    res6 = merge_adapters(method="task_arithmetic", base=base, adapters=paths, hyperparameters=hp,
                          out=tmp_path / "m6", form="peft", rank=6)
    assert res6["max_rel_error"] < 1e-6


def test_rank_sum_is_exact_to_float64_rounding(tmp_path, two_adapters, base_dir):
    """Each adapter's Delta W is formed in float64 for the merge (formed in float32, the rank-(r1 + r2)
    re-factorisation of task arithmetic was off by ~5e-8, float32 rounding)."""
    base = open_checkpoint(base_dir)
    res = merge_adapters(method="task_arithmetic", base=base, adapters=[p for p, _ in two_adapters],
                         hyperparameters={"scaling": 1.0}, out=tmp_path / "m6", form="peft", rank=6)
    assert res["max_rel_error"] < 1e-12, res["max_rel_error"]


def test_factored_form_exact_and_loads_in_peft(tmp_path, two_adapters, base_dir):
    base = open_checkpoint(base_dir)
    paths = [p for p, _ in two_adapters]
    ref = _direct("task_arithmetic", base, [d for _, d in two_adapters], scaling=0.4)
    res = merge_adapters(method="task_arithmetic", base=base, adapters=paths, hyperparameters={"scaling": 0.4},
                         out=tmp_path / "f", form="factored")
    assert res["rank"] == 6 and res["ranks"]["layers.0.self_attn.v_proj"] == 4
    loaded = peft.PeftModel.from_pretrained(_llama(), tmp_path / "f")
    got = peft_deltas(loaded)
    assert set(got) == set(ref)
    for k, d in ref.items():
        torch.testing.assert_close(got[k].double(), d, rtol=1e-5, atol=1e-6)
    with pytest.raises(MergeInputError, match="use --adapter-out peft"):
        merge_adapters(method="ties", base=base, adapters=paths, out=tmp_path / "t", form="factored")
    assert not (tmp_path / "t").exists()


def test_peft_form_loads_in_peft(tmp_path, two_adapters, base_dir):
    base = open_checkpoint(base_dir)
    merge_adapters(method="ties", base=base, adapters=[p for p, _ in two_adapters], out=tmp_path / "m",
                   hyperparameters={"density": 0.5})
    loaded = peft.PeftModel.from_pretrained(_llama(), tmp_path / "m")
    mine = AdapterSource(tmp_path / "m", base)
    for k, d in peft_deltas(loaded).items():
        torch.testing.assert_close(mine.delta(k), d)


def test_refuses_unsafe_out(tmp_path, two_adapters, base_dir):
    paths = [p for p, _ in two_adapters]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(OutputError, match="not empty"):
        merge_adapters(method="task_arithmetic", base=base_dir, adapters=paths, out=tmp_path / "full")
    with pytest.raises(OutputError, match="contains or lies inside the input"):
        merge_adapters(method="task_arithmetic", base=base_dir, adapters=paths, out=paths[0])


def test_full_form_adapter_sources_as_experts(two_adapters, base_dir):
    """The 'full' form is the ordinary merge with AdapterSource experts over the whole base key set."""
    base = open_checkpoint(base_dir)
    srcs = [AdapterSource(p, base) for p, _ in two_adapters]
    merged = merge("task_arithmetic", base=base, experts=srcs, scaling=0.5)
    assert set(merged) == set(base.keys())
    for k in base.keys():
        want = base.get(k).double() + 0.5 * sum(d[k].double() for _, d in two_adapters if k in d)
        torch.testing.assert_close(merged[k].double(), want, rtol=0, atol=1e-6)


def test_bf16_sharded_base_and_bin_adapter(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaModel(transformers.LlamaConfig(**LLAMA)).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "base", max_shard_size="20KB")
    assert (tmp_path / "base" / "model.safetensors.index.json").exists()
    peft_model = make_adapter(tmp_path / "a", 5)
    peft_model.save_pretrained(tmp_path / "bin", safe_serialization=False)
    assert (tmp_path / "bin" / "adapter_model.bin").exists()
    base = open_checkpoint(tmp_path / "base")
    src = AdapterSource(tmp_path / "bin", base)
    for k, d in peft_deltas(peft_model).items():
        assert base.meta(k)[1] == torch.bfloat16 and src.meta(k)[1] == torch.float32
        torch.testing.assert_close(src.get(k), base.get(k).float() + d)


def test_sources_never_modify_the_base(two_adapters, base_dir):
    base = open_checkpoint(base_dir)
    as_dict = {k: base.get(k) for k in base.keys()}
    keep = {k: v.clone() for k, v in as_dict.items()}
    from clmerge.merging import ParamSource

    src = AdapterSource(two_adapters[0][0], ParamSource(as_dict))
    for k in src.delta_keys:
        src.get(k)
    merge_adapters(method="weight_average", base=ParamSource(as_dict), adapters=[p for p, _ in two_adapters],
                   out=base_dir.parent / "avg", form="peft")
    assert all(torch.equal(as_dict[k], keep[k]) for k in keep)
    with pytest.raises(TypeError, match="density: not a hyperparameter of task_arithmetic"):
        merge_adapters(method="task_arithmetic", base=base, adapters=[p for p, _ in two_adapters],
                       hyperparameters={"density": 0.2}, out=base_dir.parent / "x", form="factored")


def test_rank_above_min_out_in_is_clamped_not_zero_padded(tmp_path, two_adapters, base_dir):
    """--adapter-rank 64 on modules of 16 x 32 to 32 x 48: each written at rank min(out, in) (exact), named
    in rank_pattern and in a note; the old code wrote 64 rows and columns, the rest zeros."""
    base = open_checkpoint(base_dir)
    res = merge_adapters(method="task_arithmetic", base=base, adapters=[p for p, _ in two_adapters],
                         hyperparameters={"scaling": 1.0}, out=tmp_path / "m", form="peft", rank=64)
    assert res["max_rel_error"] < 1e-12
    assert any("rank 64 is above min(out, in)" in w for w in res["warnings"])
    got = AdapterSource(tmp_path / "m", base)
    for key, m in got.modules.items():
        assert m.rank == min(base.meta(key)[0]) == res["ranks"][m.name] < 64, key
    cfg = json.loads((tmp_path / "m" / "adapter_config.json").read_text())
    assert cfg["r"] == 64 and len(cfg["rank_pattern"]) == len(got.modules)
    assert cfg["alpha_pattern"] == cfg["rank_pattern"]
    peft_deltas(peft.PeftModel.from_pretrained(_llama(), tmp_path / "m"))  # loads


def test_extract_lora_rank_above_min_out_in_is_clamped(tmp_path):
    from clmerge import merging
    from clmerge.merging.io.extract import extract_lora

    g = torch.Generator().manual_seed(0)
    base = {"lin.weight": torch.randn(4, 6, generator=g), "big.weight": torch.randn(12, 12, generator=g)}
    tuned = {k: v + torch.randn(v.shape, generator=g) for k, v in base.items()}
    res = extract_lora(base=merging.ParamSource(base, "b"), tuned=merging.ParamSource(tuned, "t"), rank=8,
                       out=tmp_path / "x")
    assert res["ranks_clamped"] == {"lin": 4} and "lin: rank 4" in res["note"]
    from safetensors.torch import load_file

    w = load_file(str(tmp_path / "x" / "adapter_model.safetensors"))
    assert w["base_model.model.lin.lora_A.weight"].shape == (4, 6)
    assert w["base_model.model.big.lora_A.weight"].shape == (8, 12)
    cfg = json.loads((tmp_path / "x" / "adapter_config.json").read_text())
    assert cfg["rank_pattern"] == {"lin": 4} and cfg["alpha_pattern"] == {"lin": 4}


def test_adapter_naming_another_base_model_warns_naming_both(tmp_path, two_adapters, base_dir):
    import shutil

    from clmerge.merging.io.peft import _same_model

    base = open_checkpoint(base_dir)
    (p1, _), _ = two_adapters
    shutil.copytree(p1, tmp_path / "a")
    cfg_path = tmp_path / "a" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "base_model_name_or_path": "someone/other-model"}))
    src = AdapterSource(tmp_path / "a", base)
    assert "'someone/other-model'" in src.warning and repr(str(base.name)) in src.warning
    res = merge_adapters(method="task_arithmetic", base=base, adapters=[tmp_path / "a", p1],
                         out=tmp_path / "m", form="factored")
    assert res["warnings"] == [src.warning]
    assert AdapterSource(p1, base).warning is None  # names no base model, or this one
    assert _same_model("sentence-transformers/all-MiniLM-L6-v2", "/models/all-MiniLM-L6-v2")
    assert not _same_model("sentence-transformers/all-MiniLM-L6-v2", "/models/bert-base-uncased")


@pytest.mark.parametrize("adapter_out", ["peft", "full"])
def test_cli_prints_the_base_model_warning_and_the_rank_note(tmp_path, two_adapters, base_dir, adapter_out):
    import shutil

    from checkpoint_helpers import invoke

    (p1, _), (p2, _) = two_adapters
    shutil.copytree(p1, tmp_path / "a")
    cfg_path = tmp_path / "a" / "adapter_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "base_model_name_or_path": "org/other"}))
    extra = ["--adapter-rank", "64"] if adapter_out == "peft" else []
    res = invoke("--method", "task_arithmetic", "--base", base_dir, "--expert", tmp_path / "a", "--expert", p2,
                 "--adapter-out", adapter_out, *extra, "--out", tmp_path / "m")
    assert res.exit_code == 0, res.output
    assert "warning:" in res.stderr and "'org/other'" in res.stderr and str(base_dir) in res.stderr
    assert ("note: rank 64 is above min(out, in)" in res.stderr) == (adapter_out == "peft")


def test_per_tensor_ties_on_float64_updates_equals_peft_ties():
    """The route of TIES adapter merges: float64 ``theta_0 + Delta W`` inputs, per-tensor trim. On 384 x 384
    updates (int(0.2 n) = round(0.2 n) = 29,491, no ties at the cut) it is peft's ``ties`` on the same task
    vectors: the same kept entries, equal to float64 rounding. Before, the trim threshold was found on the
    inputs rounded to float32 and 29,490 entries were kept in some tensors."""
    from peft.utils.merge_utils import ties as peft_ties

    from clmerge import merging

    g = torch.Generator().manual_seed(0)
    base = {f"m{i}.weight": torch.randn(384, 384, generator=g, dtype=torch.float64) * 0.05 for i in range(3)}

    def lora_delta():  # float32 factors, Delta W = B A formed in float64, as merge_adapters forms it
        b, a = torch.randn(384, 8, generator=g) * 0.02, torch.randn(8, 384, generator=g) * 0.02
        return b.double() @ a.double()

    experts = [{k: v + lora_delta() for k, v in base.items()} for _ in range(2)]
    out = merging.ties(base=base, experts=experts, density=0.2, trim_scope="per_tensor", scaling=1.0)
    for k, b in base.items():
        ref = peft_ties([e[k] - b for e in experts], torch.ones(2, dtype=torch.float64), 0.2)
        got = out[k] - b
        assert torch.equal(got.abs() > 1e-12, ref != 0), k
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-15)


def test_adapter_merge_dry_run_writes_nothing_and_a_file_out_is_refused_before_any_work(tmp_path, two_adapters,
                                                                                       base_dir):
    """The runner's one output check covers adapter merges too: ``--dry-run`` prints the plan and writes
    nothing (it used to merge), and ``--out X.safetensors`` is refused up front (a PEFT adapter is a folder)."""
    from checkpoint_helpers import invoke

    (p1, _), (p2, _) = two_adapters
    args = ["--method", "task_arithmetic", "--base", base_dir, "--expert", p1, "--expert", p2, "--adapter-out", "peft"]
    res = invoke(*args, "--dry-run", "--out", tmp_path / "m")
    assert res.exit_code == 0, res.output
    assert "task_arithmetic of 2 adapters into one peft adapter" in res.stdout
    assert not (tmp_path / "m").exists()
    res = invoke(*args, "--out", tmp_path / "m.safetensors")
    assert res.exit_code == 5, res.output
    assert "PEFT adapter folder" in res.stderr and not (tmp_path / "m.safetensors").exists()
    res = invoke(*args, "--out", p1)  # an input: refused by the same rule as a model merge's
    assert res.exit_code == 5, res.output
