"""Tests of the on-disk sources (clmerge.data.folders, clmerge.data.cifar) on tiny look-alike files."""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

import clmerge.data.cifar as cifar
import clmerge.data.cub as cub
import clmerge.data.domainnet as domainnet
import clmerge.data.folders as folders
import clmerge.data.imagenet as imagenet
from clmerge.data.base import DATASETS, build_dataset

WNIDS = ["n01443537", "n01484850", "n01494475"]


# ----------------------------------------------------------------------------------------------- helpers


def _img(path: Path, value: int = 128, size: int = 8) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = np.full((size, size + 2, 3), value, dtype=np.uint8)
    arr[0, 0] = (255, 0, 0)
    Image.fromarray(arr).save(path)
    return path


def _class_tree(root: Path, classes: list[str], n: int, ext: str = "png") -> None:
    for c, name in enumerate(classes):
        for i in range(n):
            _img(root / name / f"img_{i:02d}.{ext}", value=10 * c + i)


def _listing(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def _check_batch(data, image_size: int = 16, channels: int = 3) -> None:
    x, y = data.get_batch(np.arange(min(3, len(data))))
    assert x.shape == (min(3, len(data)), channels, image_size, image_size)
    assert x.dtype == torch.float32 and y.dtype == torch.long
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0


def _check_split(splits) -> None:
    train, test = set(splits.train.paths), set(splits.test.paths)
    assert not train & test


# ----------------------------------------------------------------------------------------------- common


def test_all_builders_registered():
    for name in ("image_folder", "imagenet_r", "imagenet_a", "domainnet", "cub200", "cifar100"):
        assert name in DATASETS and DATASETS[name][1]


def test_resolve_data_root(monkeypatch, tmp_path):
    monkeypatch.delenv("CLMERGE_DATA", raising=False)
    assert folders.resolve_data_root(None) == Path("./data")
    monkeypatch.setenv("CLMERGE_DATA", str(tmp_path))
    assert folders.resolve_data_root(None) == tmp_path
    assert folders.resolve_data_root(tmp_path / "x") == tmp_path / "x"


def test_env_var_used_by_builder(monkeypatch, tmp_path):
    _class_tree(tmp_path / "train", ["a", "b"], 2)
    _class_tree(tmp_path / "test", ["a", "b"], 1)
    monkeypatch.setenv("CLMERGE_DATA", str(tmp_path))
    assert len(build_dataset("image_folder", image_size=16).train) == 4


def test_a_data_option_of_the_wrong_type_is_a_usage_error_naming_it(tmp_path):
    """A YAML value of the wrong type (``subdir: 5``) is refused by name, not a TypeError in the builder
    (it was ``unsupported operand type(s) for /: 'PosixPath' and 'int'``); a Python Path still works."""
    from clmerge.errors import UsageError

    _class_tree(tmp_path / "d" / "train", ["a", "b"], 2)
    _class_tree(tmp_path / "d" / "test", ["a", "b"], 1)
    with pytest.raises(UsageError, match="image_folder: data option 'subdir'.*string.*got 5"):
        build_dataset("image_folder", data_root=str(tmp_path), image_size=16, subdir=5)
    with pytest.raises(UsageError, match="'test_fraction'"):
        build_dataset("image_folder", data_root=str(tmp_path), image_size=16, test_fraction="lots")
    assert len(build_dataset("image_folder", data_root=tmp_path, image_size=16, subdir="d").train) == 4


# ----------------------------------------------------------------------------------------------- image_folder


def test_image_folder_presplit(tmp_path):
    _class_tree(tmp_path / "train", ["dog", "cat"], 3)
    _class_tree(tmp_path / "test", ["dog", "cat"], 2, ext="jpg")
    (tmp_path / "train" / "cat" / "notes.txt").write_text("not an image")
    s = folders.image_folder(data_root=str(tmp_path), image_size=16)
    assert s.class_names == ["cat", "dog"]
    assert len(s.train) == 6 and len(s.test) == 4 and s.num_classes == 2
    assert s.train.targets.tolist() == [0, 0, 0, 1, 1, 1]
    assert all(p.parent.name == s.class_names[t] for p, t in zip(s.test.paths, s.test.targets, strict=True))
    assert s.fingerprint["n_train"] == 6 and s.fingerprint["n_test"] == 4
    _check_batch(s.train)
    _check_batch(s.test)
    x, y = s.test[0]
    assert x.shape == (3, 16, 16) and y == 0


def test_image_folder_original_size(tmp_path):
    _class_tree(tmp_path / "train", ["a"], 2)
    _class_tree(tmp_path / "test", ["a"], 1)
    x, _ = folders.image_folder(data_root=tmp_path, image_size=None).train.get_batch([0, 1])
    assert x.shape == (2, 3, 8, 10)


def test_image_folder_class_mismatch(tmp_path):
    _class_tree(tmp_path / "train", ["a", "b"], 2)
    _class_tree(tmp_path / "test", ["a", "c"], 1)
    with pytest.raises(
        ValueError, match="same class folders.*only in train: \\['b'\\].*only in test: \\['c'\\]"
    ):
        folders.image_folder(data_root=tmp_path)


def test_image_folder_unsplit_is_deterministic_and_nondestructive(tmp_path):
    _class_tree(tmp_path, ["a", "b", "c"], 10)
    before = _listing(tmp_path)
    s1 = folders.image_folder(data_root=tmp_path, image_size=16, seed=3)
    s2 = folders.image_folder(data_root=tmp_path, image_size=16, seed=3)
    s3 = folders.image_folder(data_root=tmp_path, image_size=16, seed=4)
    assert _listing(tmp_path) == before
    assert s1.train.paths == s2.train.paths and s1.test.paths == s2.test.paths
    assert s1.test.paths != s3.test.paths
    _check_split(s1)
    assert len(s1.train) + len(s1.test) == 30 and len(s1.test) == 6
    assert np.bincount(s1.test.targets).tolist() == [2, 2, 2]
    assert set(s1.train.paths) | set(s1.test.paths) == set(tmp_path.rglob("*.png"))
    assert s1.fingerprint["seed"] == 3 and "seeded" in s1.fingerprint["layout"]
    s4 = folders.image_folder(data_root=tmp_path, image_size=16, seed=3, test_fraction=0.5)
    assert len(s4.test) == 15
    s5 = folders.image_folder(data_root=tmp_path, image_size=16, seed=99, split_seed=3)
    assert s5.test.paths == s1.test.paths


def test_split_per_class_small_classes():
    files = {"one": [Path("x")], "two": [Path("a"), Path("b")]}
    train, test = folders.split_per_class(files, 0.2, seed=0)
    assert train["one"] == [Path("x")] and test["one"] == []
    assert len(train["two"]) == 1 and len(test["two"]) == 1
    with pytest.raises(ValueError, match="test_fraction"):
        folders.split_per_class(files, 1.0, seed=0)


def test_image_folder_errors(tmp_path):
    with pytest.raises(
        FileNotFoundError, match="(?s)image_folder.*looked for class folders under .*Accepted layouts"
    ):
        folders.image_folder(data_root=tmp_path / "nowhere")
    _class_tree(tmp_path / "only" / "train", ["a"], 2)
    with pytest.raises(FileNotFoundError, match="but not .*test"):
        folders.image_folder(data_root=tmp_path / "only")
    (tmp_path / "empty" / "a").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="image files"):
        folders.image_folder(data_root=tmp_path / "empty")
    _class_tree(tmp_path / "ok", ["a"], 3)
    with pytest.raises(ValueError, match="unknown option.*bogus"):
        folders.image_folder(data_root=tmp_path / "ok", bogus=1)
    with pytest.raises(ValueError, match="test_fraction"):
        folders.image_folder(data_root=tmp_path / "ok", test_fraction=0.0)


def test_corrupt_image_is_named(tmp_path):
    _class_tree(tmp_path / "train", ["a"], 1)
    _class_tree(tmp_path / "test", ["a"], 1)
    bad = tmp_path / "train" / "a" / "zz_broken.jpg"
    bad.write_bytes(b"this is not a jpeg")
    s = folders.image_folder(data_root=tmp_path, image_size=16)
    with pytest.raises(ValueError, match="zz_broken.jpg"):
        s.train.get_batch([0, 1])


def test_image_folder_subdir(tmp_path):
    _class_tree(tmp_path / "mine" / "train", ["a"], 2)
    _class_tree(tmp_path / "mine" / "test", ["a"], 1)
    assert len(folders.image_folder(data_root=tmp_path, subdir="mine").train) == 2


# ------------------------------------------------------------------------------------------- ImageNet-R / -A


def _raw_berkeley(folder: Path, n: int = 5) -> None:
    _class_tree(folder, WNIDS, n, ext="jpg")
    (folder / "README.txt").write_text("ImageNet-R")


def test_imagenet_r_presplit(tmp_path):
    _class_tree(tmp_path / "imagenet-r" / "train", WNIDS, 3, ext="jpg")
    _class_tree(tmp_path / "imagenet-r" / "test", WNIDS, 1, ext="jpg")
    s = imagenet.imagenet_r(data_root=tmp_path, image_size=16)
    assert "pre-split" in s.fingerprint["layout"]
    assert s.class_names == WNIDS and len(s.train) == 9 and len(s.test) == 3
    assert s.test.targets.tolist() == [0, 1, 2]
    _check_batch(s.train)


def test_imagenet_r_presplit_preferred_over_yaml(tmp_path):
    _class_tree(tmp_path / "imagenet-r" / "train", WNIDS, 2, ext="jpg")
    _class_tree(tmp_path / "imagenet-r" / "test", WNIDS, 1, ext="jpg")
    (tmp_path / "imagenet-r_train.yaml").write_text("data: []\ntargets: []\n")
    (tmp_path / "imagenet-r_test.yaml").write_text("data: []\ntargets: []\n")
    assert "pre-split" in imagenet.imagenet_r(data_root=tmp_path).fingerprint["layout"]


def _coda_yaml(where: Path, folder: Path) -> tuple[list, list]:
    train = {"data": [], "targets": []}
    test = {"data": [], "targets": []}
    for label, wnid in enumerate(WNIDS):
        for i, f in enumerate(sorted((folder / wnid).iterdir())):
            part = test if i == 0 else train
            part["data"].append(f"data/imagenet-r/{wnid}/{f.name}")
            part["targets"].append(2 - label)  # deliberately not the sorted-folder order
    (where / "imagenet-r_train.yaml").write_text(yaml.safe_dump(train))
    (where / "imagenet-r_test.yaml").write_text(yaml.safe_dump(test))
    return train, test


@pytest.mark.parametrize("yaml_in_folder", [True, False])
def test_imagenet_r_coda_yaml(tmp_path, yaml_in_folder):
    folder = tmp_path / "imagenet-r"
    _raw_berkeley(folder, n=4)
    train, test = _coda_yaml(folder if yaml_in_folder else tmp_path, folder)
    s = imagenet.imagenet_r(data_root=tmp_path, image_size=16)
    assert "yaml" in s.fingerprint["layout"]
    assert len(s.train) == 9 and len(s.test) == 3
    assert s.train.targets.tolist() == train["targets"] and s.test.targets.tolist() == test["targets"]
    assert s.train.paths[0] == folder / WNIDS[0] / "img_01.jpg"
    assert s.class_names == WNIDS[::-1]
    sha = s.fingerprint["split_files"]["imagenet-r_train.yaml"]
    yml = (folder if yaml_in_folder else tmp_path) / "imagenet-r_train.yaml"
    assert sha == hashlib.sha256(yml.read_bytes()).hexdigest()
    _check_split(s)
    _check_batch(s.test)


def test_imagenet_r_bad_yaml(tmp_path):
    folder = tmp_path / "imagenet-r"
    _raw_berkeley(folder, n=2)
    (folder / "imagenet-r_train.yaml").write_text("data: [a.jpg, b.jpg]\ntargets: [0]\n")
    (folder / "imagenet-r_test.yaml").write_text("data: [a.jpg]\ntargets: [0]\n")
    with pytest.raises(ValueError, match="imagenet-r_train.yaml.*2 entries in 'data' but 1"):
        imagenet.imagenet_r(data_root=tmp_path)
    (folder / "imagenet-r_train.yaml").write_text("data: [a.jpg\n")
    with pytest.raises(ValueError, match="imagenet-r_train.yaml: not valid YAML"):
        imagenet.imagenet_r(data_root=tmp_path)
    (folder / "imagenet-r_train.yaml").write_text("data: [a.jpg]\ntargets: [x]\n")
    with pytest.raises(ValueError, match="targets\\[0\\]"):
        imagenet.imagenet_r(data_root=tmp_path)
    (folder / "imagenet-r_test.yaml").unlink()
    with pytest.raises(FileNotFoundError, match="imagenet-r_test.yaml"):
        imagenet.imagenet_r(data_root=tmp_path)


def test_imagenet_r_yaml_paths_missing(tmp_path):
    folder = tmp_path / "imagenet-r"
    _raw_berkeley(folder, n=2)
    (folder / "imagenet-r_train.yaml").write_text("data: [data/imagenet-r/n0/gone.jpg]\ntargets: [0]\n")
    (folder / "imagenet-r_test.yaml").write_text("data: [data/imagenet-r/n0/gone.jpg]\ntargets: [0]\n")
    with pytest.raises(FileNotFoundError, match="gone.jpg"):
        imagenet.imagenet_r(data_root=tmp_path)


def test_imagenet_r_raw_split(tmp_path):
    folder = tmp_path / "imagenet-r"
    _raw_berkeley(folder, n=10)
    before = _listing(tmp_path)
    s = imagenet.imagenet_r(data_root=tmp_path, image_size=16, seed=1)
    again = imagenet.imagenet_r(data_root=tmp_path, image_size=16, seed=1)
    assert _listing(tmp_path) == before
    assert "raw folder, seeded" in s.fingerprint["layout"]
    assert s.class_names == WNIDS and len(s.train) == 24 and len(s.test) == 6
    assert s.test.paths == again.test.paths
    assert set(s.train.paths) | set(s.test.paths) == set(folder.rglob("*.jpg"))
    _check_split(s)
    _check_batch(s.train)


def test_imagenet_r_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="(?s)imagenet_r.*imagenet-r.*imagenet-r.tar.*Accepted layouts"):
        imagenet.imagenet_r(data_root=tmp_path)
    (tmp_path / "imagenet-r").mkdir()
    with pytest.raises(FileNotFoundError, match="CODA-Prompt"):
        imagenet.imagenet_r(data_root=tmp_path)


def test_imagenet_a_layouts(tmp_path):
    pre = tmp_path / "pre" / "imagenet-a"
    _class_tree(pre / "train", WNIDS, 2, ext="jpg")
    _class_tree(pre / "test", WNIDS, 1, ext="jpg")
    s = imagenet.imagenet_a(data_root=tmp_path / "pre", image_size=16)
    assert "pre-split" in s.fingerprint["layout"] and len(s.train) == 6 and s.class_names == WNIDS
    _raw_berkeley(tmp_path / "raw" / "imagenet-a", n=5)
    s = imagenet.imagenet_a(data_root=tmp_path / "raw", image_size=16, seed=0)
    assert "raw" in s.fingerprint["layout"] and len(s.train) == 12 and len(s.test) == 3
    _check_split(s)
    _check_batch(s.test)
    with pytest.raises(FileNotFoundError, match="(?s)imagenet_a.*imagenet-a.tar"):
        imagenet.imagenet_a(data_root=tmp_path / "none")


# ----------------------------------------------------------------------------------------------- DomainNet


def _domainnet(root: Path, dirname: str = "domainnet") -> Path:
    folder = root / dirname
    classes = ["aircraft_carrier", "zebra"]
    for domain in ("clipart", "sketch"):
        for split, n in (("train", 2), ("test", 1)):
            lines = []
            for label, cls in enumerate(classes):
                for i in range(n):
                    rel = f"{domain}/{cls}/{domain}_{split}_{i}.jpg"
                    _img(folder / rel, value=50 * label + i)
                    lines.append(f"{rel} {label}")
            (folder / f"{domain}_{split}.txt").write_text("\n".join(lines) + "\n")
    return folder


def test_domainnet(tmp_path):
    folder = _domainnet(tmp_path)
    s = domainnet.domainnet(data_root=tmp_path, image_size=16, domains=["clipart", "sketch"])
    assert len(s.train) == 8 and len(s.test) == 4
    assert s.train.targets.tolist() == [0, 0, 1, 1] * 2
    assert s.class_names == ["aircraft_carrier", "zebra"]
    assert s.train.paths[0] == folder / "clipart/aircraft_carrier/clipart_train_0.jpg"
    assert set(s.fingerprint["split_files"]) == {
        f"{d}_{p}.txt" for d in ("clipart", "sketch") for p in ("train", "test")
    }
    _check_batch(s.train)
    one = domainnet.domainnet(data_root=tmp_path, image_size=16, domains="sketch")
    assert len(one.train) == 4 and all("sketch" in p.name for p in one.train.paths)


def test_domainnet_capitalised_dir(tmp_path):
    _domainnet(tmp_path, "DomainNet")
    assert len(domainnet.domainnet(data_root=tmp_path, domains=["clipart"]).test) == 2


def test_domainnet_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="(?s)domainnet.*DomainNet.*M3SDA"):
        domainnet.domainnet(data_root=tmp_path)
    folder = _domainnet(tmp_path)
    with pytest.raises(
        FileNotFoundError, match="(?s)infograph_train.txt, .*infograph_test.txt, .*real_test.txt .*Accepted"
    ):
        domainnet.domainnet(data_root=tmp_path)  # default: all six domains
    with pytest.raises(ValueError, match="unknown domain.*photo"):
        domainnet.domainnet(data_root=tmp_path, domains=["photo"])
    (folder / "clipart_test.txt").write_text("clipart/zebra/clipart_test_0.jpg 1\nclipart/zebra/x.jpg one\n")
    with pytest.raises(ValueError, match="clipart_test.txt, line 2: malformed"):
        domainnet.domainnet(data_root=tmp_path, domains=["clipart"])
    (folder / "clipart_test.txt").write_text("just_a_path.jpg\n")
    with pytest.raises(ValueError, match="line 1"):
        domainnet.domainnet(data_root=tmp_path, domains=["clipart"])


# ----------------------------------------------------------------------------------------------- CUB-200-2011


def _cub(root: Path, classes_txt: bool = True) -> Path:
    folder = root / "CUB_200_2011"
    classes = ["001.Black_footed_Albatross", "002.Laysan_Albatross"]
    images, labels, split = [], [], []
    k = 0
    for c, cls in enumerate(classes):
        for i in range(3):
            k += 1
            rel = f"{cls}/{cls.split('.')[1]}_{i}.jpg"
            _img(folder / "images" / rel, value=40 * c + i)
            images.append(f"{k} {rel}")
            labels.append(f"{k} {c + 1}")
            split.append(f"{k} {int(i < 2)}")
    (folder / "images.txt").write_text("\n".join(images) + "\n")
    (folder / "image_class_labels.txt").write_text("\n".join(labels) + "\n")
    (folder / "train_test_split.txt").write_text("\n".join(split) + "\n")
    if classes_txt:
        (folder / "classes.txt").write_text("".join(f"{i + 1} {c}\n" for i, c in enumerate(classes)))
    return folder


@pytest.mark.parametrize("classes_txt", [True, False])
def test_cub200(tmp_path, classes_txt):
    _cub(tmp_path, classes_txt)
    s = cub.cub200(data_root=tmp_path, image_size=16)
    assert len(s.train) == 4 and len(s.test) == 2
    assert s.train.targets.tolist() == [0, 0, 1, 1] and s.test.targets.tolist() == [0, 1]
    assert s.class_names == ["Black_footed_Albatross", "Laysan_Albatross"]
    assert set(s.fingerprint["split_files"]) == {
        "images.txt",
        "image_class_labels.txt",
        "train_test_split.txt",
    }
    _check_batch(s.test)


def test_cub200_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="(?s)cub200.*images.txt.*CUB_200_2011.tgz"):
        cub.cub200(data_root=tmp_path)
    folder = _cub(tmp_path)
    (folder / "train_test_split.txt").write_text("1 1\n2 yes\n")
    with pytest.raises(ValueError, match="train_test_split.txt, line 2"):
        cub.cub200(data_root=tmp_path)
    (folder / "train_test_split.txt").write_text("1 1\n2 1\n")
    with pytest.raises(ValueError, match="train_test_split.txt has no entry for image id"):
        cub.cub200(data_root=tmp_path)
    (folder / "image_class_labels.txt").write_text("1 0\n")
    with pytest.raises(ValueError, match="image_class_labels.txt, line 1.*1-based"):
        cub.cub200(data_root=tmp_path)


# ----------------------------------------------------------------------------------------------- CIFAR-100


def _cifar(root: Path, n_train: int = 6, n_test: int = 4, protocol: int = pickle.HIGHEST_PROTOCOL) -> Path:
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, n in (("train", n_train), ("test", n_test)):
        d = {
            b"filenames": [f"img{i}.png".encode() for i in range(n)],
            b"fine_labels": [(7 * i) % 100 for i in range(n)],
            b"coarse_labels": [i % 20 for i in range(n)],
            b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
        }
        with open(folder / name, "wb") as fh:
            pickle.dump(d, fh, protocol=protocol)
    meta = {
        b"fine_label_names": [f"fine{i}".encode() for i in range(100)],
        b"coarse_label_names": [f"coarse{i}".encode() for i in range(20)],
    }
    with open(folder / "meta", "wb") as fh:
        pickle.dump(meta, fh, protocol=protocol)
    return folder


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_cifar100_fine(tmp_path, protocol):
    folder = _cifar(tmp_path, protocol=protocol)
    s = cifar.cifar100(data_root=tmp_path)
    assert len(s.train) == 6 and len(s.test) == 4
    assert s.train.targets.tolist() == [0, 7, 14, 21, 28, 35]
    assert s.class_names[:2] == ["fine0", "fine1"] and len(s.class_names) == 100
    assert s.train.images.dtype == torch.uint8 and s.train.images.shape == (6, 3, 32, 32)
    raw = pickle.loads((folder / "train").read_bytes())[b"data"]
    assert torch.equal(s.train.images[1, 2].flatten(), torch.from_numpy(raw[1, 2048:]))
    x, y = s.test.get_batch([0, 3])
    assert x.shape == (2, 3, 32, 32) and 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    assert s.fingerprint["layout"] == "cifar-100-python" and set(s.fingerprint["files"]) == {
        "train",
        "test",
        "meta",
    }


def test_cifar100_coarse(tmp_path):
    _cifar(tmp_path)
    s = build_dataset("cifar100", data_root=str(tmp_path), label_kind="coarse")
    assert s.train.targets.tolist() == [0, 1, 2, 3, 4, 5]
    assert len(s.class_names) == 20 and s.class_names[0] == "coarse0"
    with pytest.raises(ValueError, match="label_kind"):
        cifar.cifar100(data_root=tmp_path, label_kind="medium")


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_cifar100_refuses_malicious_pickle(tmp_path):
    folder = _cifar(tmp_path)
    marker = tmp_path / "pwned"
    with open(folder / "train", "wb") as fh:
        pickle.dump({b"data": _Evil(marker), b"fine_labels": []}, fh)
    with pytest.raises(
        ValueError, match=r"train: refusing to unpickle forbidden global (posix|nt|os)\.system"
    ):
        cifar.cifar100(data_root=tmp_path)
    assert not marker.exists()


def test_cifar100_refuses_codecs_other_than_latin1(tmp_path):
    import _codecs

    class Sneaky:
        def __reduce__(self):
            return (_codecs.encode, ("abc", "rot13"))

    path = tmp_path / "sneaky"
    path.write_bytes(pickle.dumps({b"data": Sneaky()}, protocol=2))
    with pytest.raises(ValueError, match="sneaky.*latin1"):
        cifar.load_cifar_pickle(path)


def test_cifar100_corrupt_and_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="(?s)cifar100.*cifar-100-python.*cifar-100-python.tar.gz"):
        cifar.cifar100(data_root=tmp_path)
    folder = _cifar(tmp_path)
    (folder / "test").write_bytes(b"\x80\x04garbage")
    with pytest.raises(ValueError, match="test: not a readable CIFAR-100 pickle"):
        cifar.cifar100(data_root=tmp_path)
    (folder / "test").write_bytes(
        pickle.dumps({b"data": np.zeros((2, 10), np.uint8), b"fine_labels": [0, 1]})
    )
    with pytest.raises(ValueError, match=r"test: 'data' must be a uint8 array of shape \(N, 3072\)"):
        cifar.cifar100(data_root=tmp_path)
    (folder / "test").write_bytes(pickle.dumps([1, 2, 3]))
    with pytest.raises(ValueError, match="expected a pickled dict"):
        cifar.cifar100(data_root=tmp_path)
