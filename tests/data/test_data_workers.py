"""Worker-process data loading (data/loading.py) and FileListData decoding (uint8 batches, fast_jpeg)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from clmerge.data.base import FileListData, TensorData
from clmerge.data.scenarios import Rotation, TaskData, configure_loading


def _write_images(folder, n: int, size: tuple[int, int], fmt: str, seed: int = 0) -> list:
    """Smooth random images (a low-resolution noise field upsampled) with a little pixel noise."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        coarse = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
        im = Image.fromarray(coarse).resize(size, Image.BILINEAR)
        arr = np.clip(np.asarray(im, dtype=np.int16) + rng.integers(-8, 9, size=(size[1], size[0], 3)), 0, 255)
        path = folder / f"img{i:03d}.{fmt.lower()}"
        Image.fromarray(arr.astype(np.uint8)).save(path, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def png_source(tmp_path_factory):
    folder = tmp_path_factory.mktemp("png")
    paths = _write_images(folder, 13, (40, 30), "PNG")
    return FileListData(paths, np.arange(13) % 3, image_size=16, name="tiny/train")


def _legacy_load(path, image_size: int) -> torch.Tensor:
    """FileListData.load as it was before this change (a transcription), the reference for exactness."""
    with Image.open(path) as im:
        im = im.convert("RGB")
        short = round(image_size * 256 / 224)
        w, h = im.size
        scale = short / min(w, h)
        im = im.resize((max(image_size, round(w * scale)), max(image_size, round(h * scale))), Image.BICUBIC)
        w, h = im.size
        left, top = (w - image_size) // 2, (h - image_size) // 2
        arr = np.asarray(im.crop((left, top, left + image_size, top + image_size)), dtype=np.uint8)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).float().div_(255.0)


def _all_batches(data: TaskData, **kw) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(data.batches(4, shuffle=True, generator=torch.Generator().manual_seed(3), **kw))


def test_png_decoding_is_unchanged(png_source):
    x, y = png_source.get_batch(np.array([5, 0, 12]))
    ref = torch.stack([_legacy_load(png_source.paths[i], 16) for i in (5, 0, 12)])
    assert x.dtype == torch.float32 and torch.equal(x, ref)
    assert y.tolist() == [2, 0, 0]


@pytest.mark.parametrize("part", [None, (0, 2), (1, 2), (2, 3)])
def test_workers_give_identical_batches(png_source, part):
    # 13 images in batches of 4: the last batch has 1 image, so with part=(2, 3) some shares are empty
    label_map = np.array([2, 0, 1])
    plain = TaskData(png_source, np.arange(13), label_map, Rotation(90.0))
    workers = TaskData(png_source, np.arange(13), label_map, Rotation(90.0), num_workers=2)
    a, b = _all_batches(plain, part=part), _all_batches(workers, part=part)
    assert len(a) == len(b) == 4
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    if part == (2, 3):
        assert [len(y) for _, y in b] == [1, 1, 1, 0]
        assert b[-1][0].shape == (0, 3, 16, 16)


def test_workers_stop_at_max_batches(png_source):
    data = TaskData(png_source, np.arange(13), np.array([0, 1, 2]), num_workers=2)
    got = list(data.batches(5, max_batches=2))
    assert [y.tolist() for _, y in got] == [[0, 1, 2, 0, 1], [2, 0, 1, 2, 0]]


def test_in_memory_source_keeps_the_plain_path(monkeypatch):
    import clmerge.data.scenarios as scenarios

    monkeypatch.setattr(scenarios, "load_in_workers", lambda *a, **k: pytest.fail("workers used for TensorData"))
    src = TensorData(torch.arange(24, dtype=torch.uint8).reshape(6, 1, 2, 2), np.arange(6) % 2)
    data = TaskData(src, np.arange(6), np.array([0, 1]), num_workers=2)
    assert [y.tolist() for _, y in data.batches(4)] == [[0, 1, 0, 1], [0, 1]]


def test_pin_memory_is_accepted_without_cuda(png_source):
    plain = TaskData(png_source, np.arange(8), np.array([0, 1, 2]))
    for workers in (0, 2):
        pinned = TaskData(png_source, np.arange(8), np.array([0, 1, 2]), num_workers=workers, pin_memory=True)
        for (xa, ya), (xb, yb) in zip(plain.batches(3), pinned.batches(3), strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
            assert xb.is_pinned() == torch.cuda.is_available()  # a no-op without CUDA


def test_configure_loading_sets_every_split(png_source):
    from clmerge.data.base import DataSplits
    from clmerge.data.scenarios import build_scenario, reorder_tasks

    splits = DataSplits(train=png_source, test=png_source)
    sc = build_scenario(splits, kind="class_incremental", n_tasks=3, val_fraction=0.25, task_order=[2, 0, 1])
    configure_loading(sc, num_workers=2, pin_memory=True)
    datas = [d for t in sc.tasks for d in (t.train, t.val, t.test)]
    assert len(datas) == 9 and all(d.num_workers == 2 and d.pin_memory for d in datas)
    moved = reorder_tasks(sc.tasks, [1, 2, 0], sc.kind)  # new label maps keep the loading settings
    assert all(d.num_workers == 2 and d.pin_memory for t in moved for d in (t.train, t.val, t.test))
    with pytest.raises(ValueError, match="train.num_workers"):
        configure_loading(sc, num_workers=-1)


def test_corrupt_image_gives_the_same_error_in_a_worker(tmp_path):
    paths = _write_images(tmp_path, 4, (20, 20), "PNG")
    paths[2].write_bytes(b"not an image at all")
    src = FileListData(paths, [0, 1, 0, 1], image_size=8, name="broken/train")
    errors = []
    for workers in (0, 2):
        data = TaskData(src, np.arange(4), np.array([0, 1]), num_workers=workers)
        with pytest.raises(ValueError) as info:
            list(data.batches(2))
        errors.append(str(info.value))
    assert errors[0] == errors[1]
    assert errors[1].startswith(f"broken/train: cannot decode image {paths[2]} (")
    assert "\n" not in errors[1]


def test_missing_file_gives_the_same_error_in_a_worker(tmp_path):
    src = FileListData([tmp_path / "gone.png"], [0], image_size=8, name="gone/test")
    data = TaskData(src, np.arange(1), np.array([0]), num_workers=1)
    with pytest.raises(FileNotFoundError, match=r"^gone/test: image file missing: .*gone\.png$"):
        list(data.batches(1))


# fast_jpeg: a 640x480 JPEG at image_size 32 is decoded at 1/8 scale (80x60) before the bicubic resize to 43x37
FAST_JPEG_MEAN_TOL = 0.005  # mean |fast - exact| over pixels, images in [0, 1]
FAST_JPEG_MAX_TOL = 0.03  # largest single-pixel difference


def test_fast_jpeg_within_tolerance_of_exact(tmp_path):
    paths = _write_images(tmp_path, 3, (640, 480), "JPEG", seed=1)
    exact = FileListData(paths, [0, 1, 2], image_size=32).get_batch(np.arange(3))[0]
    fast = FileListData(paths, [0, 1, 2], image_size=32, fast_jpeg=True).get_batch(np.arange(3))[0]
    diff = (fast - exact).abs()
    assert diff.max() > 0  # the draft path was taken
    assert diff.mean() < FAST_JPEG_MEAN_TOL and diff.max() < FAST_JPEG_MAX_TOL


def test_fast_jpeg_leaves_png_and_full_size_jpeg_exact(tmp_path, png_source):
    fast_png = FileListData(png_source.paths, png_source.targets, image_size=16, fast_jpeg=True)
    assert torch.equal(fast_png.get_batch(np.arange(13))[0], png_source.get_batch(np.arange(13))[0])
    # a JPEG less than twice the resized size cannot be drafted: the fast path is then exact
    paths = _write_images(tmp_path, 2, (60, 45), "JPEG")
    exact = FileListData(paths, [0, 1], image_size=32).get_batch(np.arange(2))[0]
    fast = FileListData(paths, [0, 1], image_size=32, fast_jpeg=True).get_batch(np.arange(2))[0]
    assert torch.equal(fast, exact)


def test_configure_loading_switches_fast_jpeg_on_file_sources(png_source):
    from clmerge.data.base import DataSplits
    from clmerge.data.scenarios import build_scenario

    test_src = FileListData(png_source.paths, png_source.targets, image_size=16)
    sc = build_scenario(DataSplits(train=png_source, test=test_src), kind="class_incremental", n_tasks=3)
    configure_loading(sc, num_workers=1)
    assert not png_source.fast_jpeg and not test_src.fast_jpeg  # None: as built
    configure_loading(sc, fast_jpeg=True)
    assert png_source.fast_jpeg and test_src.fast_jpeg
    configure_loading(sc, fast_jpeg=False)
    assert not png_source.fast_jpeg


def test_a_run_with_decoding_workers_gives_the_same_metrics(tmp_path):
    """train.num_workers reaches the engine's data (configure_loading in prepare) and changes nothing else."""
    import json

    from PIL import Image

    from clmerge.config import parse_config
    from clmerge.engine.run import run_experiment
    from conftest import tiny_config

    rng = np.random.default_rng(0)
    for c in range(4):
        (tmp_path / "imgs" / f"class{c}").mkdir(parents=True)
        for i in range(12):
            pixels = (rng.random((20, 20, 3)) * 60 + c * 50).astype(np.uint8)
            Image.fromarray(pixels).save(tmp_path / "imgs" / f"class{c}" / f"{i}.png")
    metrics = []
    for workers in (0, 2):
        cfg = tiny_config(**{"scenario.dataset": "image_folder", "scenario.data_root": str(tmp_path / "imgs"),
                             "scenario.train_per_class": None, "scenario.test_per_class": None,
                             "train.num_workers": workers, "train.batch_size": 8})
        metrics.append(run_experiment(parse_config(cfg), tmp_path / f"run{workers}"))
        cfg_text = (tmp_path / f"run{workers}" / "config.yaml").read_text()
        assert f"num_workers: {workers}" in cfg_text
    assert metrics[0]["accuracy_matrix"] == metrics[1]["accuracy_matrix"]
    steps = [[json.loads(x)["loss"] for x in (tmp_path / f"run{w}" / "events.jsonl").read_text().splitlines()
              if json.loads(x)["event"] == "step"] for w in (0, 2)]
    assert steps[0] == steps[1] and steps[0]
