"""Optional log sinks (``run.log: [csv, tensorboard, wandb]``): every scalar of every event a run writes to
``events.jsonl`` also goes to

* ``csv``: ``OUT/scalars.csv``, one row per scalar (``time, event, task, phase, epoch, step, name, value``);
  a list of numbers (``acc_row``) gives one row per entry (``acc_row/0``, ...). On ``--resume`` the file is
  rebuilt from the kept ``events.jsonl``, so it never holds the interrupted task's rows twice.
* ``tensorboard``: event files under ``OUT/tensorboard`` (the ``tensorboard`` extra), tag ``<event>/<name>``,
  step: how many values of that tag came before.
* ``wandb``: Weights & Biases in offline mode under ``OUT/wandb`` (the ``wandb`` extra); ``wandb sync`` uploads.

Progress lines are unchanged. Missing packages are refused by :func:`check_sinks` before the run starts.
"""

from __future__ import annotations

import csv
import json
import numbers
from collections import Counter
from pathlib import Path
from typing import Any

from ..utils.extras import require_extra
from ..utils import inpaths
from ..utils.io import append_text, atomic_write_text

__all__ = ["SINKS", "Sinks", "check_sinks", "scalars"]

SINKS = ("csv", "tensorboard", "wandb")
CSV_NAME = "scalars.csv"
_COLUMNS = ("time", "event", "task", "phase", "epoch", "step", "name", "value")
_CONTEXT = ("time", "event", "task", "phase", "epoch", "step")


def check_sinks(names: list[str]) -> None:
    """Import what the sinks need (a missing package is a one-line error naming its extra)."""
    if "tensorboard" in names:
        require_extra("tensorboard", "tensorboard", what="run.log: tensorboard")
    if "wandb" in names:
        require_extra("wandb", "wandb", what="run.log: wandb")


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def scalars(event: dict) -> list[tuple[str, float]]:
    """``(name, value)`` of every scalar of ``event`` (not its context keys), lists of numbers by index."""
    out = []
    for key, v in event.items():
        if key in _CONTEXT:
            continue
        if _is_number(v):
            out.append((key, float(v)))
        elif isinstance(v, list) and v and all(_is_number(x) for x in v):
            out += [(f"{key}/{i}", float(x)) for i, x in enumerate(v)]
    return out


def _csv_rows(event: dict) -> list[list[Any]]:
    ctx = [event.get(k, "") for k in _CONTEXT]
    return [[*ctx, name, value] for name, value in scalars(event)]


def _lines(rows: list[list[Any]]) -> str:
    import io

    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue()


class Sinks:
    """The sinks of one run directory; :meth:`write` takes each event as ``events.jsonl`` gets it."""

    def __init__(self, out: Path, names: list[str]) -> None:
        self.out, self.names = Path(out), list(names)
        self._tb = self._wandb = None
        self._seen: Counter[str] = Counter()
        if "csv" in self.names:
            self._rebuild_csv()
        if "tensorboard" in self.names:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.out / "tensorboard"))
        if "wandb" in self.names:
            wandb = require_extra("wandb", "wandb", what="run.log: wandb")
            self._wandb = wandb.init(mode="offline", dir=str(self.out), name=self.out.name)

    def _rebuild_csv(self) -> None:
        """``scalars.csv`` from the events kept so far (none for a new run; a resumed run's kept lines)."""
        events = self.out / "events.jsonl"
        rows = [list(_COLUMNS)]
        lines = inpaths.read_jsonl_lines(events, within=self.out) if events.exists() else []
        for line in lines:
            try:
                rows += _csv_rows(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line: events.jsonl's readers skip it too
        atomic_write_text(self.out / CSV_NAME, _lines(rows))

    def write(self, event: dict) -> None:
        if "csv" in self.names:
            append_text(self.out / CSV_NAME, _lines(_csv_rows(event)))
        if self._tb is None and self._wandb is None:
            return
        tagged = {f"{event.get('event', 'event')}/{n}": v for n, v in scalars(event)}
        for tag, v in tagged.items():
            if self._tb is not None:
                self._tb.add_scalar(tag, v, global_step=self._seen[tag])
            self._seen[tag] += 1
        if self._wandb is not None and tagged:
            self._wandb.log(tagged)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
