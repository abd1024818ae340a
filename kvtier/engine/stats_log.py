"""The engine's periodic stats line (``kvtier serve --log-stats-interval``).

Every ``interval`` seconds while the engine has work, one INFO line on the ``kvtier.engine``
logger says what it did since the last line and what it holds now, as vLLM's and SGLang's servers
do: an operator reading a server's log sees a stall (requests waiting, no tokens moving, copies
or exports pending) without scraping ``/metrics``::

    engine (10.0 s): 4,096 prompt + 512 generated tok/s | running 8, waiting 3 (2 fetching) |
    device 1,520/1,640 blocks, host 6,001/8,192 | copies pending 12, exports 5 |
    pool read 3.20 GB/s, written 1.10 | slowest step 41 ms | preempted 0 | failed 0

(``| kernels compiled since ready N`` is added if Triton compiled a kernel after the start:
each such compile stalled a step, engine/warmup.py.)

It runs on the engine thread between steps and reads counters only (no synchronization).
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("kvtier.engine")


class StatsLog:
    def __init__(self, interval: float, logger: logging.Logger = log) -> None:
        if interval < 0:
            raise ValueError(f"stats interval must be >= 0 seconds (0: off), got {interval}")
        self.interval = interval
        self.logger = logger
        self.last = time.monotonic()  # when the last line was due (at first: when this was made)
        self._counts = (0, 0, 0, 0)  # prompt tokens computed, generated; pool bytes read, written
        self._slowest = 0.0  # the longest engine step since the last line (s)

    def note_step(self, seconds: float) -> None:
        """The engine loop ran one step (or pump) in ``seconds``: the line reports the slowest."""
        if seconds > self._slowest:
            self._slowest = seconds

    def maybe_log(self, core: Any, now: float | None = None) -> str | None:
        """Log (and return) the line if ``interval`` passed and there is anything to say."""
        if not self.interval:
            return None
        now = time.monotonic() if now is None else now
        if now - self.last < self.interval:
            return None
        pool = core.storage.counters if core.storage is not None else {}
        counts = (
            core.scheduler.num_prompt_tokens_computed,
            core.scheduler.num_generated_tokens,
            pool.get("bytes_read", 0),
            pool.get("bytes_written", 0),
        )
        last, slowest = self._counts, self._slowest
        dt, self.last, self._counts, self._slowest = now - self.last, now, counts, 0.0
        sched, cache = core.scheduler, core.cache
        busy = sched.has_unfinished() or cache.num_pending_ops or core.num_exports or counts != last
        if not busy:
            return None
        prompt, sampled, read, written = (c - b for c, b in zip(counts, last))
        fetching = sum(1 for r in sched.waiting if r.prefetch_deadline is not None)
        dev, host = cache.device_pool, cache.host_pool
        line = (
            f"engine ({dt:.1f} s): {prompt / dt:,.0f} prompt + {sampled / dt:,.0f} generated tok/s | "
            f"running {len(sched.running)}, waiting {len(sched.waiting)} ({fetching} fetching) | "
            f"device {dev.num_used:,}/{dev.num_blocks:,} blocks, host {host.num_used:,}/{host.num_blocks:,} | "
            f"copies pending {cache.num_pending_ops}, exports {core.num_exports} | "
            + (f"pool read {read / dt / 1e9:.2f} GB/s, written {written / dt / 1e9:.2f} | " if core.storage is not None else "")
            + f"slowest step {slowest * 1e3:,.0f} ms | "
            f"preempted {sched.num_preemptions} | failed {core.num_failed_requests}"
        )
        startup = getattr(core, "startup", None)
        compiled = startup.kernels_compiled_since_ready if startup is not None else 0
        if compiled:  # each one stalled a step: a shape the start's warm-up did not foresee
            line += f" | kernels compiled since ready {compiled}"
        self.logger.info(line)
        return line
