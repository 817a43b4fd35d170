"""Checkpoint I/O below the merge kernels: read the checkpoints people have, write complete model folders.

``open_checkpoint(spec, base=None)`` turns a model folder (single or sharded safetensors, ``.bin`` shards), a
weights file, a hub id or a PEFT adapter folder into a lazy source (``keys()``, ``meta(key)``, ``get(key)``,
``name``, ``files``, ``folder``), which :class:`clmerge.merging.ModelSet` accepts like a dict.
:class:`~clmerge.checkpoints.writer.ShardedWriter` streams merged tensors into sharded safetensors, and
:mod:`~clmerge.checkpoints.output` builds the output folder (config, tokenizer, model card) atomically. This
package imports nothing from :mod:`clmerge.merging`.
"""

from .readers import open_checkpoint
from .sources import MergeInputError, ParamSource, as_source
from .writer import ShardedWriter, parse_size

__all__ = ["MergeInputError", "ParamSource", "ShardedWriter", "as_source", "open_checkpoint", "parse_size"]
