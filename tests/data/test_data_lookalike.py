"""Look-alike datasets are written by the data layer, beside each reader: every registered writer's files are
read back by its own reader with the asked number of classes (what ``clmerge run --dry-run`` relies on)."""

from __future__ import annotations

import pytest

from clmerge.data import DATASETS, build_dataset
from clmerge.data.lookalike import LOOKALIKES, LookalikeSpec, lookalike_class_count, write_lookalike

CASES = [  # (dataset, classes asked, options, classes the reader sees)
    ("imagenet_r", 3, {}, 3),
    ("imagenet_a", 3, {}, 3),
    ("domainnet", 3, {"domains": ["real"]}, 3),
    ("cub200", 3, {}, 3),
    ("tinyimagenet", 3, {}, 3),
    ("image_folder", 4, {"subdir": "x"}, 4),
    ("cifar100", 3, {}, 100),  # the pickles always hold the 100 fine classes
]


@pytest.mark.parametrize("name,k,options,seen", CASES, ids=[c[0] for c in CASES])
def test_a_lookalike_is_read_back_by_its_reader(name, k, options, seen, tmp_path):
    assert write_lookalike(name, tmp_path, LookalikeSpec(classes=k, n_train=2, n_test=1, options=options))
    splits = build_dataset(name, data_root=str(tmp_path), image_size=8, seed=0, **options)
    assert splits.num_classes == seen
    assert len(splits.test) == seen  # one test image per class


def test_every_lookalike_names_a_dataset_and_bundled_sources_have_none(tmp_path):
    assert set(LOOKALIKES) <= set(DATASETS)
    assert not write_lookalike("digits", tmp_path, LookalikeSpec(classes=10, n_train=1, n_test=1))
    assert list(tmp_path.iterdir()) == []


def test_the_source_class_counts_come_from_the_readers():
    assert lookalike_class_count("cub200", {}) == 200
    assert lookalike_class_count("domainnet", {}) == 345
    assert lookalike_class_count("cifar100", {"label_kind": "coarse"}) == 20
    assert lookalike_class_count("omniglot", {"n_classes": 40}) == 40
    assert lookalike_class_count("image_folder", {}) is None and lookalike_class_count("digits", {}) is None
