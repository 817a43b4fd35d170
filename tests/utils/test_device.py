"""clmerge.utils.device: parsing --device, the inactive CPU default, draws that do not depend on the device."""

from __future__ import annotations

import pytest
import torch

from clmerge.errors import UsageError
from clmerge.utils.device import Device, cpu_draw, current_device, parse_device, stats_line, using_device


@pytest.mark.parametrize("spec, words", [("gpu", "expected cpu, cuda or cuda:N"), ("cuda:x", "expected cpu"),
                                         ("cpu:0", "expected cpu"), ("cuda", "no CUDA device is visible")])
def test_bad_or_invisible_devices_are_usage_errors(spec, words, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match=words):
        parse_device(spec)


def test_cpu_is_the_plain_path_and_forcing_it_takes_the_device_path():
    assert not parse_device(None).active and not parse_device("cpu").active
    with using_device(parse_device("cpu")):
        assert current_device() is None
    forced = Device("cpu", forced=True)
    with using_device(forced):
        assert current_device() is forced
    assert current_device() is None
    x = torch.ones(3)
    assert forced.put(x) is not x and torch.equal(forced.put(x), x) and forced.moved == 2


def test_draws_come_from_the_cpu_generator_whatever_the_device():
    like = torch.zeros(2)
    want = torch.rand(4, 5, generator=torch.Generator().manual_seed(7))
    with using_device(Device("cpu", forced=True)):
        got = cpu_draw(torch.rand, (4, 5), generator=torch.Generator().manual_seed(7), like=like)
    assert torch.equal(want, got)


def test_the_stats_line_names_the_device_the_wall_time_and_the_peak():
    assert stats_line({"device": "cuda:0", "wall_s": 1.25, "peak_device_memory_bytes": 2_500_000_000}) == \
        "device cuda:0: wall 1.2 s, peak device memory 2.50 GB"
    assert stats_line(Device("cpu", forced=True).stats()).endswith("peak device memory n/a")
