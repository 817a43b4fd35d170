import gzip
import struct

import numpy as np
import pytest

from clmerge.data import build_dataset
from clmerge.data.idx import find_idx_files, read_idx


def write_idx(path, arr, compress):
    header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(struct.pack(">I", d) for d in arr.shape)
    data = header + arr.astype(np.uint8).tobytes()
    (gzip.open if compress else open)(path, "wb").write(data)


def make_fmnist(root, n_train=20, n_test=10, compress=True):
    d = root / "fashion-mnist"
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    sfx = ".gz" if compress else ""
    write_idx(d / f"train-images-idx3-ubyte{sfx}", rng.integers(0, 255, (n_train, 28, 28)), compress)
    write_idx(d / f"train-labels-idx1-ubyte{sfx}", np.arange(n_train) % 10, compress)
    write_idx(d / f"t10k-images-idx3-ubyte{sfx}", rng.integers(0, 255, (n_test, 28, 28)), compress)
    write_idx(d / f"t10k-labels-idx1-ubyte{sfx}", np.arange(n_test) % 10, compress)
    return d


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
