import pytest
import torch
from transformers import ViTConfig, ViTModel

from clmerge.models import build_backbone
from clmerge.models.checkpoint_keys import load_vit_weights, vit_checkpoint_filter
from conftest import TINY_VIT


def test_old_transformers_checkpoint_keys_load():
    cfg = ViTConfig(image_size=28, patch_size=4, num_channels=1, **TINY_VIT)
    src = ViTModel(cfg, add_pooling_layer=False)
    old = {}
    for k, v in src.state_dict().items():  # rename to the pre-5.0 layout, with a "vit." prefix
        k = (k.replace("layers.0.attention.q_proj", "encoder.layer.0.attention.attention.query")
             .replace("layers.0.attention.k_proj", "encoder.layer.0.attention.attention.key")
             .replace("layers.0.attention.v_proj", "encoder.layer.0.attention.attention.value")
             .replace("layers.0.attention.o_proj", "encoder.layer.0.attention.output.dense")
             .replace("layers.0.mlp.fc1", "encoder.layer.0.intermediate.dense")
             .replace("layers.0.mlp.fc2", "encoder.layer.0.output.dense")
             .replace("layers.0.layernorm", "encoder.layer.0.layernorm"))
        old["vit." + k] = v
    old["classifier.weight"] = torch.zeros(3, 32)
    dst = ViTModel(cfg, add_pooling_layer=False)
    load_vit_weights(dst, old, source="old.safetensors")
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v)
    assert set(vit_checkpoint_filter(src.state_dict(), dst)) == set(dst.state_dict())


def test_weight_mismatch_is_a_clear_error():
    cfg = ViTConfig(image_size=28, patch_size=4, num_channels=1, **TINY_VIT)
    m = ViTModel(cfg, add_pooling_layer=False)
    sd = m.state_dict()
    sd.pop("layernorm.weight")
    with pytest.raises(ValueError, match="missing.*layernorm.weight"):
        load_vit_weights(ViTModel(cfg, add_pooling_layer=False), sd, source="x")


def test_backbone_input_adaptation():
    bb = build_backbone("vit-tiny-fmnist", pretrained=False, config=TINY_VIT)
    assert bb(torch.rand(2, 1, 8, 8)).shape == (2, 32)  # digits are resized to 28x28
    assert bb(torch.rand(2, 3, 28, 28)).shape == (2, 32)  # RGB averaged to one channel
    clip = build_backbone("hf-clip-vision", pretrained=False,
                          config=dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, intermediate_size=64))
    assert clip(torch.rand(2, 1, 28, 28)).shape == (2, 32)  # gray -> 3 channels, resized to 32


def test_vit_b16_builds_from_config_and_hub_load_fails_offline(tmp_path):
    bb = build_backbone("vit-b16", pretrained=False, config={"num_hidden_layers": 1})
    assert bb.image_size == 224 and bb.feature_dim == 768
    with pytest.raises(Exception):
        build_backbone("hf-vit", source=str(tmp_path / "no-such-model"))
    with pytest.raises(ValueError, match="did you mean 'vit-b16'"):
        build_backbone("vit-b61")


def test_local_directory_load_round_trip(tmp_path):
    cfg = ViTConfig(image_size=28, patch_size=4, num_channels=1, **TINY_VIT)
    ViTModel(cfg, add_pooling_layer=False).save_pretrained(tmp_path / "m")
    bb = build_backbone("hf-vit", source=str(tmp_path / "m"))
    assert bb(torch.rand(1, 1, 28, 28)).shape == (1, 32)


def test_tiny_preset_rejects_overrides_with_weights():
    with pytest.raises(ValueError, match="pretrained: false"):
        build_backbone("vit-tiny-fmnist", pretrained=True, config={"num_hidden_layers": 1})
