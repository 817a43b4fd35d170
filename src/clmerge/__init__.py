"""clmerge: continual learning and model merging on pretrained models.

The package's face sits above every layer (docs/architecture.md) and runs before any of its modules: it names
the provider of the registries that a lower layer looks up but a higher one fills (:mod:`clmerge.registry`),
so that ``clmerge.config.load_config`` finds the continual methods whatever was imported first.
"""

import os

# Idle OpenMP threads sleep instead of spinning (also for the Python API, not only the command line): read by
# libgomp when torch loads, so it only acts when clmerge is imported before torch; an explicit setting wins.
# On a loaded 2-core machine a TIES merge through the API took 18.9 CPU s with the default policy and 2.9
# with PASSIVE at torch's default thread count (docs/threads.md, "Default thread count under load").
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .registry import set_provider  # noqa: E402
from .version import __version__  # noqa: E402

__all__ = ["__version__"]


def _continual_methods():
    """The registry of continual methods, filled: importing ``clmerge.methods`` registers them."""
    from .methods import METHODS

    return METHODS


set_provider("method", _continual_methods)
