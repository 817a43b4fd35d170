import struct

import numpy as np
import pytest

from data_helpers import make_fmnist, write_idx

from clmerge.data import build_dataset
from clmerge.data.idx import find_idx_files, read_idx


@pytest.mark.parametrize("compress", [True, False])
def test_fashion_mnist_from_generated_files(tmp_path, compress):
    make_fmnist(tmp_path, compress=compress)
    d = build_dataset("fashion_mnist", data_root=str(tmp_path))
    assert len(d.train) == 20 and len(d.test) == 10
    x, y = d.train.get_batch([0, 11])
    assert x.shape == (2, 1, 28, 28) and y.tolist() == [0, 1]


def test_env_var_location(tmp_path, monkeypatch):
    make_fmnist(tmp_path)
    monkeypatch.setenv("CLMERGE_DATA", str(tmp_path))
    assert len(build_dataset("fashion_mnist").train) == 20


def test_missing_files_message(tmp_path, monkeypatch):
    monkeypatch.setattr("clmerge.data.idx.DEBIAN_DATASET_DIR", tmp_path / "nowhere")
    monkeypatch.delenv("CLMERGE_DATA", raising=False)
    with pytest.raises(FileNotFoundError) as exc:
        build_dataset("fashion_mnist", data_root=str(tmp_path))
    msg = str(exc.value)
    assert "train-images-idx3-ubyte" in msg and str(tmp_path) in msg and "apt-get install dataset-fashion-mnist" in msg
    with pytest.raises(FileNotFoundError):
        find_idx_files("fashion-mnist", ["x"], data_root=str(tmp_path))


def test_corrupt_files(tmp_path):
    bad = tmp_path / "bad.gz"
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="bad.gz"):
        read_idx(bad)
    magic = tmp_path / "magic"
    magic.write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="bad magic"):
        read_idx(magic)
    short = tmp_path / "short"
    short.write_bytes(bytes([0, 0, 8, 1]) + struct.pack(">I", 10) + b"\x00" * 3)
    with pytest.raises(ValueError, match="payload has 3 bytes"):
        read_idx(short)
