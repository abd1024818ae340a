"""The serving process's end of an engine: the one front end ``kvtier serve``, the soak and the
tests use. The engine runs in a process of its own (``EngineClient(model, config)``: what
``kvtier serve`` runs, engine/proc.py's ``main``) or on a thread of this process
(``EngineClient.in_thread(core)``: tests, embedding applications); the client, the sockets and
the messages (engine/wire.py) are the same, only where the engine runs differs
(engine/hosts.py: ``ipc://`` sockets to a process, or ``inproc://`` ones to a thread)::

    serving process (HTTP, checks, tokenization)                   engine (process or thread)
    make_request(ids, params) ─► EngineRequest   (checked here: engine/checks.py)
    generate(req) ──── EngineRequest ──── PUSH ──► PULL ─► EngineLoop ─► step() ─► ...
        ▲                                                                  │
        └─ per-request asyncio.Queue ◄─ reader task ◄─ PULL ◄── PUSH ──────┘ EngineOutputs: a
                                                                 RequestDelta per request that
                                                                 moved, call results, status

This module imports no torch (nor the engine core): a serving process that only talks to an
engine process never loads them. Requests are checked here first, against the sizes the engine
reported when it was ready (``limits``): a bad one is a ValueError (HTTP 400) before anything is
sent. ``max_queue`` bounds the samples (a request's ``n``) waiting for admission, from the
engine's status and the samples sent since: a request that would pass it gets QueueFull (HTTP
503) at once; one that asks for more samples than ``max_queue`` could ever hold is a ValueError
(400). A caller that goes away (client disconnect, cancellation) aborts its request: its blocks
return to the pool at the next step boundary. Anything touching engine state goes through
``call(name)`` (engine/loop.py's CALLS). An engine that stops (it said so, or its process exited
without a word: killed, a crash in a kernel) fails every request in flight with EngineDead, and
``on_dead`` runs.
"""

from __future__ import annotations

import asyncio
import builtins
import itertools
import logging
import secrets
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any, AsyncGenerator, Callable, Sequence

from kvtier.engine.checks import RequestLimits, check_request, check_request_id
from kvtier.engine.config import EngineConfig
from kvtier.engine.hosts import EngineProcess, EngineThread
from kvtier.engine.params import SamplingParams
from kvtier.engine.startup import Startup
from kvtier.engine.wire import (
    ERRORS,
    Abort,
    Call,
    Command,
    EngineDead,
    EngineInfo,
    EngineMessage,
    EngineOutputs,
    EngineRequest,
    Failed,
    Phase,
    QueueFull,
    Ready,
    RequestDelta,
    Stop,
    decode_message,
    encode,
    image_data,
)
from kvtier.model.hub import resolve_model
from kvtier.model.images import MMInput

if TYPE_CHECKING:
    from kvtier.engine.core import EngineCore

log = logging.getLogger(__name__)


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


class EngineClient:
    """An engine's front end; ``limits``, ``path``, ``tokenizer``, ``config``, ``startup``: what
    the serving process knows of it (the sizes requests are checked against, its checkpoint, the
    tokenizer read from it, its options, its start)."""

    def __init__(
        self,
        model: str,
        config: EngineConfig,
        max_queue: int = 1024,
        stats_interval: float = 0.0,
        on_dead: Callable[[BaseException], None] | None = None,
        startup: Startup | None = None,
        log_level: str = "info",
        start_timeout: float | None = None,
    ) -> None:
        """Start an engine process and wait until it is ready (``startup`` mirrors its phases
        meanwhile). The engine's error if it failed to start: ValueError for bad options.
        ``on_dead(error)`` runs once the engine stopped on an error (``kvtier serve`` exits on
        it: a dead engine never serves again)."""
        # a hub id is fetched here, once; a missing or bad checkpoint fails here, not in a child
        model = str(resolve_model(model, config.revision, config.load_format))
        config = replace(config, revision=None)  # (the engine process gets the directory)
        self._open(EngineProcess(model, config, stats_interval, log_level), config, max_queue, on_dead, startup, start_timeout)

    @classmethod
    def in_thread(
        cls,
        core: EngineCore,
        max_queue: int = 1024,
        stats_interval: float = 0.0,
        on_dead: Callable[[BaseException], None] | None = None,
        max_step_failures: int | None = None,
    ) -> EngineClient:
        """A client of ``core``, served by its loop on a thread of this process (the same
        messages as an engine process's, over ``inproc://`` sockets); :meth:`shutdown` closes
        ``core``. ``max_step_failures``: steps in a row that may raise with no request to blame
        before the engine stops (None: engine/loop.py's default)."""
        client = cls.__new__(cls)
        client._open(EngineThread(core, stats_interval, max_step_failures), core.engine_config, max_queue, on_dead, None, None)
        return client

    def _open(
        self,
        engine: EngineProcess | EngineThread,
        config: EngineConfig,
        max_queue: int,
        on_dead: Callable[[BaseException], None] | None,
        startup: Startup | None,
        start_timeout: float | None,
    ) -> None:
        import zmq

        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        self.on_dead = on_dead
        self.config = config
        self.startup = startup if startup is not None else Startup()
        self._engine = engine
        self._ctx = engine.context()
        inbox, outbox = engine.endpoints()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 0)  # an add never waits for the engine to read
        self._push.bind(inbox)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(outbox)
        self._send_lock = threading.Lock()  # event loops and make_request's worker threads send
        self._reader: asyncio.Task | None = None
        self._error: BaseException | None = None
        self._stopping = False
        self._closed = False
        # request id -> (its caller's event loop, its queue); call id -> (loop, future)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._samples_sent = 0
        self._samples_taken = 0
        self._waiting_samples = 0
        self.num_running = self.num_waiting = 0
        engine.start(self._ctx, inbox, outbox)
        try:
            info = self._wait_ready(start_timeout)
        except BaseException:
            self._close()
            raise
        self.info: EngineInfo = info
        self.limits: RequestLimits = info.limits
        self.path = info.path
        self.tokenizer = engine.tokenizer(info.path)
        # the pool's health as the engine last said it (None: the engine has no pool)
        self._pool: dict | None = {"ok": True, "reason": "no status from the engine yet"} if info.limits.has_pool else None

    # ------------------------------------------------------------------ start
    def _wait_ready(self, timeout: float | None) -> EngineInfo:
        import zmq

        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while True:
            if not poller.poll(200):
                if not self._engine.alive():
                    raise RuntimeError(f"{self._engine.exit_reason()} during its start")
                if timeout is not None and self.startup.elapsed_s > timeout:
                    raise TimeoutError(f"the engine did not start in {timeout} s ({self.startup.phase})")
                continue
            msg = decode_message(self._pull.recv())
            if isinstance(msg, Phase):
                self.startup.mirror(msg.startup)
            elif isinstance(msg, Ready):
                self.startup.mirror(msg.info.startup)
                return msg.info
            elif isinstance(msg, Failed):
                self.startup.phase = msg.phase
                raise _rebuilt(msg.error_type, msg.message)

    # ------------------------------------------------------------------ callers (asyncio)
    def make_request(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        request_id: str | None = None,
        *,
        handoff: dict | None = None,
        export: bool = False,
        owner: str | None = None,
        priority: int = 0,
        images: Sequence[MMInput] = (),
    ) -> EngineRequest:
        """A request of token ids, checked (ValueError names the problem); nothing is sent.
        ``handoff``: D of a PD hand-off, P's manifest (the engine checks it when the request
        arrives: its refusal is the request's only delta); ``export``: P of one. ``owner`` (None:
        the request itself) and ``priority`` (lower first): how the engine shares its running
        slots between calls (engine/scheduler.py). ``images``: a vision-language prompt's images,
        placed on its placeholders (model/images.py ``place_images``)."""
        self.check_alive()
        check_samples(params.n, self.max_queue)
        rid = f"req-{secrets.token_hex(8)}" if request_id is None else check_request_id(request_id)
        pd = {"handoff": handoff is not None, "export": export}
        ids = check_request(self.limits, prompt, params, **pd, owner=owner, priority=priority)
        mm = [image_data(m) for m in images]
        return EngineRequest(rid, ids, params, cache_salt, handoff, export, owner or rid, int(priority), mm)

    @property
    def num_queued_samples(self) -> int:
        """Samples waiting for admission or on their way to the engine (what ``max_queue`` bounds)."""
        return self._waiting_samples + self._samples_sent - self._samples_taken

    async def generate(self, req: EngineRequest) -> AsyncGenerator[RequestDelta, None]:
        """Stream ``req`` (from :meth:`make_request`): a RequestDelta whenever its tokens moved,
        the last one with the finished output. Leaving the iteration early aborts the request.
        ValueError if the engine refuses it (its id in use, a manifest of other blocks)."""
        self.check_alive()
        loop = asyncio.get_running_loop()
        self._ensure_reader(loop)
        rid = req.request_id
        if rid in self._streams:
            raise ValueError(f"request_id {rid!r} is already in use by a request in the engine")
        check_queue(self.num_queued_samples, req.params.n, self.max_queue)
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (loop, q)
        self._samples_sent += req.params.n
        done = False
        try:
            self._send(req)
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    done = True  # (the engine dropped it already)
                    raise item
                if item.error is not None:
                    done = True  # refused, or the engine stopped: not in the engine
                    raise ERRORS.get(item.error.kind, RuntimeError)(item.error.message)
                yield item
                if item.output is not None:
                    done = True
                    return
        finally:
            self._streams.pop(rid, None)
            if not done and self._error is None:
                self._send(Abort(rid), quiet=True)

    async def call(self, name: str, *args: Any) -> Any:
        """Run the engine's call ``name`` (engine/loop.py's CALLS) with ``args`` between steps;
        RuntimeError naming the engine's error if it raised."""
        self.check_alive()
        loop = asyncio.get_running_loop()
        self._ensure_reader(loop)
        call_id = next(self._call_ids)
        fut = loop.create_future()
        self._calls[call_id] = (loop, fut)
        try:
            self._send(Call(call_id, name, list(args)))
            return await fut
        finally:
            self._calls.pop(call_id, None)

    def check_alive(self) -> None:
        """EngineDead if the engine stopped or is shutting down."""
        if self._error is not None:
            raise EngineDead(f"the engine stopped: {self._error}")
        if self._stopping:
            raise EngineDead("the engine is shutting down")

    @property
    def error(self) -> BaseException | None:
        """What stopped the engine, if an error did (None while it runs or after a clean stop)."""
        return self._error

    @property
    def num_streams(self) -> int:
        """Requests whose callers still wait for deltas (a leak check: 0 once all ended)."""
        return len(self._streams)

    def pool_health(self) -> dict | None:
        """The engine's storage pool as it last said (breaker state, its background probe): no
        call into the engine. None when the engine has no pool."""
        return None if self._pool is None else dict(self._pool)

    @property
    def engine_pid(self) -> int | None:
        """The engine process's id (None: the engine runs on a thread of this process)."""
        return self._engine.pid

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine (requests in flight fail with EngineDead; its copies and pool writes
        in flight finish), wait for it (``timeout`` s, then an engine process is killed), clean up."""
        if self._closed:
            return
        self._stopping = True
        if self._engine.alive():
            self._send(Stop(), quiet=True)
        # an engine that said it stopped has nothing left to finish: a short grace, then a kill
        self._close(min(timeout, 5.0) if self._error is not None else timeout)

    # ------------------------------------------------------------------ inside
    def _send(self, msg: Command, quiet: bool = False) -> None:
        """Send ``msg`` without waiting: ZeroMQ queues it (no bound). An engine that is gone
        (no peer on the socket) is EngineDead, or nothing when ``quiet`` (an abort, a stop)."""
        import zmq

        try:
            with self._send_lock:
                self._push.send(encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:  # zmq.Again: no engine reads the socket any more
            if not quiet:
                raise EngineDead(f"the engine is gone: {e}") from None

    def _close(self, timeout: float = 5.0) -> None:
        self._closed = True
        stopped = self._engine.join(timeout)
        self._stop_reader()
        self._push.close(0)
        self._pull.close(0)
        if stopped:
            self._ctx.term()  # (a thread that did not stop still holds sockets of an inproc context)
        self._engine.cleanup()

    def _stop_reader(self) -> None:
        """Cancel the reader task before its socket closes: from another thread, wait (briefly)
        until it ended, since a ZeroMQ socket must not close while another thread polls it."""
        reader = self._reader
        if reader is None or reader.done() or reader.get_loop().is_closed():
            return
        loop = reader.get_loop()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is running or not loop.is_running():
            loop.call_soon_threadsafe(reader.cancel)  # (it does not poll now: it runs on this thread, or not at all)
            return
        try:
            asyncio.run_coroutine_threadsafe(_cancel(reader), loop).result(2.0)
        except Exception:  # its loop stopped meanwhile, or it did not end in time: it finds its socket closed
            log.debug("the engine reader did not end before its socket closed", exc_info=True)

    def _ensure_reader(self, loop: asyncio.AbstractEventLoop) -> None:
        """One reader task, on the event loop of whichever caller started it while it runs (it
        hands each stream its items on the stream's own loop); a new one once that loop is gone."""
        reader = self._reader
        if reader is not None and not reader.done():
            old = reader.get_loop()
            if old.is_running():
                return
            if not old.is_closed():
                old.call_soon_threadsafe(reader.cancel)
        self._reader = loop.create_task(self._read(), name="kvtier-engine-reader")

    async def _read(self) -> None:
        """The engine's messages to their requests and calls, until it stops or its process exits."""
        import zmq
        import zmq.asyncio

        sock = zmq.asyncio.Socket.shadow(self._pull.underlying)
        try:
            while True:
                if not await sock.poll(500):
                    if not self._engine.alive() and not self._stopping:
                        self._died(self._engine.exit_reason())
                        return
                    continue
                while True:  # every message there is, without a future each (pyzmq's asyncio recv costs)
                    try:
                        data = self._pull.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._dispatch(decode_message(data))
                if self._error is not None:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # no message can be read: the engine is gone to us
            if self._closed:
                return  # (the sockets were closed under it)
            log.exception("reading the engine's messages failed")
            self._died(f"{type(e).__name__}: {e}")

    def _dispatch(self, msg: EngineMessage) -> None:
        if not isinstance(msg, EngineOutputs):
            log.warning("an unexpected message from the engine: %s", type(msg).__name__)
            return
        for delta in msg.deltas:
            entry = self._streams.get(delta.request_id)
            if entry is not None:
                _on_loop(entry[0], entry[1].put_nowait, delta)
        for result in msg.results:
            call = self._calls.get(result.call_id)
            if call is not None:
                exc = None if result.error is None else RuntimeError(result.error)
                _on_loop(call[0], _settle, call[1], result.value, exc)
        status = msg.status
        if status is not None:
            self.num_running, self.num_waiting = status.running, status.waiting
            self._waiting_samples, self._samples_taken = status.waiting_samples, status.samples_taken
            if status.pool is not None and self._pool is not None:
                self._pool = status.pool
        if msg.dead is not None:
            self._died(msg.dead)

    def _died(self, why: str) -> None:
        if self._error is not None:
            return
        self._error = EngineDead(why)
        log.critical("the engine stopped: %s", why)
        if self.on_dead is not None:
            try:
                self.on_dead(self._error)
            except Exception:  # the engine is gone either way
                log.exception("on_dead callback failed")
        err = EngineDead(f"the engine stopped: {why}")
        for loop, q in self._streams.values():
            _on_loop(loop, q.put_nowait, err)
        for loop, fut in self._calls.values():
            _on_loop(loop, _settle, fut, None, err)


def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)`` on ``loop``: now if it is the running loop, else soon, from its own thread."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if loop is running:
        fn(*args)
        return
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that caller's loop is closed: nobody is listening
        pass


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _rebuilt(kind: str, message: str) -> Exception:
    """The engine's start error as its type where that is a built-in one (a ValueError or an
    OSError is the command's error, exit status 2), else a RuntimeError naming it."""
    cls = getattr(builtins, kind, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls(message)
    return RuntimeError(f"{kind}: {message}")
