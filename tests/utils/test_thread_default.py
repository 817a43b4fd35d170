"""The default thread count: half the cores, 1 to 4, and never more than the cores that are free now
(docs/threads.md, "Default thread count under load")."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from clmerge.utils.threads import default_threads, free_cores


@pytest.mark.parametrize("cpus, load, want", [(2, 0.0, 2), (2, 0.4, 2), (2, 0.6, 1), (2, 4.0, 1), (2, 7.5, 1),
                                              (16, 0.0, 16), (16, 13.6, 2), (1, 0.0, 1), (8, -1.0, 8)])
def test_free_cores_are_the_cpus_minus_the_rounded_load_at_least_one(cpus, load, want):
    assert free_cores(cpus, load) == want


@pytest.mark.parametrize("cpus, load, want", [
    (2, 0.0, 1),     # half of 2 cores
    (2, 4.0, 1),     # busy: 1 (never 0)
    (8, 0.0, 4),     # half of 8
    (16, 0.0, 4),    # capped at 4
    (16, 13.6, 2),   # 2 cores free: 2, not 4
    (16, 30.0, 1),   # oversubscribed: 1
    (1, 0.0, 1),
])
def test_default_threads_is_half_the_cores_at_most_4_and_at_most_the_free_cores(cpus, load, want):
    assert default_threads(cpus, load) == want


def test_defaults_read_the_machine_when_not_given(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "getloadavg", lambda: (6.2, 1.0, 1.0))
    assert free_cores() == 2 and default_threads() == 2
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert default_threads() == 4


def test_a_platform_without_a_load_average_counts_every_core_free(monkeypatch):
    def missing():
        raise OSError("no load average")

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "getloadavg", missing)
    assert free_cores() == 4 and default_threads() == 2


def test_importing_the_package_makes_idle_openmp_threads_sleep_unless_told_otherwise():
    """The Python API gets OMP_WAIT_POLICY=PASSIVE too (set before torch loads); an explicit value wins."""
    code = "import clmerge, os, sys; print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["PASSIVE", "False"]
    out = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "ACTIVE"
