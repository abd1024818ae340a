"""The engine's serving loop: commands in, a step, each request's new tokens out. It runs on a
thread of the serving process (:class:`~kvtier.engine.async_engine.AsyncEngine`) or as the main
loop of an engine process of its own (engine/proc.py, what ``kvtier serve`` runs); only how
commands arrive and where a request's deltas go differ (``next_command``, :class:`Sink`).

Commands: ``("add", sink)`` queue ``sink.req``; ``("abort", request_id)``; ``("call", fn, reply)``
run ``fn(core)`` between steps (``fn`` a callable, or the name of one in :data:`CALLS`) and
``reply(result, error)``; ``("wake",)``.

Requests that arrive while a step runs join the next one (continuous batching across clients).
Each delta holds new tokens of one sample (``Delta.index``; n > 1 samples: engine/group.py), with
their logprobs when asked; a sample's last delta has its ``finish_reason``, the request's last
delta its ``output`` (every sample). P of a PD hand-off (``export``) gets its first token as soon
as it is sampled, with the manifest's names (``Delta.export``), and its output once the pool
acked the prompt's blocks (``output.handoff``).
A step that fails fails its own requests (their final output has ``finish_reason="error"``,
``error_kind="internal"``) and the loop goes on; the loop stops on an error only when the core is
closed, the GPU is lost, or ``max_step_failures`` steps in a row raise with no request to blame.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from kvtier.engine.core import EngineCore
from kvtier.engine.fatal import DeviceLost, device_lost
from kvtier.engine.outputs import RequestOutput
from kvtier.engine.request import Request
from kvtier.engine.stats_log import StatsLog

log = logging.getLogger(__name__)


def metrics_snapshot(core: EngineCore) -> dict:
    """What /metrics needs from the engine: the cache's counters, and (used, total) blocks per tier."""
    cache = core.cache
    s = cache.stats.as_dict()
    return {
        "bytes_moved": s["bytes_moved"],
        "evictions": s["evictions"],
        "failures": s["failures"],
        "pending_ops": cache.num_pending_ops,
        "tier_blocks": {
            "device": (cache.device_pool.num_used, cache.device_pool.num_blocks),
            "host": (cache.host_pool.num_used, cache.host_pool.num_blocks),
        },
    }


def leak_check(core: EngineCore) -> dict:
    """Land every copy, then count what is left and check the cache's invariants (DESIGN §5): with
    no request in the engine, every block is free or the tree's (the soak's last check)."""
    core.drain()
    cache = core.cache
    out: dict[str, Any] = {
        "requests_left": len(core.scheduler.running) + len(core.scheduler.waiting),
        "copies_in_flight": core.transfer.num_in_flight,
        "storage_in_flight": core.storage.num_in_flight if core.storage is not None else 0,
        "device_blocks_used": cache.device_pool.num_used,
        "host_blocks_used": cache.host_pool.num_used,
    }
    try:
        cache.assert_invariants()
        out["invariants"] = "ok"
    except AssertionError as e:
        out["invariants"] = f"violated: {e}"
    return out


def kv_events(core: EngineCore, since: int) -> dict:
    """The engine's KV events after number ``since`` (cache/events.py), the first call turning
    them on: ``{"seq", "events"}``, or ``{"seq", "gap": true}`` when some are no longer kept
    (or ``since`` is past the last: another engine's numbers): the reader takes a snapshot."""
    ev = core.cache.events
    ev.enable()
    if not isinstance(since, int) or since < 0:
        raise ValueError(f"since must be an event number >= 0, got {since!r}")
    got = ev.since(since) if since <= ev.seq else None
    return {"seq": ev.seq, "gap": True} if got is None else {"seq": ev.seq, "events": got}


def kv_snapshot(core: EngineCore) -> dict:
    """Every block the engine holds per tier now, the number of the last event it includes, and
    what a router needs to key tokens as this engine does (cache/keys.py)."""
    cache = core.cache
    cache.events.enable()
    out = cache.events.snapshot(cache.tree)
    fp = cache.fingerprint
    out.update(block_size=cache.block_size, hash=cache.hash_name, fingerprint=fp.encode().hex() if fp is not None else "")
    # its pool objects' names (storage/client.py): one per tensor-parallel rank of each block
    out["storage_shards"] = core.storage.tp_size if core.storage is not None else None
    return out


# what a caller may ask of the engine by name (the only calls an engine process answers)
CALLS: dict[str, Callable[..., Any]] = {
    "cache_stats": lambda core: core.cache_stats(),
    "metrics": metrics_snapshot,
    "requests": lambda core: len(core.scheduler.running) + len(core.scheduler.waiting),
    "leak_check": leak_check,
    "reset_prefix_cache": lambda core: core.cache.reset_prefix_cache(),
    "kv_events": kv_events,
    "kv_snapshot": kv_snapshot,
}


class QueueFull(RuntimeError):
    """More samples wait for admission than ``max_queue``: the caller should retry later (503)."""


class EngineDead(RuntimeError):
    """The engine stopped (closed, or a step raised): no request can be served."""


@dataclass(slots=True)
class Delta:
    """New tokens of one sample (``index``, 0..n-1) of a request since that sample's last delta.
    ``finish_reason`` is set on a sample's last delta; ``output`` (every sample) on the request's
    very last one. ``logprobs``: one entry per token of ``token_ids`` (``SamplingParams.logprobs``
    set), as in ``CompletionOutput.logprobs``."""

    token_ids: list[int]
    output: RequestOutput | None = None
    index: int = 0
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    export: dict | None = None  # P of a hand-off, on its first token's delta: the blocks on their way
    # a request's first delta: [prompt tokens not computed, {tier: tokens}] (known once admitted;
    # the output has them too), so that a stream can say them with its first token
    cached: list | None = None


class Sink:
    """Where one request's deltas go (``push``), and how many tokens of each sample went."""

    __slots__ = ("req", "sent", "ended")

    def __init__(self, req: Request) -> None:
        self.req = req
        self.sent = [0] * req.params.n  # tokens sent, per sample
        self.ended: set[int] = set()  # samples whose finish_reason was sent

    def delta(self, index: int, token_ids: list[int], logprobs: list | None, finish_reason: str | None) -> Delta | None:
        """Sample ``index``'s delta since the last one (None: nothing new)."""
        start, end = self.sent[index], len(token_ids)
        if end <= start and (finish_reason is None or index in self.ended):
            return None
        self.sent[index] = end
        if finish_reason is not None:
            self.ended.add(index)
        return Delta(
            list(token_ids[start:end]),
            index=index,
            finish_reason=finish_reason,
            logprobs=None if logprobs is None else list(logprobs[start:end]),
        )

    def push(self, item: Delta | BaseException) -> None:
        raise NotImplementedError


Reply = Callable[[Any, "BaseException | None"], None]


class EngineLoop:
    def __init__(
        self,
        core: EngineCore,
        next_command: Callable[[bool], tuple | None],
        idle_wait: float = 0.05,
        max_step_failures: int = 3,
        stats_interval: float = 0.0,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        """``next_command(block)``: the next command, or None if there is none (``block``: wait up
        to ``idle_wait`` s for one first). ``on_dead(error)`` runs once the loop stopped on an
        error, before the requests in flight are failed."""
        if max_step_failures < 1:
            raise ValueError(f"max_step_failures must be >= 1, got {max_step_failures}")
        self.core = core
        self.next_command = next_command
        self.idle_wait = idle_wait
        self.max_step_failures = max_step_failures
        self.on_dead = on_dead
        self.stats = StatsLog(stats_interval)  # a line every stats_interval s of work (0: none)
        self.sinks: dict[str, Sink] = {}
        self.error: BaseException | None = None
        self.stopping = False
        self.samples_taken = 0  # samples of every add taken so far (the callers count what they sent)
        self.waiting_samples = 0  # samples of the requests waiting for admission, after the last step

    def run(self, after_iteration: Callable[[], None] | None = None) -> None:
        """Steps until :meth:`stop` or an error; then every request in flight fails (EngineDead)."""
        core = self.core
        failures = 0  # steps in a row that raised (no request to blame)
        try:
            if core.device.type == "cuda":
                torch.cuda.set_device(core.device)  # a new thread's current device is cuda:0
            while not self.stopping:
                self._take_commands(block=not core.has_unfinished())
                # no request: copies in flight still land and stage the next (a landed
                # backup's put to the pool); else a step. Either may fail transiently.
                idle = not core.has_unfinished()
                started = time.perf_counter()
                try:
                    if idle:
                        core.pump_idle()
                    finished = [] if idle else core.step()
                except Exception as e:  # maybe transient: dead only if it keeps failing
                    failures += 1
                    if failures >= self.max_step_failures or core.closed or device_lost(e):
                        raise
                    log.exception(
                        "engine %s failed with no request to blame (%d in a row)", "idle pump" if idle else "step", failures
                    )
                    time.sleep(self.idle_wait)
                    continue
                failures = 0
                if not idle:
                    self._emit(finished)
                self.waiting_samples = sum(r.params.n for r in core.scheduler.waiting)
                if self.stats.interval:
                    if not idle:
                        self.stats.note_step(time.perf_counter() - started)
                    self._log_stats()
                if after_iteration is not None:
                    after_iteration()
        except BaseException as e:  # reported to every caller, then the loop ends
            if device_lost(e):
                log.critical(
                    "the GPU can run nothing more (%s); failing every request in flight, the engine stops", e, exc_info=e
                )
                e = e if isinstance(e, DeviceLost) else DeviceLost(str(e))
            else:
                log.exception("engine step failed; failing every request in flight")
            self.error = e
        if self.error is not None and self.on_dead is not None:
            try:
                self.on_dead(self.error)
            except Exception:  # the engine is gone either way
                log.exception("on_dead callback failed")
        err = EngineDead(f"the engine stopped: {self.error!r}" if self.error else "the engine is shutting down")
        for rid, sink in list(self.sinks.items()):
            sink.push(err)
            try:
                core.abort(rid)
            except Exception:  # the engine is gone either way
                pass
        self.sinks.clear()
        while (cmd := self.next_command(False)) is not None:  # callers still waiting on a call() or an add
            if cmd[0] == "add":
                cmd[1].push(err)
            elif cmd[0] == "call":
                cmd[2](None, err)

    def stop(self) -> None:
        self.stopping = True

    def _log_stats(self) -> None:
        try:
            self.stats.maybe_log(self.core)
        except Exception:  # a log line must never stop the engine: no more of them
            log.exception("stats line failed; --log-stats-interval is off from now on")
            self.stats.interval = 0

    def _take_commands(self, block: bool) -> None:
        cmd = self.next_command(block)
        while cmd is not None:
            kind = cmd[0]
            if kind == "add":
                sink = cmd[1]
                self.samples_taken += sink.req.params.n
                try:
                    self.core.enqueue(sink.req)
                    self.sinks[sink.req.request_id] = sink
                except Exception as e:  # maybe transient: dead only if it keeps failing
                    sink.push(e)
            elif kind == "abort":
                if self.sinks.pop(cmd[1], None) is not None:
                    self.core.abort(cmd[1])
            elif kind == "call":
                fn, reply, args = cmd[1], cmd[2], cmd[3] if len(cmd) > 3 else ()
                try:
                    result = (CALLS[fn] if isinstance(fn, str) else fn)(self.core, *args)
                except Exception as e:  # maybe transient: dead only if it keeps failing
                    reply(None, e)
                else:
                    reply(result, None)
            cmd = self.next_command(False)

    def _emit(self, finished: list[RequestOutput]) -> None:
        """Each sample's new tokens since its last delta; a finished request's rest, per sample
        (from its output), the last delta carrying the output."""
        done = {o.request_id: o for o in finished}
        for rid, sink in list(self.sinks.items()):
            out = done.get(rid)
            rows: list[tuple[int, list[int], list | None, str | None]]
            if out is not None:
                rows = [(c.index, c.token_ids, c.logprobs, c.finish_reason) for c in out.outputs]
            else:
                rows = self.core.progress(sink.req)
            export = None
            if sink.req.export and out is None:  # P of a hand-off: its token once its export started
                if sink.sent[0]:
                    continue  # sent: the output comes once the pool acked
                export = self.core.export_names(rid)
                if export is None:
                    continue
            first = not any(sink.sent)
            deltas = [d for d in (sink.delta(*row) for row in rows) if d is not None]
            if export is not None and deltas:
                deltas[0].export = export
            if first and deltas and out is None:
                req = sink.req
                deltas[0].cached = [req.num_cached_tokens or 0, dict(req.cached_tokens_by_tier)]
            if out is not None:
                if not deltas:  # (the last sample's finish is always unsent; never lose the output)
                    deltas.append(Delta([], index=out.outputs[0].index))
                deltas[-1].output = out
                del self.sinks[rid]
            for d in deltas:
                sink.push(d)
