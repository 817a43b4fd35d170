"""Containment of input paths: a path read from a file stays inside the folder that file belongs to.

A model folder, an adapter folder or a run directory names other files (a shard index's ``weight_map``, the
tokenizer and config files copied into a merge's output). Whoever wrote the folder chose those names, not the
person running clmerge, so :func:`inside` resolves each one (symlinks included) and refuses it, before it is
opened, unless the result lies inside the resolved folder. A symlink that stays inside is followed; one that
leads out (``../x``, an absolute path, a link to ``/etc/passwd``) is refused, naming the entry and its target.

One exception keeps Hugging Face's cache working: a hub snapshot (``models--org--name/snapshots/<rev>/``) holds
symlinks into the same repository's ``blobs/``, so for such a folder the repository's cache folder is the
boundary.

Paths the user typed (``--base``, ``--expert``, ``--tokenizer-from``, the models of a recipe file the user
wrote and passes on the command line) are the user's own choice and are not contained.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError

__all__ = ["boundary", "inside"]


def boundary(folder: Path) -> Path:
    """The resolved folder whose inside ``folder``'s entries must stay in (a hub snapshot: its repository)."""
    real = Path(folder).resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent
    return real


def inside(folder: Path, entry: str | Path, what: str) -> Path:
    """``folder / entry``, after checking that it resolves (symlinks followed) inside ``folder``.

    Args:
        folder: the folder the entry belongs to.
        entry: a relative name taken from a file (an absolute one is refused).
        what: how the message names the entry, e.g. ``"model.safetensors.index.json: weight_map entry 'w'"``.

    Raises:
        InputError: the entry points outside the folder (message: the entry, where it points, the folder).
    """
    folder = Path(folder)
    path = folder / entry
    real, root = path.resolve(), boundary(folder)
    if not real.is_relative_to(root) or real == root:
        raise InputError(f"{what} -> {entry}: points outside {folder} (resolves to {real}); clmerge reads only "
                         "files inside the folder given to it")
    return path
