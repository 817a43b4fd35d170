"""Choosing a config key on validation data before a sweep's cells run (the spec's ``select:`` block).

Phase 1 runs the *selection cells* under ``DIR/select/``: for each group (one combination of the ``per`` keys'
grid values) and each candidate value, one cell per selection seed and per combination of the other grid keys
(``seed`` aside). A value's score is the mean, over its cells, of the validation metric: the final
class-incremental accuracy on the held-out validation parts of all tasks (``scenario.val_fraction``), of the
run's primary head, as the engine's validation pass writes it to ``metrics.json`` (``head.val_acc``). Test
metrics are never read. The best value wins (a tie: the smaller number, else the one listed first).

When the best value is the largest (smallest) one tried, the grid is extended past that edge by one geometric
step, ``r = (max / min) ** (1 / (n - 1))`` of the spec's ``n`` values, the k-th step past the top being
``max * r**k`` rounded to one significant digit (to more when that value was tried; whole numbers for a grid
of integers): 1e-3, 3e-3, 1e-2 extends to 3e-2, then 1e-1, and down to 3e-4, then 1e-4. At most ``extend``
steps per group; a choice still at an edge after them is marked ``at_edge`` in ``DIR/selected.json``.

Phase 2 (:func:`phase2_cells`) is the grid's cells with each group's chosen value.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..errors import RunStateError
from ..utils.grid_edge import past_edge
from ..utils.io import read_json
from .grid import Cell, SweepSpec, cell_config, cell_name, expand_cells, linked
from .select_spec import SelectSpec

__all__ = ["SELECT_DIR", "SELECTED_FILE", "val_score", "groups", "group_label", "selection_cells",
           "selection_plan", "phase2_cells", "pick_best", "next_value", "run_selection"]

SELECT_DIR, SELECTED_FILE = "select", "selected.json"


def val_score(metrics: dict, metric: str = "acc") -> float | None:
    """The selection score of a finished run's ``metrics.json``: its primary head's final CIL accuracy on the
    validation split (``head.val_acc``; None when the run held out no validation data)."""
    if metric != "acc":
        raise ValueError(f"unknown selection metric {metric!r}")
    return (metrics.get("head") or {}).get("val_acc")


def groups(spec: SweepSpec) -> list[dict[str, Any]]:
    """Every combination of the ``per`` keys' grid values (one group, ``{}``, without ``per``)."""
    per = spec.select.per
    return [dict(zip(per, combo)) for combo in itertools.product(*(spec.grid[k] for k in per))]


def group_label(per_values: dict[str, Any]) -> str:
    """A group's name in ``selected.json``: its ``per`` values as a cell name (``pm``), or ``all``."""
    return cell_name(per_values) if per_values else "all"


def selection_cells(spec: SweepSpec, group: dict[str, Any], value: Any) -> list[Cell]:
    """The cells that score ``value`` for ``group``: each selection seed x each other grid combination."""
    sel = spec.select
    others = {k: v for k, v in spec.grid.items() if k not in sel.per and k != "seed"}
    cells = []
    for combo in itertools.product(*others.values()):
        for seed in sel.seeds or [None]:
            ov = {**group, **dict(zip(others, combo)), **({} if seed is None else {"seed": seed}), sel.key: value}
            cells.append(Cell(f"{SELECT_DIR}/{cell_name(ov)}", linked(ov, spec.link)))
    return cells


def selection_plan(spec: SweepSpec, base: dict, tried: dict[str, tuple[dict, list]]) -> list[tuple[Cell, dict]]:
    """Every selection cell of the ``tried`` values (group label -> (per values, values)) with its validated
    config; a cell that holds out no validation data is a ConfigError naming ``scenario.val_fraction``."""
    plan = []
    for per, values in tried.values():
        for value in values:
            for cell in selection_cells(spec, per, value):
                data, cfg = cell_config(base, cell)
                if not cfg.scenario.val_fraction > 0:
                    raise ConfigError(f"select: cell {cell.name}: scenario.val_fraction is "
                                      f"{cfg.scenario.val_fraction}; selection on validation needs a held-out "
                                      "part of each task's training set (e.g. scenario.val_fraction: 0.1 in set)")
                plan.append((cell, data))
    return plan


def phase2_cells(spec: SweepSpec, chosen: dict[str, Any] | None = None) -> list[Cell]:
    """The grid's cells, each with its group's chosen value of the selected key (``chosen``: group label ->
    value; None: the first candidate, only to check the configs before the selection)."""
    sel = spec.select
    cells = []
    for c in expand_cells(spec):
        label = group_label({k: c.overrides[k] for k in sel.per})
        cells.append(Cell(c.name, {**c.overrides, sel.key: sel.values[0] if chosen is None else chosen[label]}))
    return cells


def _numeric(values: list[Any]) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def pick_best(scores: dict[Any, float], order: list[Any]) -> Any:
    """The value with the highest score; a tie goes to the smaller number (non-numbers: the earlier in
    ``order``)."""
    numeric = _numeric(list(scores))
    return max(scores, key=lambda v: (scores[v], -v if numeric else -order.index(v)))


def next_value(sel: SelectSpec, tried: list[Any], best: Any) -> Any | None:
    """The next value past the edge ``best`` sits at (module docstring; the rule is
    :func:`clmerge.utils.grid_edge.past_edge`, shared with ``merge --tune``), or None when it is interior."""
    return past_edge(sel.values, tried, best, scale="geometric")


def _scores(out: Path, spec: SweepSpec, per: dict, values: list[Any]) -> dict[Any, dict]:
    """value -> {"val": mean score over its cells, "cells": names} (reads only the validation score)."""
    res = {}
    for value in values:
        names = [c.name for c in selection_cells(spec, per, value)]
        got = [val_score(read_json(out / n / "metrics.json", within=out / n), spec.select.metric) for n in names]
        if any(s is None for s in got):
            bad = names[[s is None for s in got].index(True)]
            raise RunStateError(f"select: {out / bad / 'metrics.json'} has no validation score (head.val_acc); "
                              "the run held out no validation data")
        res[value] = {"val": sum(got) / len(got), "cells": names}
    return res


def _record(sel: SelectSpec, per: dict, values: list, extended: list, scores: dict) -> dict[str, Any]:
    best = pick_best({v: s["val"] for v, s in scores.items()}, values)
    edge = _numeric(values) and len(values) > 1 and best in (min(values), max(values))
    rows = [{"value": v, f"val_{sel.metric}": scores[v]["val"], "cells": scores[v]["cells"]}
            for v in (sorted(values) if _numeric(values) else values)]
    return {"per": per, "value": best, "scores": rows, "extended": extended, "at_edge": bool(edge)}


def run_selection(spec: SweepSpec, base: dict, out: Path, run_cells: Callable[[list], None],
                  log: Callable[[str], None] = print) -> tuple[dict[str, dict], list[tuple[Cell, dict]]]:
    """Phase 1: run the selection cells (``run_cells(plan)`` runs the unfinished ones or raises), extend at an
    edge up to ``select.extend`` times; returns (group label -> record for ``selected.json``, the final plan)."""
    sel = spec.select
    tried = {group_label(g): (g, list(sel.values)) for g in groups(spec)}
    extended: dict[str, list] = {label: [] for label in tried}
    while True:
        plan = selection_plan(spec, base, tried)
        run_cells(plan)
        scores = {label: _scores(out, spec, per, values) for label, (per, values) in tried.items()}
        grew = False
        for label, (per, values) in tried.items():
            best = pick_best({v: s["val"] for v, s in scores[label].items()}, values)
            nxt = next_value(sel, values, best) if len(extended[label]) < sel.extend else None
            if nxt is not None:
                values.append(nxt)
                extended[label].append(nxt)
                log(f"select {label}: best {sel.key}={best} is at an edge; trying {nxt}")
                grew = True
        if not grew:
            break
    return {label: _record(sel, per, values, extended[label], scores[label])
            for label, (per, values) in tried.items()}, plan
