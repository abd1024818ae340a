"""The cores a CPU engine sizes its threads by are the ones it may run on (taskset, a cpuset)."""

from __future__ import annotations

import os

import pytest

from kvtier import cpus


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="this platform has no CPU affinity (macOS)")
def test_usable_cpus_are_the_affinity_not_the_machine(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert cpus.usable_cpus() == 2
    assert cpus.engine_threads(16) == 1  # two cores: one for the engine, one for the server process
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert cpus.engine_threads(16) == 7 and cpus.engine_threads(4) == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert cpus.engine_threads(16) == 1  # never none
