"""Vision-language model folders: the language tower merged, the vision tower and its projector kept.

A merge of fine-tunes of a vision-language model usually means the language model's weights: the fine-tunes
rarely touch the vision encoder, and averaging encoders that drifted apart blurs the image features the
projector was trained on. So for a folder whose ``config.json`` names one of :data:`VLM_TYPES` the runner
merges every key of the language tower with the recipe's method and copies every key of the vision tower
(the encoder and the projector / merger that maps its features into the language model) from the base (the
first model when there is none). The recipe key ``towers: {language: merge, vision: base}`` states the same
explicitly, changes it (``vision: merge`` merges everything, ``language: base`` keeps the language tower),
or applies the rule to a folder of another model type.

The vision tower is recognised by key prefix, in the hub layout (``visual.``, ``vision_tower.``,
``multi_modal_projector.``, what transformers 5's ``save_pretrained`` writes too) and in transformers 5's
module layout (the same under ``model.``). Everything else (``model.layers``, ``language_model.``,
``lm_head``, the embeddings) is the language tower. The processor files beside the weights
(``preprocessor_config.json``, ``processor_config.json``, the chat template, the tokenizer) are copied
unchanged from the base like a text model's tokenizer files.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from ..utils import inpaths
from .io.base import MergeInputError

__all__ = ["TOWER", "VISION_PREFIXES", "VLM_TYPES", "split_towers", "tower_policy"]

#: the model types whose folders get ``{language: merge, vision: base}`` without a ``towers:`` key
VLM_TYPES = ("qwen2_vl", "qwen2_5_vl", "llava")
VISION_PREFIXES = tuple(p + s for p in ("", "model.") for s in ("visual.", "vision_tower.", "multi_modal_projector."))
#: the hyperparameter that marks a group of keys copied from the base (shown in the dry run's groups)
TOWER = "tower"
DEFAULT = {"language": "merge", "vision": "base"}


def _config(folder: Path | None) -> dict | None:
    if folder is None or not (Path(folder) / "config.json").is_file():
        return None
    config = inpaths.read_json(Path(folder) / "config.json", within=folder, what=f"{folder}: model file")
    return config if isinstance(config, dict) else None


def tower_policy(model_type: str | None, towers: dict[str, str] | None) -> dict[str, str] | None:
    """What happens to each tower: the recipe's ``towers`` over :data:`DEFAULT`, :data:`DEFAULT` for a
    model type of :data:`VLM_TYPES`, else ``None`` (every key merged)."""
    if towers is not None:
        return {**DEFAULT, **towers}
    return dict(DEFAULT) if model_type in VLM_TYPES else None


class _Kept:
    """A method's result for keys copied from one input: :meth:`flush` streams them into the sink."""

    def __init__(self, models: Any) -> None:
        self.models = models

    def flush(self) -> None:
        src = self.models.base if self.models.base is not None else self.models.experts[0]
        for key in self.models.keys():
            self.models.sink.write(key, src.get(key))


def _keeping(fn: Any) -> Any:
    @functools.wraps(fn)  # the method's signature stays what inspect reports
    def merge(*, base: Any, experts: Any, **hp: Any) -> Any:
        if hp.pop(TOWER, None) is not None:
            return _Kept(experts)
        return fn(base=base, experts=experts, **hp)
    return merge


def split_towers(prep: Any) -> Any:
    """``prep`` (a :class:`~.pipeline.Prepared`) with the towers of a vision-language folder split: the keys of
    a tower kept from the base form one group of their own (marked by :data:`TOWER`), which the method
    wrapper copies instead of merging; returned unchanged when no policy applies or every tower is merged.

    Raises:
        MergeInputError: a ``towers:`` policy on inputs without vision-tower keys (names the prefixes).
    """
    recipe = prep.recipe
    config = _config(prep.model_folder)
    policy = tower_policy(config.get("model_type") if config else None, getattr(recipe, "towers", None))
    if policy is None or set(policy.values()) == {"merge"}:
        return prep
    keys = prep.models.keys()
    vision = {k for k in keys if k.startswith(VISION_PREFIXES)}
    if not vision:
        raise MergeInputError(f"towers: the inputs have no vision-tower keys (none starts with "
                              f"{', '.join(VISION_PREFIXES[:3])} or the same under model.); expected a "
                              "vision-language model folder")
    kept: dict[str, list[str]] = {"language": [], "vision": []}
    groups = []
    for hp, group in prep.groups:
        merged = [k for k in group if policy["vision" if k in vision else "language"] == "merge"]
        for k in group:
            tower = "vision" if k in vision else "language"
            if policy[tower] == "base":
                kept[tower].append(k)
        if merged:
            groups.append((hp, merged))
    source = "the base" if prep.models.base is not None else "the first model"
    groups += [({TOWER: f"{t} kept from {source}"}, ks) for t, ks in kept.items() if ks]
    return dataclasses.replace(prep, groups=groups, method=dataclasses.replace(prep.method,
                                                                               fn=_keeping(prep.method.fn)))
