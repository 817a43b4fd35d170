"""A model folder handed to ``transformers`` through the input boundary (``clmerge eval``, ``clmerge moe``, the
tokenizers of a merge by token).

``AutoTokenizer.from_pretrained(folder)`` and ``AutoModelForCausalLM.from_pretrained(folder)`` open files by
name: they follow a symlink out of the folder, block on a FIFO, read a shard index's ``../x.safetensors``.
Checking the folder first and then letting transformers open it would leave a window between the check and the
read, so :func:`staged_model` stages the checked files instead:

1. every file clmerge knows such a folder to hold is opened and checked by :mod:`clmerge.utils.inpaths` (a
   regular file, resolving inside the folder, under its size cap): the config, generation config and tokenizer
   files (:func:`~clmerge.merging.io.output.model_files`) and, with ``weights``, ``model.safetensors`` /
   ``pytorch_model.bin`` and every shard their index lists (each entry checked to stay inside the folder,
   :func:`~clmerge.merging.io.readers.shard_map`);
2. the descriptors are held open, and a private temporary folder gets one symlink per file to the checked
   descriptor's ``/proc/self/fd/N`` (:func:`~clmerge.utils.inpaths.checked_path`);
3. transformers loads that folder, so it reads exactly the files that were checked (a file swapped in the model
   folder meanwhile is never seen, and a file clmerge did not check is not there); on exit the descriptors are
   closed and the folder removed (a loaded model keeps its own memory maps).

Errors are the boundary's one-line :class:`~clmerge.errors.InputError` naming the file and what is wrong.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ...utils import inpaths
from .base import MergeInputError
from .output import file_kind, model_files
from .readers import shard_map

__all__ = ["WEIGHT_FILES", "staged_files", "staged_model"]

#: The weights files transformers looks for in a causal-LM folder (safetensors first), indexes included.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def _weight_files(folder: Path) -> dict[str, tuple[Path, int | None]]:
    """``{name in the folder: (path, size cap)}`` of the weights files and, for an index, the shards it lists
    (weights have no cap; an index has a JSON file's)."""
    found: dict[str, tuple[Path, int | None]] = {}
    for name in WEIGHT_FILES:
        if not os.path.lexists(folder / name):
            continue
        path = inpaths.inside(folder, name, f"{folder}: weights file")
        if not name.endswith(".index.json"):
            found[name] = (path, None)
            continue
        found[name] = (path, inpaths.LIMITS["json"])
        for entry, shard in shard_map(path).items():
            norm = os.path.normpath(entry)
            if os.path.isabs(norm) or norm == ".." or norm.startswith("../"):  # no link can stand in for it
                raise MergeInputError(f"{path}: weight_map entry {entry}: name the shards by their path inside "
                                      f"{folder} (no absolute path, no '..' above it)")
            found[entry] = (shard, None)
    return found


@contextlib.contextmanager
def staged_model(folder: str | Path, *, weights: bool = True) -> Iterator[Path]:
    """A private folder of links to the checked files of the model folder ``folder`` (the module docstring),
    valid inside the ``with`` block; ``weights=False``: only the config and tokenizer files.

    Raises:
        InputError: a file leads out of ``folder``, is a FIFO / device / socket / folder / symlink loop, is over
            its size cap, or a shard index is malformed or lists a missing shard.
    """
    folder = Path(folder)
    with staged_files(folder, _weight_files(folder) if weights else None) as (staged, _):
        yield staged


@contextlib.contextmanager
def staged_files(folder: Path, weights: dict[str, tuple[Path, int | None]] | None = None
                 ) -> Iterator[tuple[Path, dict[str, Path]]]:
    """:func:`staged_model` of the config and tokenizer files of ``folder`` (checked by
    :func:`~.output.model_files`) and ``weights`` (``{name: (path, size cap)}``); yields the staged folder and
    ``{name: path}`` of the config and tokenizer files found."""
    files = model_files(folder, folder)
    entries = {name: (path, inpaths.LIMITS[file_kind(name)]) for name, path in files.items()}
    entries.update(weights or {})
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="clmerge-staged-")))
        for name, (path, cap) in entries.items():
            checked = stack.enter_context(inpaths.checked_path(path, within=folder, what=f"{folder}: model file",
                                                               max_bytes=cap))
            link = tmp / name
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(checked if checked.startswith("/proc/") else os.path.abspath(path), link)
        yield tmp, files
