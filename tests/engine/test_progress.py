"""Progress output: bars only on a terminal, one plain line per epoch otherwise; step-loss records."""

from __future__ import annotations

import io
import math
import re

import numpy as np
import pytest
import torch
from torch import nn

from clmerge.config import OptimConfig
from clmerge.data import TensorData
from clmerge.data.scenarios import TaskData
from clmerge.engine.training import LOSS_POINTS, fit, loss_interval
from clmerge.utils.progress import Progress, progress_mode

EPOCH_LINE = re.compile(r"^task 1/2 epoch (\d)/(\d) loss \d+(\.\d+)?(e-?\d+)? \(\d+\.\d s\)$")


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _task_data(n: int = 50) -> TaskData:
    g = torch.Generator().manual_seed(0)
    y = np.arange(n) % 3
    return TaskData(TensorData(torch.rand(n, 1, 2, 2, generator=g), y), np.arange(n), np.arange(3))


def _fit(epochs: int, *, batch_size: int = 8, progress: bool = True, log=None, log_every=None) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    return fit(model, _task_data(), groups=[{"params": list(model.parameters())}],
               loss_fn=lambda m, x, y: nn.functional.cross_entropy(m(x), y), optim=OptimConfig(lr=0.1),
               epochs=epochs, batch_size=batch_size, generator=torch.Generator().manual_seed(1),
               device=torch.device("cpu"), desc="task 1/2", progress=progress, task_index=0, log=log,
               log_every=log_every)


def test_modes() -> None:
    assert progress_mode(True, io.StringIO()) == "lines"
    assert progress_mode(True, FakeTerminal()) == "bar"
    assert progress_mode(False, FakeTerminal()) == "off"
    closed = io.StringIO()
    closed.close()
    assert progress_mode(True, closed) == "lines"  # isatty on a closed stream raises; not a terminal


def test_piped_output_is_one_plain_line_per_epoch(monkeypatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    res = _fit(3)
    text = err.getvalue()
    assert "\x1b" not in text and "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 3
    for k, line in enumerate(lines, start=1):
        m = EPOCH_LINE.match(line)
        assert m and m.group(1) == str(k) and m.group(2) == "3", line
    assert [float(line.split(" loss ")[1].split()[0]) for line in lines] == pytest.approx(res["losses"], rel=1e-3)


def test_progress_off_prints_nothing(monkeypatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    _fit(2, progress=False)
    assert err.getvalue() == ""


def test_terminal_gets_a_bar_and_no_lines(monkeypatch) -> None:
    term = FakeTerminal()
    monkeypatch.setattr("sys.stderr", term)
    _fit(2)
    text = term.getvalue()
    assert "task 1/2 epoch 1/2" in text and "\r" in text  # tqdm redraws in place
    assert not any(EPOCH_LINE.match(line) for line in text.splitlines())


def test_progress_line_and_postfix_are_noops_where_they_should_be(monkeypatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    bar = Progress(range(3), desc="tasks", enabled=True)
    assert list(bar) == [0, 1, 2]
    bar.set_postfix(avg_acc="1.0")  # no bar: nothing
    bar.line("task 1/3 done")
    bar.close()
    assert err.getvalue() == "task 1/3 done\n"


@pytest.mark.parametrize("total,points", [(5, 5), (40, 40), (41, 21), (150, 38), (1000, 40), (10_000, 40)])
def test_loss_interval_gives_about_forty_points(total: int, points: int) -> None:
    every = loss_interval(total)
    assert math.ceil(total / every) == points
    assert loss_interval(total, 7) == 7
    assert points <= LOSS_POINTS


def test_step_events_average_to_the_epoch_loss() -> None:
    events: list[dict] = []
    res = _fit(2, progress=False, log=events.append, log_every=1)  # 50 samples, batch 8: 7 steps per epoch
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 15)) and all(e["steps"] == 1 for e in steps)
    sizes = [8] * 6 + [2]  # the last batch of an epoch holds the 2 left-over samples
    for epoch in (1, 2):
        per_step = [e["loss"] for e in steps if e["epoch"] == epoch]
        assert np.dot(per_step, sizes) / 50 == pytest.approx(res["losses"][epoch - 1], rel=1e-12)


def test_step_events_default_interval_and_last_short_interval() -> None:
    events: list[dict] = []
    _fit(5, batch_size=2, progress=False, log=events.append)  # 25 steps per epoch, 125 in all: every 4
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == 32 and sum(e["steps"] for e in steps) == 125
    assert [e["steps"] for e in steps[-2:]] == [4, 1] and steps[-1]["step"] == 125
    assert all(e["task"] == 0 and e["phase"] == "task 1/2" for e in steps)
    epoch_events = [e for e in events if e["event"] == "epoch"]
    assert len(epoch_events) == 5 and events[-1]["event"] == "epoch"
