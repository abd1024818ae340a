"""The serving front end: the engine core's step loop on its own thread, streaming tokens to
asyncio callers (the HTTP server).

::

    asyncio callers                       engine thread
    generate(prompt) ─ make_request ─► inbox ─► enqueue ─► step() ─► step() ─► ...
          ▲ (validated in the caller: a bad                          │ new tokens of every
          │  request never reaches the engine)                       │ request, each step
          └──────────── per-request asyncio.Queue ◄── call_soon_threadsafe ┘

Requests that arrive while a step runs join the next one (continuous batching across clients).
Each delta holds new tokens of one sample (``Delta.index``; n > 1 samples: engine/group.py), with
their logprobs when asked; a sample's last delta has its ``finish_reason``, the request's last
delta its ``output`` (every sample). P of a PD hand-off (``export``) gets its first token as soon
as it is sampled, with the manifest's names (``Delta.export``), and its output once the pool
acked the prompt's blocks (``output.handoff``).
A step that fails fails its own requests (their final output has ``finish_reason="error"``,
``error_kind="internal"``) and the loop goes on; the engine is dead only when it is closed or
``max_step_failures`` steps in a row raise with no request to blame (``EngineDead`` then).
A request whose id is in the engine already is refused with ValueError (HTTP 400).
A caller that goes away (client disconnect, cancellation) aborts its request: its blocks return
to the pool at the next step boundary. Everything that touches engine state runs on the engine
thread (``call(fn)`` for stats); callers only read immutable results.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Callable

import torch

from kvtier.engine.core import EngineCore
from kvtier.engine.fatal import DeviceLost, device_lost
from kvtier.engine.group import check_n
from kvtier.engine.outputs import RequestOutput
from kvtier.engine.request import Request
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.stats_log import StatsLog

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """More requests wait for admission than ``max_queue``: the caller should retry later (503)."""


class EngineDead(RuntimeError):
    """The engine thread stopped (closed, or a step raised): no request can be served."""


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


class _Sink:
    __slots__ = ("loop", "queue", "req", "sent", "ended")

    def __init__(self, loop: asyncio.AbstractEventLoop, req: Request) -> None:
        self.loop, self.req = loop, req
        self.queue: asyncio.Queue[Delta | BaseException] = asyncio.Queue()
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
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            pass


class AsyncEngine:
    def __init__(
        self,
        core: EngineCore,
        max_queue: int = 1024,
        idle_wait: float = 0.05,
        max_step_failures: int = 3,
        stats_interval: float = 0.0,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        """``on_dead(error)`` is called on the engine thread once the loop stopped on an error,
        before the requests in flight are failed (``kvtier serve`` exits on it: a dead engine
        never serves again)."""
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if max_step_failures < 1:
            raise ValueError(f"max_step_failures must be >= 1, got {max_step_failures}")
        self.max_step_failures = max_step_failures
        self._stats = StatsLog(stats_interval)  # a line every stats_interval s of work (0: none)
        self.core = core
        self.max_queue = max_queue
        self._idle_wait = idle_wait
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._num_queued = 0  # added, not yet admitted (approximate, for 503)
        self._error: BaseException | None = None
        self.on_dead = on_dead
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvtier-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers (asyncio)
    @property
    def num_running(self) -> int:
        return len(self.core.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.core.scheduler.waiting)

    def make_request(
        self, prompt: Any, params: SamplingParams, cache_salt: str | None = None, request_id: str | None = None, **handoff: Any
    ) -> Request:
        """Validate (ValueError names the problem) without touching engine state."""
        self.check_alive()
        req = self.core.make_request(prompt, params, cache_salt, request_id, **handoff)
        check_n(req)
        return req

    async def generate(self, req: Request) -> AsyncGenerator[Delta, None]:
        """Stream ``req`` (from :meth:`make_request`): deltas of new tokens, the last one with the
        finished output. Leaving the iteration early aborts the request."""
        self.check_alive()
        if self.num_waiting + self._num_queued >= self.max_queue:
            raise QueueFull(
                f"{self.num_waiting + self._num_queued} requests are waiting (max_queue={self.max_queue}); retry later"
            )
        sink = _Sink(asyncio.get_running_loop(), req)
        self._num_queued += 1
        self._inbox.put(("add", sink))
        done = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.output is not None:
                    done = True
                    return
        finally:
            if not done:
                self._inbox.put(("abort", sink))  # the sink: never another request of that id

    async def call(self, fn: Callable[[EngineCore], Any]) -> Any:
        """Run ``fn(core)`` on the engine thread between steps (stats, cache inspection)."""
        self.check_alive()
        fut = asyncio.get_running_loop().create_future()
        self._inbox.put(("call", fn, fut))
        return await fut

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop (requests in flight fail with EngineDead), then close the core."""
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout)
        self.core.close()

    def check_alive(self) -> None:
        """EngineDead if the engine stopped or is shutting down."""
        if self._error is not None:
            raise EngineDead(f"the engine stopped: {self._error!r}")
        if self._stop.is_set():
            raise EngineDead("the engine is shutting down")

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        core = self.core
        failures = 0  # steps in a row that raised (no request to blame)
        try:
            if core.device.type == "cuda":
                torch.cuda.set_device(core.device)  # a new thread's current device is cuda:0
            while not self._stop.is_set():
                self._take_inbox(block=not core.has_unfinished())
                # no request: copies in flight still land and stage the next (a landed
                # backup's put to the pool); else a step. Either may fail transiently.
                idle = not core.has_unfinished()
                started = time.perf_counter()
                try:
                    if idle:
                        core.pump_idle()
                    finished = [] if idle else core.step()
                except Exception as e:  # noqa: BLE001 - maybe transient: dead only if it keeps failing
                    failures += 1
                    if failures >= self.max_step_failures or core.closed or device_lost(e):
                        raise
                    log.exception(
                        "engine %s failed with no request to blame (%d in a row)", "idle pump" if idle else "step", failures
                    )
                    self._stop.wait(self._idle_wait)
                    continue
                failures = 0
                if not idle:
                    self._emit(finished)
                if self._stats.interval:
                    if not idle:
                        self._stats.note_step(time.perf_counter() - started)
                    self._log_stats()
        except BaseException as e:  # noqa: BLE001 - reported to every caller, then the loop ends
            if device_lost(e):
                log.critical(
                    "the GPU can run nothing more (%s); failing every request in flight, the engine stops", e, exc_info=e
                )
                e = e if isinstance(e, DeviceLost) else DeviceLost(str(e))
            else:
                log.exception("engine step failed; failing every request in flight")
            self._error = e
        if self._error is not None and self.on_dead is not None:
            try:
                self.on_dead(self._error)
            except Exception:  # noqa: BLE001 - the engine is gone either way
                log.exception("on_dead callback failed")
        err = EngineDead(f"the engine stopped: {self._error!r}" if self._error else "the engine is shutting down")
        for rid, sink in list(self._sinks.items()):
            sink.push(err)
            try:
                core.abort(rid)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        self._sinks.clear()
        while True:  # callers still waiting on a call() or an add
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                cmd[1].push(err)
            elif cmd[0] == "call":
                self._resolve(cmd[2], exc=err)

    @property
    def num_streams(self) -> int:
        """Requests whose callers still wait for deltas (a leak check: 0 once all ended)."""
        return len(self._sinks)

    @property
    def error(self) -> BaseException | None:
        """What stopped the engine, if an error did (None while it runs or after a shutdown)."""
        return self._error

    def _log_stats(self) -> None:
        try:
            self._stats.maybe_log(self.core)
        except Exception:  # noqa: BLE001 - a log line must never stop the engine: no more of them
            log.exception("stats line failed; --log-stats-interval is off from now on")
            self._stats.interval = 0

    def _take_inbox(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=self._idle_wait) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind = cmd[0]
            if kind == "add":
                sink = cmd[1]
                self._num_queued -= 1
                try:
                    self.core.enqueue(sink.req)
                    self._sinks[sink.req.request_id] = sink
                except Exception as e:  # noqa: BLE001 - the caller gets it (e.g. a closed engine)
                    sink.push(e)
            elif kind == "abort":
                rid = cmd[1].req.request_id
                if self._sinks.get(rid) is cmd[1]:
                    del self._sinks[rid]
                    self.core.abort(rid)
            elif kind == "call":
                try:
                    self._resolve(cmd[2], result=cmd[1](self.core))
                except Exception as e:  # noqa: BLE001
                    self._resolve(cmd[2], exc=e)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    @staticmethod
    def _resolve(fut: asyncio.Future, result: Any = None, exc: BaseException | None = None) -> None:
        def set_() -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        try:
            fut.get_loop().call_soon_threadsafe(set_)
        except RuntimeError:
            pass

    def _emit(self, finished: list[RequestOutput]) -> None:
        """Each sample's new tokens since its last delta; a finished request's rest, per sample
        (from its output), the last delta carrying the output."""
        done = {o.request_id: o for o in finished}
        for rid, sink in list(self._sinks.items()):
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
            deltas = [d for d in (sink.delta(*row) for row in rows) if d is not None]
            if export is not None and deltas:
                deltas[0].export = export
            if out is not None:
                if not deltas:  # (the last sample's finish is always unsent; never lose the output)
                    deltas.append(Delta([], index=out.outputs[0].index))
                deltas[-1].output = out
                del self._sinks[rid]
            for d in deltas:
                sink.push(d)
