"""Merges on loaded objects: ``add_merged_adapter`` against peft's ``add_weighted_adapter`` on Delta W,
against the adapter-folder path, and ``merge_models`` against the checkpoint-file path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from device_helpers import StrictCpuDevice  # noqa: E402
from peft.tuners.lora import LoraLayer  # noqa: E402

from clmerge.merging import MergeInputError, add_merged_adapter, available, merge, merge_models  # noqa: E402
from clmerge.merging.io import open_checkpoint  # noqa: E402
from clmerge.merging.lora_merge import merge_adapters  # noqa: E402
from clmerge.merging.methods.dare import dare_generator  # noqa: E402


class Tiny(nn.Module):
    """Every adapted weight has min(out, in) = 8, so one SVD rank (8) is full rank in peft's single-rank SVD;
    per-weight entry counts 96, 96, 128 make density * n an integer at densities 0.25 and 0.5."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.up = nn.Linear(8, 12)
        self.down = nn.Linear(12, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(self.emb(x))))


FULL = 8
NAMES = ("math", "code")


def _randomise(model, seed: int, adapter: str) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if f".{adapter}" in name and "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def tiny_peft(ranks=(2, 2), alphas=(4, 3), targets=("emb", "up", "down")):
    torch.manual_seed(0)
    model = None
    for i, (name, r, alpha) in enumerate(zip(NAMES, ranks, alphas)):
        cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets))
        if model is None:
            model = peft.get_peft_model(Tiny(), cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
        _randomise(model, 10 + i, name)
    return model.eval()


def deltas(model, adapter: str) -> dict[str, torch.Tensor]:
    """``{module: Delta W}`` of ``adapter`` from peft's own layers (float64)."""
    return {n: m.get_delta_weight(adapter).detach().double()
            for n, m in model.base_model.model.named_modules()
            if isinstance(m, LoraLayer) and (adapter in m.lora_A or adapter in m.lora_embedding_A)}


def deltas64(model, adapter: str) -> dict[str, torch.Tensor]:
    """``{module: s B A}`` formed in float64 from the factors (transposed for an embedding)."""
    out = {}
    for n, m in model.base_model.model.named_modules():
        if isinstance(m, LoraLayer) and adapter in m.lora_embedding_A:
            b, a = m.lora_embedding_B[adapter], m.lora_embedding_A[adapter]
        elif isinstance(m, LoraLayer) and adapter in m.lora_A:
            b, a = m.lora_B[adapter].weight, m.lora_A[adapter].weight
        else:
            continue
        d = (b.detach().double() @ a.detach().double()).mul_(m.scaling[adapter])
        out[n] = d.t() if adapter in m.lora_embedding_A else d
    return out


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def shared_dare_masks(model, monkeypatch, seed: int = 0) -> None:
    """Make peft's DARE draw clmerge's masks: peft's ``random_pruning`` is called module by module
    (``named_modules`` order), adapter by adapter; clmerge's mask of (key, expert t) comes from
    ``dare_generator(seed, key, t)``."""
    import peft.utils.merge_utils as mu

    order = [(f"{n}.weight", t) for n, m in model.base_model.model.named_modules() if isinstance(m, LoraLayer)
             for t in range(len(NAMES))]
    calls = iter(order)

    def random_pruning(tensor, density, rescale):
        key, t = next(calls)
        keep = torch.rand(tensor.shape, generator=dare_generator(seed, key, t)) >= 1.0 - density
        out = tensor * keep
        return out / density if rescale else out

    monkeypatch.setattr(mu, "random_pruning", random_pruning)


# peft combination_type -> (weights, density); weights unequal where the rule is linear in each update
PEFT_CASES = {
    "svd": ([1.0, -0.5], None),
    "cat": ([0.7, 1.3], None),
    "magnitude_prune_svd": ([0.8, 0.3], 0.5),
    "dare_linear_svd": ([1.0, 0.6], 0.5),
    "ties_svd": ([0.7, 0.7], 0.5),
    "dare_ties_svd": ([1.0, 1.0], 0.75),
}


@pytest.mark.parametrize("combination", sorted(PEFT_CASES))
def test_delta_w_agrees_with_add_weighted_adapter(combination, monkeypatch):
    """At full rank the merged Delta W equals peft's to float32 rounding (peft works in float32)."""
    weights, density = PEFT_CASES[combination]
    model = tiny_peft()
    if combination.startswith("dare"):
        shared_dare_masks(model, monkeypatch)
    kw = {} if density is None else {"density": density}
    model.add_weighted_adapter(list(NAMES), weights, "peft", combination_type=combination, svd_rank=FULL,
                               **kw)
    report = add_merged_adapter(model, list(NAMES), method=combination, weights=weights, new_name="ours",
                                rank=FULL, **kw)
    ours, theirs = deltas(model, "ours"), deltas(model, "peft")
    scale = max(float(d.abs().max()) for d in theirs.values())
    assert max_diff(ours, theirs) < 2e-6 * scale, (combination, max_diff(ours, theirs))
    assert report["max_rel_error"] < 1e-12  # full rank: nothing lost in the write-back
    assert report["adapter"] == "ours" and report["adapters"] == list(NAMES)


def test_linear_combinations_are_exact_sums():
    """svd / cat are sum_t w_t Delta W_t: ours to float32 rounding of the written factors."""
    model = tiny_peft(ranks=(2, 3), alphas=(4, 5))
    w = [0.9, -0.4]
    truth = {k: w[0] * a + w[1] * b for (k, a), b in zip(deltas(model, "math").items(),
                                                          deltas(model, "code").values())}
    report = add_merged_adapter(model, list(NAMES), method="task_arithmetic", scaling=1.0, weights=w,
                                new_name="sum")
    assert report["rank"] == 5  # the default: the sum of the input ranks, exact for a linear merge
    assert report["max_rel_error"] < 1e-12
    assert max_diff(deltas(model, "sum"), truth) < 1e-6


def test_peft_factor_level_linear_is_not_the_sum_of_updates():
    """peft's ``linear`` combines A and B separately: (sum sqrt(c) B)(sum sqrt(c) A) != sum c B A."""
    model = tiny_peft()
    truth = {k: a + b for (k, a), b in zip(deltas(model, "math").items(), deltas(model, "code").values())}
    model.add_weighted_adapter(list(NAMES), [1.0, 1.0], "lin", combination_type="linear")
    off = max(float((deltas(model, "lin")[k] - t).norm() / t.norm()) for k, t in truth.items())
    assert off > 0.3
    with pytest.raises(ValueError, match="combines the A and B factors separately"):
        add_merged_adapter(model, list(NAMES), method="magnitude_prune", density=0.5)


def test_unequal_ties_weights_elect_on_weighted_updates():
    """With unequal weights peft elects the sign on the unweighted trimmed updates; clmerge weights the
    updates first, so the two differ (documented), and clmerge equals TIES on the weighted updates."""
    model = tiny_peft()
    w = [1.0, 0.2]
    model.add_weighted_adapter(list(NAMES), w, "peft", combination_type="ties_svd", svd_rank=FULL,
                               density=0.5)
    add_merged_adapter(model, list(NAMES), method="ties_svd", weights=w, density=0.5, new_name="ours",
                       rank=FULL)
    base = {f"{k}.weight": torch.zeros_like(d) for k, d in deltas(model, "math").items()}
    experts = [{f"{k}.weight": wt * d for k, d in deltas(model, a).items()} for wt, a in zip(w, NAMES)]
    ref = merge("ties", base=base, experts=experts, density=0.5, scaling=1.0, trim_scope="per_tensor")
    ours = deltas(model, "ours")
    assert max(float((ours[k] - ref[f"{k}.weight"]).abs().max()) for k in ours) < 1e-5
    assert max_diff(ours, deltas(model, "peft")) > 1e-3


def test_same_as_the_adapter_folder_path(tmp_path):
    """add_merged_adapter is merge_adapters on the saved adapters: the same factors, bit for bit."""
    model = tiny_peft(ranks=(2, 3))
    model.save_pretrained(tmp_path / "saved")
    base = {k.replace(".base_layer.", "."): v for k, v in model.base_model.model.state_dict().items()
            if ".lora_" not in k}
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in base.items()}, str(tmp_path / "base.safetensors"))
    folders = [tmp_path / "saved" / n for n in NAMES]  # save_pretrained: one folder per named adapter
    rep_file = merge_adapters(method="ties", base=open_checkpoint(tmp_path / "base.safetensors"),
                              adapters=folders, hyperparameters={"density": 0.3}, out=tmp_path / "m", rank=4)
    rep_mem = add_merged_adapter(model, list(NAMES), method="ties", density=0.3, rank=4, new_name="m")
    assert rep_mem["per_module_rel_error"] == rep_file["per_module_rel_error"]
    from safetensors.torch import load_file
    written = load_file(tmp_path / "m" / "adapter_model.safetensors")
    for n, m in model.base_model.model.named_modules():
        if isinstance(m, LoraLayer):
            a = m.lora_embedding_A["m"] if "m" in m.lora_embedding_A else m.lora_A["m"].weight
            key = f"base_model.model.{n}.lora_embedding_A" if "m" in m.lora_embedding_A else \
                f"base_model.model.{n}.lora_A.weight"
            assert torch.equal(a.detach(), written[key])


# methods merging one expert into the base; methods that need per-expert statistics; cheap settings
ONE_ADAPTER = ("arcee_fusion", "nearswap", "slerp")
NEEDS_DATA = {"fisher_merging": "fishers", "regmean": "grams"}
QUICK = {"dop": {"num_steps": 3}, "wudi": {"steps": 3}}


@pytest.mark.parametrize("method", sorted(available()))
def test_every_method_is_the_same_merge_as_on_state_dicts(method):
    """Every registered method: the added adapter's Delta W (written without loss) is the method's merge of
    ``{base + Delta W_t}`` over the adapted weights, as ``merging.merge`` computes it on state dicts."""
    model = tiny_peft()
    names = list(NAMES[:1] if method in ONE_ADAPTER else NAMES)
    if method in NEEDS_DATA:
        with pytest.raises(ValueError, match=NEEDS_DATA[method]):
            add_merged_adapter(model, names, method=method)
        return
    quick = QUICK.get(method, {})
    report = add_merged_adapter(model, names, method=method, exact=True, new_name="x", **quick)
    assert report["max_rel_error"] < 1e-9
    base = {f"{n}.weight": m.get_base_layer().weight.detach().double()
            for n, m in model.base_model.model.named_modules() if isinstance(m, LoraLayer)}
    # the float64 updates the adapter path forms: the SVD merges (iso_c, tsv_m, opcm, ...) are not continuous
    # in their inputs when the updates' rank is below the matrix's, so peft's float32 ones would not do
    experts = [{f"{k}.weight": base[f"{k}.weight"] + d for k, d in deltas64(model, a).items()} for a in names]
    ref = merge(method, base=base, experts=experts, **quick)
    got = deltas(model, "x")
    for k, d in got.items():
        want = ref[f"{k}.weight"] - base[f"{k}.weight"]
        assert float((d - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max())), (method, k)


def test_exact_and_reported_loss():
    model = tiny_peft()
    low = add_merged_adapter(model, list(NAMES), method="ties", density=0.5, rank=2, new_name="r2")
    assert low["rank"] == 2 and low["max_rel_error"] > 0.1
    full = add_merged_adapter(model, list(NAMES), method="ties", density=0.5, exact=True, new_name="full")
    assert full["rank"] == FULL and full["max_rel_error"] < 1e-12
    cat = add_merged_adapter(model, list(NAMES), method="cat", weights=[1.0, 2.0], new_name="cat")
    assert cat["form"] == "factored" and cat["rank"] == 4 and cat["max_rel_error"] == 0.0


def test_method_with_its_own_weights_and_activation():
    model = tiny_peft()
    add_merged_adapter(model, list(NAMES), method="weight_average", weights=[3.0, 1.0], new_name="avg")
    ref = {k: 0.75 * a + 0.25 * b for (k, a), b in zip(deltas(model, "math").items(),
                                                         deltas(model, "code").values())}
    assert max_diff(deltas(model, "avg"), ref) < 1e-6
    x = torch.arange(6).reshape(2, 3)
    model.set_adapter("avg")
    with model.disable_adapter():
        y0 = model(x)
    with torch.no_grad():
        y = model(x)
    assert not torch.allclose(y, y0)


def test_gpt2_fan_in_fan_out_and_hf_model():
    """GPT-2's Conv1D (weights stored in x out): the same Delta W as peft's."""
    cfg = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = None
    for i, name in enumerate(NAMES):
        lc = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)
        if model is None:
            model = peft.get_peft_model(transformers.GPT2Model(cfg), lc, adapter_name=name)
        else:
            model.add_adapter(name, lc)
        _randomise(model, 20 + i, name)
    model.add_weighted_adapter(list(NAMES), [1.0, 0.5], "peft", combination_type="svd", svd_rank=4)
    rep = add_merged_adapter(model, list(NAMES), method="svd", weights=[1.0, 0.5], new_name="ours")
    assert rep["rank"] == 4 and rep["max_rel_error"] < 1e-12
    assert max_diff(deltas(model, "ours"), deltas(model, "peft")) < 1e-6


def test_refusals_are_one_line():
    model = tiny_peft()
    with pytest.raises(TypeError, match="expected a peft.PeftModel"):
        add_merged_adapter(Tiny(), ["math"], method="ties")
    with pytest.raises(ValueError, match="adapter 'bio' is not in the model"):
        add_merged_adapter(model, ["math", "bio"], method="ties")
    with pytest.raises(ValueError, match="'math': the model has an adapter of that name"):
        add_merged_adapter(model, list(NAMES), method="ties", new_name="math")
    with pytest.raises(ValueError, match="weights: need 2 finite numbers"):
        add_merged_adapter(model, list(NAMES), method="ties", weights=[1.0])
    with pytest.raises(ValueError, match="needs density="):
        add_merged_adapter(model, list(NAMES), method="ties_svd")
    with pytest.raises(TypeError, match="densty"):
        add_merged_adapter(model, list(NAMES), method="ties", densty=0.2)
    model.base_model.merge_adapter(["math"])
    with pytest.raises(MergeInputError, match="unmerge_adapter"):
        add_merged_adapter(model, list(NAMES), method="ties")
    model.base_model.unmerge_adapter()
    assert "merged" not in model.peft_config  # nothing was added by the refused calls


def _unloaded(model, adapter: str) -> dict[str, torch.Tensor]:
    """The weights of ``model`` with ``adapter`` folded in by peft's own ``merge_and_unload`` (float64)."""
    import copy

    m = copy.deepcopy(model)
    m.set_adapter(adapter)
    return {k: v.double() for k, v in m.merge_and_unload().state_dict().items()}


MERGED = [{}, {"use_dora": True}, {"modules_to_save": ["emb"]}, {"lora_bias": True}]
REFUSED = [{"init_lora_weights": "pissa"}]  # changes the base weights: not an update of the base


@pytest.mark.parametrize("variant", MERGED + REFUSED, ids=str)
def test_variants_merge_as_merge_and_unload_or_are_refused_naming_the_adapter(variant):
    """A variant the adapter-folder reader merges is merged as the weighted sum of what ``merge_and_unload``
    does to each weight (``exact=True``, so nothing is lost writing it back); one it refuses is refused in one
    line naming the adapter, not the temporary folder it was read from."""
    torch.manual_seed(0)
    model = None
    for i, name in enumerate(NAMES):
        cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["up", "down"], **variant)
        model = peft.get_peft_model(Tiny(), cfg, adapter_name=name) if model is None else model
        if i:
            model.add_adapter(name, cfg)
        _randomise(model, 30 + i, name)
    w = [1.0, 0.5]
    if variant in REFUSED:
        with pytest.raises(MergeInputError) as exc:
            add_merged_adapter(model, list(NAMES), method="task_arithmetic", weights=w, new_name="x")
        msg = str(exc.value)
        assert "\n" not in msg and msg.startswith("adapter 'math'") and "clmerge-adapters-" not in msg, msg
        assert "x" not in model.peft_config
        return
    add_merged_adapter(model, list(NAMES), method="task_arithmetic", scaling=1.0, weights=w, exact=True,
                       new_name="x")
    torch.manual_seed(0)
    base = {k: v.double() for k, v in Tiny().state_dict().items()}  # the weights get_peft_model wrapped
    states = [_unloaded(model, n) for n in NAMES]
    got = _unloaded(model, "x")
    assert got.keys() == base.keys()
    for k, v in got.items():
        want = base[k] + sum(wt * (st[k] - base[k]) for wt, st in zip(w, states))
        assert torch.allclose(v, want, atol=1e-5), (variant, k, float((v - want).abs().max()))


def tiny_llama(seed: int):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(cfg).eval()


def _perturbed(seed: int):
    g = torch.Generator().manual_seed(seed)
    out = tiny_llama(0)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    return out


def test_merge_models_equals_the_file_path(tmp_path):
    """merge_models on loaded HF models = merging.merge on their saved safetensors files, bit for bit."""
    base, e1, e2 = tiny_llama(0), _perturbed(1), _perturbed(2)
    before = {k: v.clone() for k, v in e1.state_dict().items()}
    got = merge_models(base, [e1, e2], method="ties", density=0.3)
    for name, m in (("base", base), ("e1", e1), ("e2", e2)):
        m.save_pretrained(tmp_path / name)
    ref = merge("ties", base=str(tmp_path / "base" / "model.safetensors"),
                experts=[str(tmp_path / n / "model.safetensors") for n in ("e1", "e2")], density=0.3)
    shared = set(ref)  # save_pretrained drops the tied lm_head
    assert shared <= set(got)
    for k in shared:
        assert torch.equal(got[k], ref[k]), k
    assert all(torch.equal(v, e1.state_dict()[k]) for k, v in before.items())  # inputs untouched


def test_merge_models_as_module_and_plain_modules():
    base, e1, e2 = nn.Linear(4, 3), nn.Linear(4, 3), nn.Linear(4, 3)
    merged = merge_models(base, [e1, e2], method="task_arithmetic", scaling=0.5, as_module=True)
    assert isinstance(merged, nn.Linear) and merged is not base
    want = base.weight + 0.5 * ((e1.weight - base.weight) + (e2.weight - base.weight))
    torch.testing.assert_close(merged.weight, want)
    sd = merge_models(None, [e1.state_dict(), e2], method="weight_average", weights=[1.0, 3.0])
    torch.testing.assert_close(sd["bias"], 0.25 * e1.bias + 0.75 * e2.bias)
    with pytest.raises(ValueError, match="non-empty list"):
        merge_models(base, e1, method="ties")


def test_device_path_is_the_cpu_path():
    """``device=``: the kernels and SVDs run on the device (here the CPU stand-in that refuses what a GPU
    refuses); the results equal the plain CPU path's."""
    model = tiny_peft()
    add_merged_adapter(model, list(NAMES), method="ties", density=0.5, new_name="on_cpu")
    dev = StrictCpuDevice()
    report = add_merged_adapter(model, list(NAMES), method="ties", density=0.5, new_name="dev", device=dev)
    assert dev.checked > 0 and "device" in report
    assert max_diff(deltas(model, "dev"), deltas(model, "on_cpu")) == 0.0
    base, e1, e2 = tiny_llama(0), _perturbed(1), _perturbed(2)
    ref = merge_models(base, [e1, e2], method="dare", drop_rate=0.3)
    got = merge_models(base, [e1, e2], method="dare", drop_rate=0.3, device=StrictCpuDevice())
    assert all(torch.equal(got[k], ref[k]) for k in ref)
