import json

from clmerge.models import build_backbone
from clmerge.pretrain import pretrain_vit_tiny_fmnist
from clmerge.utils.io import sha256_file
from data_helpers import make_fmnist


def test_pretrain_writes_weights_and_provenance(tmp_path):
    make_fmnist(tmp_path / "data", n_train=64, n_test=16)
    prov = pretrain_vit_tiny_fmnist(tmp_path / "out", epochs=1, batch_size=32, warmup_steps=1,
                                    data_root=str(tmp_path / "data"), progress=False)
    out = tmp_path / "out"
    saved = json.loads((out / "provenance.json").read_text())
    assert saved == json.loads(json.dumps(prov))
    assert saved["sha256"] == sha256_file(out / "model.safetensors")
    assert saved["epochs"] == 1 and saved["seed"] == 0 and saved["data"]["train_images"] == 64
    assert 0 <= saved["test_accuracy"] <= 100
    bb = build_backbone("vit-tiny-fmnist", source=str(out))  # the written weights load into the preset
    assert bb.info["sha256"] == saved["sha256"]
    again = pretrain_vit_tiny_fmnist(tmp_path / "out2", epochs=1, batch_size=32, warmup_steps=1,
                                     data_root=str(tmp_path / "data"), progress=False)
    assert again["sha256"] == prov["sha256"]  # reproducible from the seed
