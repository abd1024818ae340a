"""The engine process: an :class:`~kvtier.engine.core.EngineCore` and its loop (engine/loop.py)
as the main thread of a process of their own, fed by the serving process over ZeroMQ
(engine/client.py starts it; the messages are engine/wire.py's).

The serving process does HTTP, validation, tokenization and the responses; nothing it does (a
flood of connections, a large body, a slow client) takes this interpreter. What runs here is
scheduling, the cache, the model, and the pool client's threads.

A request arrives as token ids and params and is checked again here (the hand-off manifest
against this engine's blocks, the id against those in flight); a refusal goes back as the
request's error. Deltas are sent as each step makes them; a status line (queue lengths, the
samples taken, the pool's health) after a step when it changed and at least every
``STATUS_EVERY_S`` seconds.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

from kvtier.engine.config import EngineConfig
from kvtier.engine.loop import Delta, EngineDead, EngineLoop, QueueFull, Sink
from kvtier.engine.request import Request
from kvtier.engine.startup import Startup
from kvtier.engine.wire import decode, encode, output_to_wire, params_from_wire

log = logging.getLogger(__name__)
STATUS_EVERY_S = 0.25


def error_kind(e: BaseException) -> str:
    if isinstance(e, QueueFull):
        return "queue"
    if isinstance(e, EngineDead):
        return "dead"
    if isinstance(e, ValueError):
        return "value"
    return "internal"


class _WireSink(Sink):
    __slots__ = ("send",)

    def __init__(self, req: Request, send: Any) -> None:
        super().__init__(req)
        self.send = send

    def push(self, item: Delta | BaseException) -> None:
        rid = self.req.request_id
        if isinstance(item, BaseException):
            self.send(["error", rid, error_kind(item), str(item)])
            return
        out = None if item.output is None else output_to_wire(item.output)
        self.send(["delta", rid, item.index, item.token_ids, item.finish_reason, item.logprobs, item.export, out, item.cached])


def main(model: str, config: EngineConfig, inbox: str, outbox: str, stats_interval: float, log_level: str) -> None:
    """The engine process's entry (multiprocessing, spawn): build the core, say ready, serve
    until told to stop or the engine dies."""
    import zmq

    from kvtier.engine.core import EngineCore
    from kvtier.log_setup import setup_logging

    setup_logging(log_level)
    # the server stops us ("stop") when it is told to; a terminal's Ctrl-C reaches the whole
    # process group: it is the server's to act on
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if str(config.device).startswith("cpu"):
        # on a CPU host the model's threads would take every core: leave one to the server process
        import torch

        from kvtier.cpus import engine_threads

        torch.set_num_threads(engine_threads(torch.get_num_threads()))
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(inbox)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow reader: the server drains it
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(outbox)

    def send(msg: list) -> None:
        push.send(encode(msg), copy=False)

    startup = Startup()
    startup.on_change = lambda: send(["phase", startup.as_dict()])
    try:
        core = EngineCore(model, config, startup=startup)
    except BaseException as e:  # told to the server, which exits on it
        log.debug("engine start failed", exc_info=e)
        send(["failed", startup.phase, type(e).__name__, str(e)])
        push.close()
        return
    storage = core.storage
    send(
        [
            "ready",
            {
                "max_model_len": core.max_model_len,
                "block_size": core.block_size,
                "num_device_blocks": core.cache.device_pool.num_blocks,
                "has_pool": storage is not None,
                "routing": core.routing is not None,
                "pd_on_miss": core.pd_on_miss,
                "startup": startup.as_dict(),
            },
        ]
    )
    engine = _Engine(core, pull, send, stats_interval)
    # a SIGTERM sent to the whole process group (a supervisor's) reaches us too: it stops the
    # loop as the server's "stop" does
    signal.signal(signal.SIGTERM, lambda *_: engine.stop("SIGTERM"))
    try:
        engine.loop.run(after_iteration=engine.after_iteration)
    finally:
        engine.flush()  # the failed requests' errors, the word that the engine stopped
        try:
            core.close()
        finally:
            push.close()
            pull.close()
            ctx.term()


class _Engine:
    """The loop of one engine process and what it says to the server."""

    def __init__(self, core: Any, pull: Any, send: Any, stats_interval: float) -> None:
        import zmq

        # what an iteration says goes out as one message at its end (flush): a step of 64 streams
        # is one message, not 64 (each costs the server a wake-up of its event loop)
        self.out: list[list] = []
        self.core, self.pull, self.send, self._send_now = core, pull, self.out.append, send
        self.poller = zmq.Poller()
        self.poller.register(pull, zmq.POLLIN)
        self.loop = EngineLoop(core, self.next_command, stats_interval=stats_interval)
        self.loop.on_dead = lambda e: self.send(["dead", f"{type(e).__name__}: {e}"])
        self.refused_samples = 0  # samples of adds refused here (never reached the loop)
        self.last: tuple = ()
        self.pool_at = 0.0
        # the server that started us: if it dies (killed, crashed), so do we. (PR_SET_PDEATHSIG
        # cannot be used: it fires when the server's *thread* that started us ends, and a server
        # starts its engine from a thread that ends once the engine is ready.)
        self.parent = os.getppid()

    def next_command(self, block: bool) -> tuple | None:
        while self.poller.poll(int(self.loop.idle_wait * 1000) if block else 0):
            cmd = self.command(decode(self.pull.recv()))
            if cmd is not None:
                return cmd
            block = False  # a message answered here (a refused add): look once more, without waiting
        return None

    def command(self, msg: list) -> tuple | None:
        """A loop command from a message (None: answered here already)."""
        kind = msg[0]
        if kind == "add":
            _, rid, ids, params, cache_salt, handoff, export, owner, priority = msg
            try:
                p = params_from_wire(params)
            except (TypeError, ValueError) as e:
                self.refused_samples += params.get("n", 1) if isinstance(params, dict) else 1
                self.send(["error", rid, "value", str(e)])
                return None
            try:
                req = self.core.make_request(
                    ids, p, cache_salt, rid, handoff=handoff, export=export, owner=owner, priority=priority
                )
            except ValueError as e:
                self.refused_samples += p.n
                self.send(["error", rid, "value", str(e)])
                return None
            return ("add", _WireSink(req, self.send))
        if kind == "abort":
            return ("abort", msg[1])
        if kind == "call":
            call_id = msg[1]

            def reply(result: Any, exc: BaseException | None) -> None:
                self.send(["result", call_id, None if exc is None else f"{type(exc).__name__}: {exc}", result])

            return ("call", msg[2], reply, tuple(msg[3]) if len(msg) > 3 else ())
        if kind == "stop":
            self.stop("the server is shutting down")
            return ("wake",)
        log.warning("unknown message from the server: %r", kind)
        return None

    def stop(self, why: str) -> None:
        """A clean stop: the loop ends after this iteration (requests in flight fail with
        EngineDead), the core closes (copies and puts in flight finish)."""
        if not self.loop.stopping:
            log.info("the engine stops: %s", why)
        self.loop.stop()

    def status(self) -> None:
        """The queue lengths after a step when they changed; the pool's health every STATUS_EVERY_S."""
        if os.getppid() != self.parent:  # it died without telling us (killed): not a clean stop
            log.error("the server process %d is gone without stopping the engine: the engine stops", self.parent)
            self.loop.stop()
            return
        now = time.monotonic()
        sched = self.core.scheduler
        loop = self.loop
        counts = (len(sched.running), len(sched.waiting), loop.waiting_samples, loop.samples_taken + self.refused_samples)
        pool_due = now - self.pool_at >= STATUS_EVERY_S
        if counts == self.last and not pool_due:
            return
        pool = None
        storage = self.core.storage
        if pool_due and storage is not None:
            self.pool_at = now
            try:
                pool = dict(storage.health())
            except Exception as e:  # a probe that fails says the pool is not ok
                pool = {"ok": False, "reason": f"{type(e).__name__}: {e}"}
        elif pool_due:
            self.pool_at = now
        self.last = counts
        self.send(["status", *counts, pool])

    def after_iteration(self) -> None:
        self.status()
        self.flush()

    def flush(self) -> None:
        if self.out:
            self._send_now(["batch", self.out])  # encoded here, so the list can be emptied (the sinks append to it)
            self.out.clear()
