"""How many cores this process may use: the ones it is allowed to run on (``taskset``, a
container's cpuset), not the machine's. ``os.cpu_count()`` counts the machine's: a CPU engine that
sized its threads by it on 2 of 16 cores ran 15 OpenMP threads on 2 cores, and under any other
load its steps slowed 40-70x (threads waiting at barriers for threads that were not running)."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # (no affinity on this platform: macOS)
        return os.cpu_count() or 1


def engine_threads(default: int) -> int:
    """A CPU engine's torch threads: at most the usable cores less one, left to the server process
    that answers /health and streams every client's tokens (as vLLM's CPU backend reserves cores
    for its front end)."""
    return max(1, min(default, usable_cpus() - 1))
