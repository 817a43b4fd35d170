"""Bottleneck adapters, SSF and VPT prompts on frozen transformer backbones (adapters.bottleneck)."""

import pytest
import torch
import transformers

from clmerge.adapters.bottleneck import (BottleneckAdapter, adapter_bank, adapter_sets, attach_adapters, attach_ssf,
                                         attach_vpt, only_adapters)
from clmerge.models.backbones import hf_vision_from_config
from clmerge.models.text import TextBackbone

VIT = dict(num_hidden_layers=3, hidden_size=32, num_attention_heads=2, intermediate_size=64, image_size=16,
           patch_size=4, num_channels=1)


def _vit():
    torch.manual_seed(0)
    return hf_vision_from_config("vit", VIT, mean=[0.5], std=[0.5]).eval()


def _bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32)
    return TextBackbone(transformers.BertModel(cfg, add_pooling_layer=False)).eval()


def _inputs(bb):
    g = torch.Generator().manual_seed(1)
    if isinstance(bb, TextBackbone):
        ids = torch.randint(0, 50, (3, 1, 7), generator=g)
        return torch.cat([ids, torch.ones_like(ids)], 1)
    return torch.rand(3, 1, 16, 16, generator=g)


def _perturb(aset, seed=2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in aset.parameters():
            p.add_(torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("make", [_vit, _bert])
def test_zero_init_adapter_is_bit_identical(make):
    bb = make()
    x = _inputs(bb)
    plain = bb(x)
    aset = attach_adapters(bb, bottleneck=4, scale=0.1)
    assert len(aset.modules()) == len(aset.layers) == adapter_bank(bb).num_layers
    assert torch.equal(bb(x), plain)
    _perturb(aset)  # the hooks do act: a trained adapter changes the features
    assert not torch.allclose(bb(x), plain)


@pytest.mark.parametrize("make", [_vit, _bert])
def test_disabled_set_gives_the_pretrained_features(make):
    bb = make()
    x = _inputs(bb)
    plain = bb(x)
    aset = attach_adapters(bb, bottleneck=4)
    _perturb(aset)
    aset.enabled = False
    assert torch.equal(bb(x), plain)
    aset.enabled = True
    with only_adapters(bb, []):
        assert torch.equal(bb(x), plain)
    assert aset.enabled and not torch.allclose(bb(x), plain)


def test_adapter_is_added_in_parallel_to_the_mlp():
    """Block output = x + mlp(LN(x)) + a(x) with x the MLP branch's input (PILOT ffn_option='parallel')."""
    bb = _vit()
    aset = attach_adapters(bb, bottleneck=4, layers=[1])
    _perturb(aset)
    blk = bb.inner.layers[1]
    seen = {}
    blk.layernorm_after.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
    blk.register_forward_hook(lambda m, a, out: seen.setdefault("out", out))
    bb(_inputs(bb))
    x = seen["x"]
    with torch.no_grad(), only_adapters(bb, []):  # the MLP alone (its own hook adds nothing)
        want = x + blk.mlp(blk.layernorm_after(x)) + aset.modules()[0](x)
    torch.testing.assert_close(seen["out"], want)


def test_gradient_reaches_only_the_adapters():
    bb = _vit()
    bb.requires_grad_(False)
    aset = attach_adapters(bb, bottleneck=4, dropout=0.0)
    bb.train()
    bb(_inputs(bb)).pow(2).sum().backward()
    ids = {id(p) for p in aset.parameters()}
    with_grad = [n for n, p in bb.named_parameters() if p.grad is not None]
    assert with_grad and all(id(dict(bb.named_parameters())[n]) in ids for n in with_grad)
    assert all(p.grad is not None for p in aset.parameters())


def test_two_named_sets_switch():
    bb = _vit()
    x = _inputs(bb)
    a = attach_adapters(bb, bottleneck=4, name="task0")
    b = attach_adapters(bb, bottleneck=4, name="task1")
    _perturb(a, 2)
    _perturb(b, 3)
    assert list(adapter_sets(bb)) == ["task0", "task1"]
    with only_adapters(bb, ["task0"]):
        fa = bb(x)
    with only_adapters(bb, ["task1"]):
        fb = bb(x)
    b.enabled = False
    assert torch.equal(bb(x), fa)
    a.enabled, b.enabled = False, True
    assert torch.equal(bb(x), fb)
    assert not torch.allclose(fa, fb)
    with pytest.raises(ValueError, match="no set named"):
        with only_adapters(bb, ["task9"]):
            pass


def test_adapter_sets_rebuild_from_structure_and_state_dict():
    bb = _vit()
    x = _inputs(bb)
    a = attach_adapters(bb, bottleneck=4, name="t0", layers=[0, 2])
    _perturb(a)
    a.enabled = False
    attach_adapters(bb, bottleneck=3, name="t1", scale=0.5)
    structure, state = adapter_bank(bb).get_structure(), bb.state_dict()
    fresh = _vit()
    adapter_bank(fresh).set_structure(structure)
    fresh.load_state_dict(state, strict=True)
    assert torch.equal(fresh(x), bb(x))
    assert adapter_sets(fresh)["t0"].layers == [0, 2] and not adapter_sets(fresh)["t0"].enabled


def test_adapter_init_matches_adaptformer():
    ad = BottleneckAdapter(8, 3, scale=0.1, generator=torch.Generator().manual_seed(0))
    assert ad.up.weight.abs().sum() == 0 and ad.up.bias.abs().sum() == 0 and ad.down.bias.abs().sum() == 0
    assert ad.down.weight.abs().max() <= (6 / (6 * 8)) ** 0.5 and ad.down.weight.std() > 0


def test_ssf_identity_then_scale_and_shift():
    bb = _vit()
    x = _inputs(bb)
    plain = bb(x)
    ssf = attach_ssf(bb, std=0.0)
    assert torch.equal(bb(x), plain)
    with torch.no_grad():
        ssf.ssf["layernorm"].scale.mul_(2.0)  # the final LayerNorm: the feature doubles exactly
    torch.testing.assert_close(bb(x), 2 * plain)
    ssf.enabled = False
    assert torch.equal(bb(x), plain)


def _reference_vpt_deep(bb, prompts, x):
    """VPT-deep as the paper writes it: append block l's prompts to its input, drop their outputs after it."""
    inner = bb.inner
    h = inner.embeddings(bb.preprocess(x))
    for layer, p in zip(inner.layers, prompts):
        n = h.shape[1]
        h = layer(torch.cat([h, p.expand(len(h), -1, -1)], 1), None)[:, :n]
    return inner.layernorm(h)[:, 0]


def test_vpt_deep_equals_per_block_prompt_tokens():
    bb = _vit()
    x = _inputs(bb)
    plain = bb(x)
    vpt = attach_vpt(bb, n_tokens=2, deep=True, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = _reference_vpt_deep(bb, vpt.prompts, x)
        got = bb(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, plain)
    vpt.enabled = False
    assert torch.equal(bb(x), plain)


def test_vpt_shallow_prompts_train_and_backbone_does_not():
    bb = _vit()
    bb.requires_grad_(False)
    vpt = attach_vpt(bb, n_tokens=2, deep=False)
    assert vpt.prompts.shape == (1, 2, 32)
    bb(_inputs(bb)).sum().backward()
    assert vpt.prompts.grad is not None and vpt.prompts.grad.abs().sum() > 0
    assert all(p.grad is None for n, p in bb.named_parameters() if not n.startswith("vpt."))
