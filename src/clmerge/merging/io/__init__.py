"""Checkpoint I/O of the merge library: read the checkpoints people have, write complete model folders.

``open_checkpoint(spec, base=None)`` (and ``as_source``, which also takes a dict) turns a model folder (single
or sharded safetensors, ``.bin`` shards), a weights file, a hub id or a PEFT adapter folder into a lazy source
(``keys()``, ``meta(key)``, ``get(key)``, ``name``, ``files``, ``folder``), which
:class:`clmerge.merging.ModelSet` accepts like a dict. :class:`~clmerge.merging.io.writer.ShardedWriter`
streams merged tensors into sharded safetensors, and :mod:`~clmerge.merging.io.output` builds the output folder
(config, tokenizer, model card) atomically.

The arrows run one way: :mod:`.base` (``ParamSource``, ``MergeInputError``) imports nothing back;
:mod:`.peft` and :mod:`.readers` build on it, and :mod:`.readers` dispatches among them. Nothing here imports
the merge methods or their registry.
"""

from .base import MergeInputError, ParamSource, is_source
from .readers import as_source, open_checkpoint
from .writer import ShardedWriter, parse_size

__all__ = ["MergeInputError", "ParamSource", "ShardedWriter", "as_source", "is_source", "open_checkpoint",
           "parse_size"]
