"""The engine's serving loop: commands in, a step, what changed out, as engine/wire.py's
messages. It is the main loop of an engine process (engine/proc.py: what ``kvtier serve`` runs)
or of a thread of the caller's process (``EngineClient.in_thread``); either way it reads and says
the same messages, through ``recv`` and ``send``::

    recv ─► EngineRequest ─► core.make_request (checked again; a refusal is its RequestDelta's
            │                 error) ─► core.enqueue: it joins the next step
            ├ Abort ─► core.abort        ├ Call ─► CALLS[name](core, *args) ─► a CallResult
            └ Stop ─► the loop ends after this iteration
    core.step(updated) ─► a RequestDelta for each request the step names (new tokens per
                          sample) and each it finished (with its output)
    the iteration's end ─► one EngineOutputs (deltas, call results, status when it changed) ─► send

Requests that arrive while a step runs join the next one (continuous batching across clients).
A delta holds the new tokens of each sample that has some (``SampleDelta.index``; n > 1 samples:
engine/group.py), with their logprobs when asked; a sample's last has its ``finish_reason``, the
request's last delta its ``output`` (every sample). Only the requests the step says may have
moved are looked at (``EngineCore.step(updated)``), never every open one. P of a PD hand-off
(``export``) gets its first token as soon as it is sampled, with the manifest's names
(``RequestDelta.export``), and its output once the pool acked the prompt's blocks
(``output.handoff``).
A step that fails fails its own requests (their final output has ``finish_reason="error"``,
``error_kind="internal"``) and the loop goes on; the loop stops on an error only when the core is
closed, the GPU is lost, or ``max_step_failures`` steps in a row raise with no request to blame.
Then every request in flight gets a ``dead`` error, and the last message says why (``dead``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from kvtier.engine.core import EngineCore
from kvtier.engine.fatal import DeviceLost, device_lost
from kvtier.engine.group import SampleProgress
from kvtier.engine.outputs import RequestOutput
from kvtier.engine.request import Request
from kvtier.engine.stats_log import StatsLog
from kvtier.engine.wire import (
    Abort,
    BadCommand,
    CachedTokens,
    Call,
    CallResult,
    EngineOutputs,
    EngineRequest,
    EngineStatus,
    RequestDelta,
    RequestError,
    SampleDelta,
    Stop,
    decode_command,
    encode,
    error_kind,
    first_token_stages,
    mm_input,
)

log = logging.getLogger(__name__)
MAX_STEP_FAILURES = 3  # steps in a row that raise with no request to blame before the engine stops
STATUS_EVERY_S = 0.25  # the pool's health goes out at least this often


def metrics_snapshot(core: EngineCore) -> dict:
    """What /metrics needs from the engine: the cache's counters, and the blocks used of each tier's total."""
    cache = core.cache
    s = cache.stats.as_dict()
    return {
        "bytes_moved": s["bytes_moved"],
        "evictions": s["evictions"],
        "failures": s["failures"],
        "pending_ops": cache.num_pending_ops,
        "tier_blocks": {
            "device": {"used": cache.device_pool.num_used, "total": cache.device_pool.num_blocks},
            "host": {"used": cache.host_pool.num_used, "total": cache.host_pool.num_blocks},
        },
    }


def held_blocks(core: EngineCore) -> dict:
    """Blocks held by requests now (in use and not the tree's) per tier, and whether any request
    is still in the engine: what a caller that aborted its requests waits to see return to 0."""
    cache = core.cache
    return {
        "unfinished": core.has_unfinished(),
        "device": cache.device_pool.num_used - cache.tree.num_device_copies,
        "host": cache.host_pool.num_used - cache.tree.num_host_copies,
    }


def leak_check(core: EngineCore) -> dict:
    """Land every copy, then count what is left and check the cache's invariants (DESIGN §5): with
    no request in the engine, every block is free or the tree's (the soak's last check). Call it
    on a quiet engine: landing the step in flight drops its outputs."""
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


# what a caller may ask of the engine, by name (Call): the only way into engine state from outside
CALLS: dict[str, Callable[..., Any]] = {
    "cache_stats": lambda core: core.cache_stats(),
    "metrics": metrics_snapshot,
    "requests": lambda core: len(core.scheduler.running) + len(core.scheduler.waiting),
    "held_blocks": held_blocks,
    "leak_check": leak_check,
    "reset_prefix_cache": lambda core: core.cache.reset_prefix_cache(),
    "kv_events": kv_events,
    "kv_snapshot": kv_snapshot,
}


def make_request(core: EngineCore, msg: EngineRequest) -> Request:
    """The engine's Request of ``msg`` (checked again here: the hand-off's manifest against this
    engine's blocks, among the rest); ValueError naming the problem."""
    return core.make_request(
        msg.prompt_token_ids,
        msg.params,
        msg.cache_salt,
        msg.request_id,
        handoff=msg.handoff,
        export=msg.export,
        owner=msg.owner or None,
        priority=msg.priority,
        mm=tuple(mm_input(d) for d in msg.images) if msg.images or core.config.vision is not None else None,
    )


class Stream:
    """A request whose caller waits for its deltas: how many tokens of each sample went out, and
    which samples' ends did."""

    __slots__ = ("req", "sent", "ended")

    def __init__(self, req: Request) -> None:
        self.req = req
        self.sent = [0] * req.params.n  # tokens sent, per sample
        self.ended: set[int] = set()  # samples whose finish_reason was sent

    def deltas(self, rows: list[SampleProgress]) -> list[SampleDelta]:
        """Each sample's new tokens (and its end) since the last deltas; none for a sample with nothing new."""
        out = []
        for row in rows:
            i, start, end = row.index, self.sent[row.index], len(row.token_ids)
            if end <= start and (row.finish_reason is None or i in self.ended):
                continue
            self.sent[i] = end
            if row.finish_reason is not None:
                self.ended.add(i)
            lps = None if row.logprobs is None else list(row.logprobs[start:end])
            out.append(SampleDelta(i, list(row.token_ids[start:end]), lps, row.finish_reason))
        return out


class EngineLoop:
    def __init__(
        self,
        core: EngineCore,
        recv: Callable[[float], bytes | None],
        send: Callable[[bytes], None],
        idle_wait: float = 0.05,
        max_step_failures: int = MAX_STEP_FAILURES,
        stats_interval: float = 0.0,
        after_iteration: Callable[[], None] | None = None,
    ) -> None:
        """``recv(timeout)``: the next message, or None once ``timeout`` s passed without one (0:
        only what is there); ``send(data)``: one message to the caller. ``after_iteration`` runs
        at the end of each iteration, before its message goes (an engine process checks its
        server is still there)."""
        if max_step_failures < 1:
            raise ValueError(f"max_step_failures must be >= 1, got {max_step_failures}")
        self.core = core
        self.recv, self.send = recv, send
        self.idle_wait = idle_wait
        self.max_step_failures = max_step_failures
        self.after_iteration = after_iteration
        self.stats = StatsLog(stats_interval)  # a line every stats_interval s of work (0: none)
        self.streams: dict[str, Stream] = {}
        self.error: BaseException | None = None
        self.stopping = False
        self.samples_taken = 0  # samples of every request taken so far, refused ones too
        self.waiting_samples = 0  # samples of the requests waiting for admission, after the last step
        self.out = EngineOutputs()  # what this iteration says (sent at its end)
        self._status: tuple[int, int, int, int] | None = None  # the last counts sent
        self._pool_at = 0.0  # when the pool's health last went out

    def run(self) -> None:
        """Steps until :meth:`stop`, a Stop or an error; then every request in flight fails (dead)."""
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
                updated: set[str] = set()
                try:
                    if idle:
                        core.pump_idle()
                    finished = [] if idle else core.step(updated)
                except Exception as e:  # maybe transient: dead only if it keeps failing
                    failures += 1
                    if failures >= self.max_step_failures or core.closed or device_lost(e):
                        raise
                    log.exception(
                        "engine %s failed with no request to blame (%d in a row)", "idle pump" if idle else "step", failures
                    )
                    self._flush()  # (what the commands taken said: call results, refusals)
                    time.sleep(self.idle_wait)
                    continue
                failures = 0
                if not idle:
                    self._emit(finished, updated)
                self.waiting_samples = sum(r.params.n for r in core.scheduler.waiting)
                if self.stats.interval:
                    if not idle:
                        self.stats.note_step(time.perf_counter() - started)
                    self._log_stats()
                self._flush()
        except BaseException as e:  # reported to every caller, then the loop ends
            if device_lost(e):
                log.critical(
                    "the GPU can run nothing more (%s); failing every request in flight, the engine stops", e, exc_info=e
                )
                e = e if isinstance(e, DeviceLost) else DeviceLost(str(e))
            else:
                log.exception("engine step failed; failing every request in flight")
            self.error = e
        self._end()

    def stop(self) -> None:
        """End the loop after this iteration (the requests in flight fail with EngineDead)."""
        self.stopping = True

    # ------------------------------------------------------------------ inside
    def _flush(self) -> None:
        """The iteration's status (when it changed, and the pool's health when due), then its message."""
        self._note_status()
        if self.after_iteration is not None:
            self.after_iteration()
        if self.out:
            self.send(encode(self.out))
            self.out = EngineOutputs()

    def _note_status(self) -> None:
        sched = self.core.scheduler
        counts = (len(sched.running), len(sched.waiting), self.waiting_samples, self.samples_taken)
        storage = self.core.storage
        now = time.monotonic()
        pool_due = storage is not None and now - self._pool_at >= STATUS_EVERY_S
        if counts == self._status and not pool_due:
            return
        pool = None
        if pool_due and storage is not None:
            self._pool_at = now
            try:
                pool = dict(storage.health())
            except Exception as e:  # a probe that fails says the pool is not ok
                pool = {"ok": False, "reason": f"{type(e).__name__}: {e}"}
        self._status = counts
        self.out.status = EngineStatus(*counts, pool)

    def _end(self) -> None:
        """Every request in flight fails (the engine stopped, or is shutting down); the calls and
        adds still queued are answered so; the last message says why, if an error stopped it."""
        if self.error is not None:
            why = f"the engine stopped: {self.error!r}"
        else:
            why = "the engine is shutting down"
        for rid in list(self.streams):
            self.out.deltas.append(RequestDelta(rid, error=RequestError("dead", why)))
            try:
                self.core.abort(rid)
            except Exception:  # the engine is gone either way
                pass
        self.streams.clear()
        while (data := self.recv(0)) is not None:  # callers still waiting on a call or an add
            try:
                cmd = decode_command(data)
            except BadCommand as e:
                if e.request_id is not None:
                    self.out.deltas.append(RequestDelta(e.request_id, error=RequestError("dead", why)))
                continue
            if isinstance(cmd, EngineRequest):
                self.out.deltas.append(RequestDelta(cmd.request_id, error=RequestError("dead", why)))
            elif isinstance(cmd, Call):
                self.out.results.append(CallResult(cmd.call_id, error=f"EngineDead: {why}"))
        if self.error is not None:
            self.out.dead = f"{type(self.error).__name__}: {self.error}"
        try:
            self._flush()
        except Exception:  # nobody left to tell
            log.exception("the engine's last message could not be sent")

    def _log_stats(self) -> None:
        try:
            self.stats.maybe_log(self.core)
        except Exception:  # a log line must never stop the engine: no more of them
            log.exception("stats line failed; --log-stats-interval is off from now on")
            self.stats.interval = 0

    def _take_commands(self, block: bool) -> None:
        data = self.recv(self.idle_wait if block else 0)
        while data is not None:
            self._command(data)
            data = self.recv(0)

    def _command(self, data: bytes) -> None:
        try:
            cmd = decode_command(data)
        except BadCommand as e:
            log.warning("a message the engine cannot take: %s", e)
            if e.request_id is not None:
                self.samples_taken += e.samples
                self.out.deltas.append(RequestDelta(e.request_id, error=RequestError("value", str(e))))
            return
        if isinstance(cmd, EngineRequest):
            self.samples_taken += cmd.params.n
            try:
                req = make_request(self.core, cmd)
                self.core.enqueue(req)
            except Exception as e:  # refused (ValueError: 400), or a transient failure of this request alone
                self.out.deltas.append(RequestDelta(cmd.request_id, error=RequestError(error_kind(e), str(e))))
                return
            self.streams[req.request_id] = Stream(req)
        elif isinstance(cmd, Abort):
            if self.streams.pop(cmd.request_id, None) is not None:
                self.core.abort(cmd.request_id)
        elif isinstance(cmd, Call):
            try:
                fn = CALLS.get(cmd.name)
                if fn is None:
                    raise ValueError(f"no engine call {cmd.name!r}; the calls are {', '.join(CALLS)}")
                self.out.results.append(CallResult(cmd.call_id, fn(self.core, *cmd.args)))
            except Exception as e:  # the caller's error, not the engine's
                self.out.results.append(CallResult(cmd.call_id, error=f"{type(e).__name__}: {e}"))
        elif isinstance(cmd, Stop):
            if not self.stopping:
                log.info("the engine stops: its server asked")
            self.stop()

    def _emit(self, finished: list[RequestOutput], updated: set[str]) -> None:
        """A delta for each request the step finished or says may have new tokens."""
        done = {o.request_id: o for o in finished}
        for rid in [*done, *(r for r in updated if r not in done)]:
            stream = self.streams.get(rid)
            if stream is None:  # aborted, or not a served request
                continue
            out = done.get(rid)
            delta = self._delta(stream, out)
            if delta is not None:
                self.out.deltas.append(delta)
            if out is not None:
                del self.streams[rid]

    def _delta(self, stream: Stream, out: RequestOutput | None) -> RequestDelta | None:
        """``stream``'s delta: each sample's new tokens (a finished request's rest, from its
        output, which the delta carries), or None if it has nothing to say yet."""
        req = stream.req
        if out is not None:
            rows = [SampleProgress(c.index, c.token_ids, c.logprobs, c.finish_reason) for c in out.outputs]
        else:
            rows = self.core.progress(req)
        export = None
        if req.export and out is None:  # P of a hand-off: its token once its export started
            if stream.sent[0]:
                return None  # sent: the output comes once the pool acked
            export = self.core.export_names(req.request_id)
            if export is None:
                return None
        first = not any(stream.sent)
        samples = stream.deltas(rows)
        if out is None and not samples:
            return None
        delta = RequestDelta(req.request_id, samples, output=out, export=export)
        if first and out is None:  # a stream can say what was cached with its first token
            delta.cached = CachedTokens(req.num_cached_tokens or 0, dict(req.cached_tokens_by_tier))
        if first and any(s.token_ids for s in samples):  # where its time went, as this process measured it
            delta.stages = first_token_stages(req.metrics if out is None else out.metrics or req.metrics)
        return delta
