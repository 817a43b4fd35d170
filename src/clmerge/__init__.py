"""clmerge: continual learning and model merging on pretrained models.

The package's face sits above every layer (docs/architecture.md) and runs before any of its modules: it names
the provider of the registries that a lower layer looks up but a higher one fills (:mod:`clmerge.registry`),
so that ``clmerge.config.load_config`` finds the continual methods whatever was imported first.
"""

from .registry import set_provider
from .version import __version__

__all__ = ["__version__"]


def _continual_methods():
    """The registry of continual methods, filled: importing ``clmerge.methods`` registers them."""
    from .methods import METHODS

    return METHODS


set_provider("method", _continual_methods)
