"""Multi-stage recipes: named intermediate merges that later stages, and the final merge, use as inputs.

A recipe's ``stages`` (each a full recipe with a ``name``; mergekit-multi's several YAML documents) run in
order before the recipe's own merge. A model reference (``base``, ``models[].model``, ``slices[].sources[].model``,
``tokenizer_from``) equal to an earlier stage's name reads that stage's result. Every reference is checked
before anything runs. Intermediate results are streamed into a temporary folder beside the output
(``.OUT.<pid>.<random>.tmp``, removed after the run, on failure and on SIGTERM too; a later run removes one
left by a killed process), so only the final model remains.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .io.base import MergeInputError
from .io.output import OutputTarget
from .io.readers import HUB_ID
from .recipes import Recipe

__all__ = ["check_stage_refs", "intermediate_folder", "model_refs", "with_stage_paths"]


def model_refs(recipe: Any) -> list[tuple[str, str]]:
    """``(where, reference)`` of every model a recipe reads."""
    refs = [("base", recipe.base)] if recipe.base else []
    refs += [(f"models[{i}].model", m.model) for i, m in enumerate(recipe.models)]
    refs += [(f"slices[{i}].sources[{j}].model", s.model) for i, sl in enumerate(recipe.slices)
             for j, s in enumerate(sl.sources)]
    refs += [("tokenizer_from", recipe.tokenizer_from)] if recipe.tokenizer_from else []
    return refs


def check_stage_refs(recipe: Any) -> None:
    """Refuse, before anything runs, a reference that is neither an earlier stage's name nor an existing input.

    Raises:
        MergeInputError: names the stage, the key and the reference (exit code 3).
    """
    names = [s.name for s in recipe.stages]
    for i, stage in enumerate([*recipe.stages, recipe]):
        label = f"stages[{i}] ({stage.name})" if i < len(names) else "the final merge"
        for where, ref in model_refs(stage):
            if ref in names[:i]:
                continue
            if ref in names:
                raise MergeInputError(f"{label}: {where} {ref!r} is the stage stages[{names.index(ref)}], which runs "
                                      "later; expected the name of an earlier stage or a model")
            if not Path(ref).exists() and not (HUB_ID.match(ref) and not ref.startswith(".")):
                known = ", ".join(names[:i]) or "none"
                raise MergeInputError(f"{label}: {where} {ref!r} is neither the name of an earlier stage "
                                      f"({known}) nor an existing model folder or weights file")


def with_stage_paths(recipe: Any, done: dict[str, Path]) -> Recipe:
    """``recipe`` (without stages) with every reference to a finished stage replaced by that stage's folder."""
    def sub(ref: str | None) -> str | None:
        return str(done[ref]) if ref in done else ref

    data = recipe.model_dump()
    # keys the recipe did not set stay unset: some are refused when set alone (``fill`` without ``embeddings``)
    data = {k: v for k, v in data.items() if k in recipe.model_fields_set or k in ("models", "slices")}
    data.update(stages=[], base=sub(data.get("base")), tokenizer_from=sub(data.get("tokenizer_from")),
                chat_template_from=sub(data.get("chat_template_from")))
    for m in data["models"]:
        m["model"] = sub(m["model"])
    for sl in data["slices"]:
        for s in sl["sources"]:
            s["model"] = sub(s["model"])
    return Recipe.model_validate(data)


@contextmanager
def intermediate_folder(out: Path) -> Iterator[Path]:
    """A temporary folder beside ``out`` for the stages' results, removed on leaving (also on an error or
    SIGTERM, which :class:`~clmerge.merging.io.output.OutputTarget` turns into ``SystemExit``)."""
    with OutputTarget(Path(out), "folder") as target:  # never committed: always removed
        yield target.tmp
