"""The prompt methods on a frozen backbone: L2P, DualPrompt and CODA-Prompt (:mod:`.methods`, their pools in
:mod:`.pools`) and HiDe-Prompt (:mod:`.hide_prompt`, its parts in :mod:`.hide_parts`). Prompts enter the model
through :mod:`clmerge.adapters.prompt`. Importing this package registers the four methods."""

from .hide_prompt import HiDePrompt, HiDePromptOptions
from .methods import (
    L2P,
    CodaPrompt,
    CodaPromptOptions,
    DualPrompt,
    DualPromptOptions,
    L2POptions,
    PromptMethod,
    PromptMethodOptions,
)

__all__ = [
    "PromptMethod",
    "PromptMethodOptions",
    "L2P",
    "L2POptions",
    "DualPrompt",
    "DualPromptOptions",
    "CodaPrompt",
    "CodaPromptOptions",
    "HiDePrompt",
    "HiDePromptOptions",
]
