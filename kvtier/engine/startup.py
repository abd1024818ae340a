"""An engine's start, phase by phase: each logged as it begins and ends, with its time, and the
current one readable from another thread (a starting server's ``/health`` names it)::

    startup: loading weights ...            startup: loading weights done in 3.1 s
    startup: allocating KV tiers ...        ...
    startup: compiling kernels ...          startup: compiling kernels done in 21.4 s (38 variants)
    startup: capturing CUDA graphs ...      startup: ready in 31.2 s
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Iterator

log = logging.getLogger("kvtier.startup")


class Startup:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.phase = "starting"
        self.phases_s: dict[str, float] = {}
        self.total_s: float | None = None  # set by done()
        self.kernels_compiled = 0  # Triton variants compiled or loaded at start
        self._compiled_at_ready = 0
        self.kv_cache: dict[str, str] | None = None  # an fp8 cache: its dtype and where its scales came from
        self.on_change: Callable[[], None] | None = None  # after each phase change (an engine process tells its server)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.phase = name
        self._changed()
        log.info("startup: %s ...", name)
        t = time.monotonic()
        yield
        self.phases_s[name] = round(time.monotonic() - t, 3)
        self.phase = "setting up"  # between phases
        self._changed()
        log.info("startup: %s done in %.1f s", name, self.phases_s[name])

    def done(self) -> None:
        self.total_s = round(time.monotonic() - self.t0, 3)
        self._compiled_at_ready = _num_compiled()
        self.phase = "ready"
        self._changed()
        log.info("startup: ready in %.1f s (%s)", self.total_s, ", ".join(f"{k} {v:.1f} s" for k, v in self.phases_s.items()))

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def mirror(self, state: dict[str, Any]) -> None:
        """Take on ``state`` (another process's :meth:`as_dict`): a server whose engine runs in
        a process of its own reports that engine's start."""
        self.phase = state["phase"]
        self.phases_s = dict(state["phases_s"])
        self.total_s = state["startup_s"]
        self.kernels_compiled = state["kernels_compiled"]
        self.kv_cache = state.get("kv_cache")

    @property
    def elapsed_s(self) -> float:
        return round(time.monotonic() - self.t0, 3) if self.total_s is None else self.total_s

    @property
    def kernels_compiled_since_ready(self) -> int:
        """Triton variants compiled after the start: 0 unless a launch met a shape the warm-up
        did not foresee (each such compile stalled a step; the stats line says so)."""
        return _num_compiled() - self._compiled_at_ready if self.total_s is not None else 0

    def as_dict(self) -> dict:
        return {
            "phase": self.phase,
            "elapsed_s": self.elapsed_s,
            "startup_s": self.total_s,
            "phases_s": dict(self.phases_s),
            "kernels_compiled": self.kernels_compiled,
            "kernels_compiled_since_ready": self.kernels_compiled_since_ready,
            "kv_cache": self.kv_cache,
        }


def _num_compiled() -> int:
    try:
        from kvtier.triton_jit import num_compiled
    except ImportError:  # no triton: nothing is ever compiled
        return 0
    return num_compiled()
