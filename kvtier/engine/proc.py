"""The engine's end of the process line: an :class:`~kvtier.engine.core.EngineCore` and its
serving loop (engine/loop.py) behind two ZeroMQ sockets, which engine/client.py binds; the
messages are engine/wire.py's::

    main(model, config, ...)    an engine process of its own (what ``kvtier serve`` runs): builds
                                the core (its phases go out as they pass), then serves
    serve_thread(core, ...)     the same loop on a thread of the caller's process (inproc://
                                sockets, one ZeroMQ context): ``EngineClient.in_thread``
    EngineServer(core, pull, push).run()    Ready, then the loop until Stop or an error; the core
                                is closed at the end (copies and puts in flight finish)

The serving process does HTTP, validation, tokenization and the responses; nothing it does (a
flood of connections, a large body, a slow client) takes this interpreter. What runs here is
scheduling, the cache, the model, and the pool client's threads. An engine process stops when
its server tells it, on SIGTERM (a supervisor's, sent to the whole process group), and when it
finds its server gone (killed without a word).
"""

from __future__ import annotations

import logging
import os
import signal
from typing import TYPE_CHECKING, Any, Callable

from kvtier.engine.config import EngineConfig
from kvtier.engine.loop import MAX_STEP_FAILURES, EngineLoop
from kvtier.engine.startup import Startup
from kvtier.engine.wire import EngineInfo, Failed, Phase, Ready, encode

if TYPE_CHECKING:
    from kvtier.engine.core import EngineCore

log = logging.getLogger(__name__)


def engine_info(core: EngineCore) -> EngineInfo:
    """What the engine says of itself once ready: what requests are checked against, and its start."""
    return EngineInfo(str(core.path), core.intake.limits, core.pd_on_miss, core.startup.as_dict())


class EngineServer:
    """One engine's loop behind its sockets: ``pull`` brings the serving process's commands,
    ``push`` takes the loop's messages (one per iteration)."""

    def __init__(
        self,
        core: EngineCore,
        pull: Any,
        push: Any,
        stats_interval: float = 0.0,
        max_step_failures: int = MAX_STEP_FAILURES,
        after_iteration: Callable[[], None] | None = None,
    ) -> None:
        import zmq

        self.core, self.pull, self.push = core, pull, push
        self.poller = zmq.Poller()
        self.poller.register(pull, zmq.POLLIN)
        self.loop = EngineLoop(
            core,
            self.recv,
            self.send,
            max_step_failures=max_step_failures,
            stats_interval=stats_interval,
            after_iteration=after_iteration,
        )

    def recv(self, timeout: float) -> bytes | None:
        return self.pull.recv() if self.poller.poll(int(timeout * 1000)) else None

    def send(self, data: bytes) -> None:
        self.push.send(data, copy=False)

    def run(self) -> None:
        """Say Ready, serve until stopped, close the core."""
        try:
            self.send(encode(Ready(engine_info(self.core))))
            self.loop.run()
        finally:
            self.core.close()


def serve_thread(
    core: EngineCore, ctx: Any, inbox: str, outbox: str, stats_interval: float = 0.0, max_step_failures: int = MAX_STEP_FAILURES
) -> None:
    """A thread's entry: ``core`` served over ``inbox``/``outbox`` of the context ``ctx`` (the
    sockets are this thread's: ZeroMQ sockets are used by one thread each)."""
    import zmq

    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow reader: the client drains it
    pull.connect(inbox)
    push.connect(outbox)
    try:
        EngineServer(core, pull, push, stats_interval, max_step_failures).run()
    finally:
        push.close(linger=2000)
        pull.close(linger=0)


def main(model: str, config: EngineConfig, inbox: str, outbox: str, stats_interval: float, log_level: str) -> None:
    """The engine process's entry (multiprocessing, spawn): build the core, say ready, serve
    until told to stop or the engine dies."""
    import zmq

    from kvtier.engine.core import EngineCore
    from kvtier.log_setup import setup_logging

    setup_logging(log_level)
    # the server stops us (Stop) when it is told to; a terminal's Ctrl-C reaches the whole
    # process group: it is the server's to act on
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if str(config.device).startswith("cpu"):
        # on a CPU host the model's threads would take every core: leave one to the server process
        import torch

        from kvtier.cpus import engine_threads

        torch.set_num_threads(engine_threads(torch.get_num_threads()))
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow reader: the server drains it
    push.setsockopt(zmq.LINGER, 2000)
    pull.connect(inbox)
    push.connect(outbox)
    try:
        startup = Startup()
        startup.on_change = lambda: push.send(encode(Phase(startup.as_dict())))
        try:
            core = EngineCore(model, config, startup=startup)
        except BaseException as e:  # told to the server, which exits on it
            log.debug("engine start failed", exc_info=e)
            push.send(encode(Failed(startup.phase, type(e).__name__, str(e))))
            return
        # the server that started us: if it dies (killed, crashed), so do we. (PR_SET_PDEATHSIG
        # cannot be used: it fires when the server's *thread* that started us ends, and a server
        # starts its engine from a thread that ends once the engine is ready.)
        parent = os.getppid()

        def server_gone() -> None:
            if os.getppid() != parent and not server.loop.stopping:
                log.error("the server process %d is gone without stopping the engine: the engine stops", parent)
                server.loop.stop()

        server = EngineServer(core, pull, push, stats_interval, after_iteration=server_gone)

        def on_sigterm(*_: Any) -> None:  # a supervisor's SIGTERM to the whole group: a clean stop, as Stop
            log.info("the engine stops: SIGTERM")
            server.loop.stop()

        signal.signal(signal.SIGTERM, on_sigterm)
        server.run()
    finally:
        push.close()
        pull.close()
        ctx.term()
