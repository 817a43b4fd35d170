"""Checkpoint I/O below the merge kernels: read the checkpoints people have, write complete model folders.

``open_checkpoint(spec)`` turns a path or hub id into a lazy source (``keys()``, ``meta(key)``, ``get(key)``,
``name``), which :class:`clmerge.merging.ModelSet` accepts like a dict or a weights file.
"""

from .readers import open_checkpoint

__all__ = ["open_checkpoint"]
