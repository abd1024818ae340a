"""The serving front end on one interpreter: the engine's loop (engine/loop.py) on a thread,
streaming tokens to asyncio callers. ``kvtier serve`` runs the loop in a process of its own
instead (engine/client.py, engine/proc.py), with the same interface; tests, the soak and
embedding applications use this one.

::

    asyncio callers                       engine thread (EngineLoop)
    generate(prompt) ─ make_request ─► inbox ─► enqueue ─► step() ─► step() ─► ...
          ▲ (validated in the caller: a bad                          │ new tokens of every
          │  request never reaches the engine)                       │ request, each step
          └──────────── per-request asyncio.Queue ◄── call_soon_threadsafe ┘

``max_queue`` bounds the samples (a request's ``n``) waiting for admission: a request that would
pass it gets QueueFull (HTTP 503) at once; one that asks for more samples than ``max_queue``
could ever hold is a ValueError (400).
A request whose id is in the engine already is refused with ValueError (HTTP 400).
A caller that goes away (client disconnect, cancellation) aborts its request: its blocks return
to the pool at the next step boundary. Everything that touches engine state runs on the engine
thread (``call(fn)`` for stats); callers only read immutable results.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, AsyncGenerator, Callable

from kvtier.engine.core import EngineCore
from kvtier.engine.group import check_n
from kvtier.engine.loop import Delta, EngineDead, EngineLoop, QueueFull, Sink
from kvtier.engine.params import SamplingParams
from kvtier.engine.request import Request

__all__ = ["AsyncEngine", "Delta", "EngineDead", "QueueFull", "check_samples"]


def check_samples(n: int, max_queue: int) -> None:
    """ValueError unless ``n`` samples fit a queue of ``max_queue`` (they never would: not a 503)."""
    if n > max_queue:
        raise ValueError(f"{n} samples in one request: more than the server queues (--max-queue {max_queue})")


def check_queue(waiting: int, n: int, max_queue: int) -> None:
    """QueueFull if ``n`` more samples do not fit beside ``waiting``."""
    if waiting + n > max_queue:
        waits = "1 sample is" if waiting == 1 else f"{waiting} samples are"
        raise QueueFull(
            f"{waits} waiting and this request adds {n}: more than the queue holds (max_queue={max_queue}, "
            "kvtier serve --max-queue); retry later"
        )


class _AsyncSink(Sink):
    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop, req: Request) -> None:
        super().__init__(req)
        self.loop = loop
        self.queue: asyncio.Queue[Delta | BaseException] = asyncio.Queue()

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
        self.core = core
        self.max_queue = max_queue
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._loop = EngineLoop(core, self._next_command, idle_wait, max_step_failures, stats_interval, on_dead)
        self._samples_sent = 0  # samples of every add put in the inbox (the loop counts those it took)
        self._thread = threading.Thread(target=self._loop.run, name="kvtier-engine", daemon=True)
        self._thread.start()

    def _next_command(self, block: bool) -> tuple | None:
        try:
            return self._inbox.get(timeout=self._loop.idle_wait) if block else self._inbox.get_nowait()
        except queue.Empty:
            return None

    # ------------------------------------------------------------------ callers (asyncio)
    @property
    def num_running(self) -> int:
        return len(self.core.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.core.scheduler.waiting)

    @property
    def num_queued_samples(self) -> int:
        """Samples waiting for admission or on their way to the engine (what ``max_queue`` bounds)."""
        return self._loop.waiting_samples + self._samples_sent - self._loop.samples_taken

    def make_request(
        self, prompt: Any, params: SamplingParams, cache_salt: str | None = None, request_id: str | None = None, **options: Any
    ) -> Request:
        """Validate (ValueError names the problem) without touching engine state. ``options``:
        EngineCore.make_request's (``handoff``, ``export``, ``owner``, ``priority``)."""
        self.check_alive()
        check_samples(params.n, self.max_queue)
        req = self.core.make_request(prompt, params, cache_salt, request_id, **options)
        check_n(req)
        return req

    async def generate(self, req: Request) -> AsyncGenerator[Delta, None]:
        """Stream ``req`` (from :meth:`make_request`): deltas of new tokens, the last one with the
        finished output. Leaving the iteration early aborts the request."""
        self.check_alive()
        check_queue(self.num_queued_samples, req.params.n, self.max_queue)
        sink = _AsyncSink(asyncio.get_running_loop(), req)
        self._samples_sent += req.params.n
        self._inbox.put(("add", sink))
        done = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    done = True  # refused (e.g. its id is in use) or failed: not in the engine
                    raise item
                yield item
                if item.output is not None:
                    done = True
                    return
        finally:
            if not done:
                self._inbox.put(("abort", req.request_id))

    async def call(self, fn: Callable[..., Any] | str, *args: Any) -> Any:
        """Run ``fn(core, *args)`` on the engine thread between steps (stats, cache inspection);
        ``fn`` may name one of engine/loop.py's ``CALLS``."""
        self.check_alive()
        fut = asyncio.get_running_loop().create_future()
        self._inbox.put(("call", fn, _resolver(fut), args))
        return await fut

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop (requests in flight fail with EngineDead), then close the core."""
        self._loop.stop()
        self._inbox.put(("wake",))
        self._thread.join(timeout)
        self.core.close()

    def check_alive(self) -> None:
        """EngineDead if the engine stopped or is shutting down."""
        if self._loop.error is not None:
            raise EngineDead(f"the engine stopped: {self._loop.error!r}")
        if self._loop.stopping:
            raise EngineDead("the engine is shutting down")

    @property
    def num_streams(self) -> int:
        """Requests whose callers still wait for deltas (a leak check: 0 once all ended)."""
        return len(self._loop.sinks)

    @property
    def error(self) -> BaseException | None:
        """What stopped the engine, if an error did (None while it runs or after a shutdown)."""
        return self._loop.error

    @property
    def max_step_failures(self) -> int:
        return self._loop.max_step_failures


def _resolver(fut: asyncio.Future) -> Callable[[Any, BaseException | None], None]:
    """A reply that settles ``fut`` on its own event loop (from any thread)."""

    def reply(result: Any, exc: BaseException | None) -> None:
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

    return reply
