"""The serving process's end of an engine in a process of its own (what ``kvtier serve`` runs):
the interface of :class:`~kvtier.engine.async_engine.AsyncEngine` (make_request, generate,
call, the queue lengths, check_alive, shutdown), over ZeroMQ to engine/proc.py.

::

    serving process (HTTP, validation, tokenization)         engine process
    generate(req) ── ["add", ids, params, ...] ── PUSH ──► PULL ─► EngineLoop ─► step() ...
        ▲                                                               │
        └── per-request asyncio.Queue ◄── reader task ◄── PULL ◄── PUSH ┘ deltas, outputs, status

Requests are checked here first (engine/intake.py, with the sizes the engine reported when it
was ready): a bad one is a ValueError (HTTP 400) before anything is sent. ``max_queue`` bounds
the samples waiting for admission as in AsyncEngine, from the engine's status lines and the
samples sent since. An engine process that exits without saying why (killed, a crash in a
kernel) fails every request in flight with EngineDead, and ``on_dead`` runs, as when the engine
said it stopped.
"""

from __future__ import annotations

import asyncio
import builtins
import itertools
import logging
import multiprocessing
import os
import secrets
import shutil
import tempfile
import threading
from dataclasses import replace
from typing import Any, AsyncGenerator, Callable

import torch

from kvtier.engine.async_engine import check_queue, check_samples
from kvtier.engine.config import EngineConfig
from kvtier.engine.group import check_n
from kvtier.engine.intake import Intake
from kvtier.engine.loop import Delta, EngineDead, QueueFull
from kvtier.engine.params import SamplingParams
from kvtier.engine.request import Request
from kvtier.engine.startup import Startup
from kvtier.engine.wire import add_message, decode, encode, output_from_wire
from kvtier.model import ModelConfig
from kvtier.model.hub import resolve_model
from kvtier.model.tokenizer import load_tokenizer

log = logging.getLogger(__name__)
_ERRORS: dict[str, type[Exception]] = {"value": ValueError, "queue": QueueFull, "dead": EngineDead}


class PoolView:
    """The engine's storage pool as the server sees it: its health, from the last status line."""

    def __init__(self) -> None:
        self.last: dict = {"ok": True, "reason": "no status from the engine yet"}

    def health(self) -> dict:
        return self.last


class CoreView:
    """What the server reads of the engine (``AsyncEngine.core``'s attributes it uses)."""

    def __init__(self, path: str, config: EngineConfig, startup: Startup, info: dict, model_config: ModelConfig) -> None:
        self.path = path
        self.config = model_config  # the checkpoint's (vocab_size: what prompt ids must be below)
        self.engine_config = config
        self.startup = startup
        self.max_model_len: int = info["max_model_len"]
        self.block_size: int = info["block_size"]
        self.num_device_blocks: int = info["num_device_blocks"]
        self.pd_on_miss: str = info["pd_on_miss"]
        self.storage: PoolView | None = PoolView() if info["has_pool"] else None
        self.tokenizer = load_tokenizer(path)


class EngineClient:
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
        """Start the engine process and wait until it is ready (``startup`` mirrors its phases
        meanwhile). The engine's error if it failed to start: ValueError for bad options."""
        import zmq

        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        # a hub id is fetched here, once; a missing or bad checkpoint fails here, not in a child
        model = str(resolve_model(model, config.revision, config.load_format))
        config = replace(config, revision=None)  # (the engine process gets the directory)
        model_config = ModelConfig.from_hf_dir(model)
        self.max_queue = max_queue
        self.on_dead = on_dead
        self.startup = startup if startup is not None else Startup()
        self._dir = tempfile.mkdtemp(prefix="kvtier-engine-")  # 0700: the sockets are this user's
        inbox, outbox = (f"ipc://{os.path.join(self._dir, name)}" for name in ("in", "out"))
        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(inbox)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(outbox)
        self._send_lock = threading.Lock()  # the event loop and make_request's worker threads send
        self._proc = multiprocessing.get_context("spawn").Process(
            target=_engine_main,
            args=(model, config, inbox, outbox, stats_interval, log_level),
            name="kvtier-engine",
            daemon=True,
        )
        self._reader: asyncio.Task | None = None
        self._proc.start()
        self._error: BaseException | None = None
        self._stopping = False
        self._sinks: dict[str, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._samples_sent = 0
        self._samples_taken = 0
        self._waiting_samples = 0
        self.num_running = self.num_waiting = 0
        try:
            info = self._wait_ready(start_timeout)
        except BaseException:
            self._close_process()
            raise
        self.core = CoreView(model, config, self.startup, info, model_config)
        self.intake = Intake(
            self.core.path,  # type: ignore[arg-type]
            self.core.tokenizer,
            model_config,
            info["max_model_len"],
            info["block_size"],
            info["num_device_blocks"],
            info["has_pool"],
            info["routing"],
            torch.device("cpu"),
            torch.Generator(),
        )

    # ------------------------------------------------------------------ start
    def _wait_ready(self, timeout: float | None) -> dict:
        import zmq

        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while True:
            if not poller.poll(200):
                if not self._proc.is_alive():
                    raise RuntimeError(f"the engine process exited during its start (exit code {self._proc.exitcode})")
                if timeout is not None and self.startup.elapsed_s > timeout:
                    raise TimeoutError(f"the engine did not start in {timeout} s ({self.startup.phase})")
                continue
            msg = decode(self._pull.recv())
            if msg[0] == "phase":
                self.startup.mirror(msg[1])
            elif msg[0] == "ready":
                self.startup.mirror(msg[1]["startup"])
                return msg[1]
            elif msg[0] == "failed":
                _, phase, kind, message = msg
                self.startup.phase = phase
                raise _rebuilt(kind, message)

    # ------------------------------------------------------------------ callers (asyncio)
    def make_request(
        self,
        prompt: Any,
        params: SamplingParams,
        cache_salt: str | None = None,
        request_id: str | None = None,
        *,
        handoff: dict | None = None,
        export: bool = False,
        owner: str | None = None,
        priority: int = 0,
    ) -> Request:
        """Validate (ValueError names the problem); nothing is sent. The engine checks a hand-off's
        manifest when the request arrives (its refusal is the request's first item). ``owner``,
        ``priority``: as EngineCore.add_request's (they travel with the request)."""
        self.check_alive()
        check_samples(params.n, self.max_queue)
        rid = request_id or f"req-{secrets.token_hex(8)}"
        req = self.intake.request(
            prompt, params, cache_salt, rid, handoff=handoff is not None, export=export, owner=owner, priority=priority
        )
        req.handoff = handoff
        if isinstance(handoff, dict):  # D of a hand-off: P's first token is its first output (the engine checks it)
            first = handoff.get("first_token")
            if isinstance(first, int) and not isinstance(first, bool):
                req.all_token_ids.append(first)
                req.output_token_ids.append(first)
        req.generator = None  # the engine draws with its own
        check_n(req)
        return req

    @property
    def num_queued_samples(self) -> int:
        return self._waiting_samples + self._samples_sent - self._samples_taken

    async def generate(self, req: Request) -> AsyncGenerator[Delta, None]:
        """Stream ``req`` (from :meth:`make_request`): deltas of new tokens, the last one with the
        finished output. Leaving the iteration early aborts the request."""
        self.check_alive()
        self._ensure_reader()
        rid = req.request_id
        if rid in self._sinks:
            raise ValueError(f"request_id {rid!r} is already in use by a request in the engine")
        check_queue(self.num_queued_samples, req.params.n, self.max_queue)
        q: asyncio.Queue = asyncio.Queue()
        self._sinks[rid] = q
        self._samples_sent += req.params.n
        self._send(add_message(req))
        done = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    done = True  # (the engine dropped it already)
                    raise item
                yield item
                if item.output is not None:
                    done = True
                    return
        finally:
            self._sinks.pop(rid, None)
            if not done and self._error is None:
                self._send(["abort", rid])

    async def call(self, name: str, *args: Any) -> Any:
        """Run the engine's call ``name`` (engine/loop.py's ``CALLS``) with ``args`` between steps."""
        self.check_alive()
        self._ensure_reader()
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self._send(["call", call_id, name, list(args)])
        try:
            return await fut
        finally:
            self._calls.pop(call_id, None)

    def check_alive(self) -> None:
        if self._error is not None:
            raise EngineDead(f"the engine stopped: {self._error}")
        if self._stopping:
            raise EngineDead("the engine is shutting down")

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def num_streams(self) -> int:
        return len(self._sinks)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Ask the engine process to stop, wait for it (``timeout`` s, then kill it), clean up."""
        import zmq

        self._stopping = True
        if self._proc.is_alive():
            try:  # never wait on a peer that is gone (a PUSH with no peer blocks)
                with self._send_lock:
                    self._push.send(encode(["stop"]), zmq.NOBLOCK)
            except Exception:  # a socket already closed or no peer: the process goes below
                pass
        # an engine that said it stopped has nothing left to finish: a short grace, then a kill
        self._close_process(min(timeout, 5.0) if self._error is not None else timeout)

    # ------------------------------------------------------------------ inside
    def _send(self, msg: list) -> None:
        with self._send_lock:
            self._push.send(encode(msg))

    def _close_process(self, timeout: float = 5.0) -> None:
        self._proc.join(timeout)
        if self._proc.is_alive():
            log.warning("the engine process did not stop in %.0f s: killing it", timeout)
            self._proc.kill()
            self._proc.join(5)
        if self._reader is not None:
            self._reader.cancel()
        self._push.close(0)
        self._pull.close(0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _ensure_reader(self) -> None:
        """The reader task on the running event loop (a new one if the caller's loop changed)."""
        loop = asyncio.get_running_loop()
        if self._reader is None or self._reader.done() or self._reader.get_loop() is not loop:
            self._reader = loop.create_task(self._read(), name="kvtier-engine-reader")

    async def _read(self) -> None:
        """Messages of the engine to their requests, until the engine stops or its process exits."""
        import zmq
        import zmq.asyncio

        sock = zmq.asyncio.Socket.shadow(self._pull.underlying)
        try:
            while True:
                if not await sock.poll(500):
                    if not self._proc.is_alive() and not self._stopping:
                        self._died(f"the engine process exited (exit code {self._proc.exitcode})")
                        return
                    continue
                while True:  # every message there is, without a future each (pyzmq's asyncio recv costs)
                    try:
                        data = self._pull.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._dispatch(decode(data))
                if self._error is not None:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # no message can be read: the engine is gone to us
            log.exception("reading the engine's messages failed")
            self._died(f"{type(e).__name__}: {e}")

    def _dispatch(self, msg: list) -> None:
        kind = msg[0]
        if kind == "batch":  # what one engine iteration said
            for m in msg[1]:
                self._dispatch(m)
        elif kind == "delta":
            _, rid, index, token_ids, finish, logprobs, export, out, cached = msg
            q = self._sinks.get(rid)
            if q is not None:
                output = None if out is None else output_from_wire(out)
                q.put_nowait(Delta(token_ids, output, index, finish, logprobs, export, cached))
        elif kind == "error":
            _, rid, err, message = msg
            q = self._sinks.get(rid)
            if q is not None:
                q.put_nowait(_ERRORS.get(err, RuntimeError)(message))
        elif kind == "status":
            _, self.num_running, self.num_waiting, self._waiting_samples, self._samples_taken, pool = msg
            if pool is not None and self.core.storage is not None:
                self.core.storage.last = pool
        elif kind == "result":
            _, call_id, err, value = msg
            fut = self._calls.get(call_id)
            if fut is not None and not fut.done():
                fut.set_exception(RuntimeError(err)) if err is not None else fut.set_result(value)
        elif kind == "dead":
            self._died(msg[1])
        else:
            log.warning("unknown message from the engine: %r", kind)

    def _died(self, why: str) -> None:
        if self._error is not None:
            return
        self._error = EngineDead(why)
        log.critical("the engine stopped: %s", why)
        if self.on_dead is not None:
            try:
                self.on_dead(self._error)
            except Exception:  # a socket already closed or no peer: the process goes below
                log.exception("on_dead callback failed")
        err = EngineDead(f"the engine stopped: {why}")
        for q in self._sinks.values():
            q.put_nowait(err)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)


def _rebuilt(kind: str, message: str) -> Exception:
    """The engine process's start error as its type where that is a built-in one (a ValueError
    or an OSError is the command's error, exit status 2), else a RuntimeError naming it."""
    cls = getattr(builtins, kind, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls(message)
    return RuntimeError(f"{kind}: {message}")


def _engine_main(*args: Any) -> None:
    from kvtier.engine.proc import main

    main(*args)
