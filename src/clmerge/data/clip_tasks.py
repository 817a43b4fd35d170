"""The 20 CLIP classification tasks of the merging papers (TA8, TALL14, TALL20) read from disk.

Layout, one per dataset, the same for all 20: ``ROOT/<dataset>/test/<label>/<image>`` where ``<dataset>`` is
FusionBench's name (``sun397``, ``stanford-cars``, ...: :data:`CLIP_DATASETS`), ``<label>`` is the integer
label of the dataset as FusionBench loads it (``0`` .. ``C-1``, the order of
:data:`~clmerge.data.clip_classnames.CLIP_CLASSNAMES`) or that class's name where the name is a valid folder
name, and ``<image>`` any raster file Pillow reads. A ``train`` split beside ``test`` is allowed and unused
(the experts are given). Writing it from an HF ``datasets`` split is one loop: ``for i, ex in enumerate(ds):
save ex["image"] as ROOT/<dataset>/test/<ex["label"]>/<i>.png``.

Images are preprocessed as CLIP's own image processor does: shortest side resized to the model's input size
(bicubic), centre crop, RGB, normalised with CLIP's mean and standard deviation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from clmerge.data.clip_classnames import CLIP_CLASSNAMES, CLIP_TEMPLATES
from clmerge.data.folders import images_in, subdirs
from clmerge.data.lookalike import write_class_dirs

__all__ = ["CLIP_DATASETS", "CLIP_SUITES", "CLIP_MEAN", "CLIP_STD", "CLIP_LAYOUT", "clip_test_files",
           "load_clip_images", "write_clip_lookalike", "class_prompts"]

CLIP_DATASETS = tuple(CLIP_CLASSNAMES)  # FusionBench's TALL20 order: TA8, then the TALL14 and TALL20 additions
CLIP_SUITES: dict[str, tuple[str, ...]] = {"clip-ta8": CLIP_DATASETS[:8], "clip-tall14": CLIP_DATASETS[:14],
                                            "clip-tall20": CLIP_DATASETS[:20]}
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's image normalisation
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
CLIP_LAYOUT = "ROOT/<dataset>/test/<label 0..C-1 or class name>/<image>"


def class_prompts(dataset: str) -> list[list[str]]:
    """For each class of ``dataset`` (label order), its prompts: every template filled with the class name."""
    return [[t.format(c) for t in CLIP_TEMPLATES[dataset]] for c in CLIP_CLASSNAMES[dataset]]


def _label_of(name: str, classes: tuple[str, ...]) -> int | None:
    if name.isdigit() and int(name) < len(classes):
        return int(name)
    return classes.index(name) if name in classes else None


def clip_test_files(root: Path, dataset: str, max_eval: int | None = None, seed: int = 0) -> list[tuple[Path, int]]:
    """The (image, label) pairs of ``dataset``'s test split under ``root`` (sorted; with ``max_eval``, a seeded
    random subset of that many).

    Raises:
        FileNotFoundError: no test images, naming the exact folder expected.
        ValueError: a class folder that is neither a label nor a class name of the dataset.
    """
    folder = root / dataset / "test"
    classes = CLIP_CLASSNAMES[dataset]
    if not folder.is_dir():
        raise FileNotFoundError(f"CLIP task {dataset}: no test split at {folder}; expected {CLIP_LAYOUT} "
                                f"({len(classes)} classes; docs/clip_merging.md)")
    pairs: list[tuple[Path, int]] = []
    for d in subdirs(folder):
        label = _label_of(d.name, classes)
        if label is None:
            raise ValueError(f"CLIP task {dataset}: class folder {d} is neither a label 0..{len(classes) - 1} "
                             f"nor a class name of {dataset} (e.g. {classes[0]!r})")
        pairs += [(p, label) for p in images_in(d)]
    if not pairs:
        raise FileNotFoundError(f"CLIP task {dataset}: no images under {folder}; expected {CLIP_LAYOUT}")
    if max_eval is not None and max_eval < len(pairs):
        keep = np.random.default_rng(seed).permutation(len(pairs))[:max_eval]
        pairs = [pairs[i] for i in sorted(keep)]
    return pairs


def _preprocess(path: Path, size: int) -> torch.Tensor:
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        s = size / min(w, h)
        im = im.resize((max(size, round(w * s)), max(size, round(h * s))), Image.Resampling.BICUBIC)
        left, top = (im.size[0] - size) // 2, (im.size[1] - size) // 2
        arr = np.asarray(im.crop((left, top, left + size, top + size)), dtype=np.float32) / 255.0
    x = (arr - np.array(CLIP_MEAN, dtype=np.float32)) / np.array(CLIP_STD, dtype=np.float32)
    return torch.from_numpy(x).permute(2, 0, 1)


def load_clip_images(pairs: list[tuple[Path, int]], size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The preprocessed images (N, 3, size, size) and their labels (N,)."""
    from ..utils.extras import require_extra

    require_extra("PIL.Image", what="the CLIP suites' image files")
    x = torch.stack([_preprocess(p, size) for p, _ in pairs])
    return x, torch.tensor([y for _, y in pairs], dtype=torch.long)


def _noise_pngs(n: int, size: int) -> list[bytes]:
    """``n`` seeded random-noise PNG images (distinct, so that a random model's predictions vary)."""
    import io

    from ..utils.extras import require_extra

    Image = require_extra("PIL.Image", what="look-alike image files")
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def write_clip_lookalike(root: Path, datasets: list[str], per_class: int = 2, max_classes: int | None = None) -> None:
    """Write look-alike test splits of ``datasets`` under ``root`` in the layout above (label folders; with
    ``max_classes``, only the first classes), for tests and dry runs."""
    pool = _noise_pngs(64, 16)
    for d in datasets:
        n = len(CLIP_CLASSNAMES[d]) if max_classes is None else min(max_classes, len(CLIP_CLASSNAMES[d]))
        write_class_dirs(root / d / "test", [str(i) for i in range(n)], per_class, pool)
