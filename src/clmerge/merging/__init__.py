"""Model merging: pure functions over parameter dicts (``merging.methods``: the kernels and their one registry),
the recipe runner, and checkpoint I/O (``merging.io``).

```python
from clmerge import merging
merged = merging.merge("ties", base=pretrained, experts=[sd_a, sd_b], density=0.2, scaling=1.0)
merging.available()  # {name: one-line description}
```
Experts (and the base) may be ``dict[str, Tensor]`` or paths to safetensors files (read lazily, key by key)
or ``.bin``/``.pt`` files (``torch.load(weights_only=True)``).

Layer: above report and data; ``merging/io`` is its checkpoint I/O. Imports no method, engine or command (docs/architecture.md).
"""

# importing .methods registers every built-in method; its public names are this package's
from . import methods
from .methods import *  # noqa: F403

# merges on loaded objects (a PeftModel's adapters, nn.Modules): imported on first use (peft only then)
_INMEMORY = ("add_merged_adapter", "merge_models")

__all__ = list(methods.__all__) + list(_INMEMORY)


def __getattr__(name: str):
    if name in _INMEMORY:
        from . import inmemory

        return getattr(inmemory, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
