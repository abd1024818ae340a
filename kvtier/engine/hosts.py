"""Where an engine runs for its client (engine/client.py): the same loop and messages, two homes::

    EngineProcess   a process of its own (engine/proc.py's ``main``, spawned), over ``ipc://``
                    sockets in a 0700 temporary folder (they are this user's): ``kvtier serve``
    EngineThread    a thread of this process (engine/proc.py's ``serve_thread``), over
                    ``inproc://`` sockets of one ZeroMQ context: tests, embedding applications

Each gives the client its ZeroMQ context and endpoints, starts the engine on them, says whether
it still runs (and why not), hands over the tokenizer and waits for the end. No torch here: the
engine process imports it; a thread's engine was built by its caller.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
from typing import TYPE_CHECKING, Any

from kvtier.engine.config import EngineConfig
from kvtier.model.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from kvtier.engine.core import EngineCore

log = logging.getLogger(__name__)


class EngineProcess:
    """An engine in a process of its own (engine/proc.py's ``main``), over ``ipc://`` sockets in
    a 0700 temporary folder (they are this user's)."""

    def __init__(self, model: str, config: EngineConfig, stats_interval: float, log_level: str) -> None:
        self.args = (model, config, stats_interval, log_level)
        self.dir = tempfile.mkdtemp(prefix="kvtier-engine-")
        self.proc: Any = None

    def context(self) -> Any:
        import zmq

        return zmq.Context()

    def endpoints(self) -> tuple[str, str]:
        return f"ipc://{os.path.join(self.dir, 'in')}", f"ipc://{os.path.join(self.dir, 'out')}"

    def start(self, ctx: Any, inbox: str, outbox: str) -> None:
        model, config, stats_interval, log_level = self.args
        self.proc = multiprocessing.get_context("spawn").Process(
            target=_engine_main, args=(model, config, inbox, outbox, stats_interval, log_level), name="kvtier-engine", daemon=True
        )
        self.proc.start()

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.is_alive()

    def exit_reason(self) -> str:
        return f"the engine process exited (exit code {self.proc.exitcode})"

    def tokenizer(self, path: str) -> Any:
        return load_tokenizer(path)

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the process to end, then kill it; True once it ended."""
        self.proc.join(timeout)
        if self.proc.is_alive():
            log.warning("the engine process did not stop in %.0f s: killing it", timeout)
            self.proc.kill()
            self.proc.join(5)
        return not self.proc.is_alive()

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class EngineThread:
    """An engine served on a thread of this process (engine/proc.py's ``serve_thread``), over
    ``inproc://`` sockets of one ZeroMQ context."""

    _ids = itertools.count()

    def __init__(self, core: EngineCore, stats_interval: float, max_step_failures: int | None) -> None:
        self.core, self.stats_interval, self.max_step_failures = core, stats_interval, max_step_failures
        self.name = f"kvtier-engine-{os.getpid()}-{next(self._ids)}"
        self.thread: threading.Thread | None = None

    def context(self) -> Any:
        import zmq

        return zmq.Context()

    def endpoints(self) -> tuple[str, str]:
        return f"inproc://{self.name}-in", f"inproc://{self.name}-out"

    def start(self, ctx: Any, inbox: str, outbox: str) -> None:
        from kvtier.engine.proc import serve_thread

        options = {} if self.max_step_failures is None else {"max_step_failures": self.max_step_failures}
        args = (self.core, ctx, inbox, outbox, self.stats_interval)
        self.thread = threading.Thread(target=serve_thread, args=args, kwargs=options, name="kvtier-engine", daemon=True)
        self.thread.start()

    @property
    def pid(self) -> int | None:
        return None

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def exit_reason(self) -> str:
        return "the engine thread ended"

    def tokenizer(self, path: str) -> Any:
        return self.core.tokenizer  # (the engine's own: this process has it already)

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the thread to end; True once it ended."""
        if self.thread is not None:
            self.thread.join(timeout)
        if self.alive():
            log.warning("the engine thread did not stop in %.0f s", timeout)
            return False
        return True

    def cleanup(self) -> None:
        pass


def _engine_main(*args: Any) -> None:
    from kvtier.engine.proc import main

    main(*args)
