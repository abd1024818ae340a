"""Rank 0's end of tensor parallelism: the other ranks' processes, what is sent to them, what they
answer, and the bounds on every wait (engine/tp/__init__.py draws the whole).

Each rank r > 0 is a process of its own (``python -m kvtier.engine.tp.worker FD``), holding one
end of a socket pair; messages are pickled tuples (``multiprocessing.connection``), delivered in
order. To a rank::

    ("init", rank, size, store, model, config)   join the process group, load the shard (config:
                                                    rank 0's, resolved: engine/resolve.py)
    ("build", config, pool)                         allocate the tiers (config: now with their
                                                    sizes; pool: namespace and model fingerprint),
                                                    compile, capture
    ("ops", [(TransferOp, load_mode), ...])         submit (loads wait for the next forward)
    ("forward", HostInputs)                         runner.follow
    ("score", token_ids, routing)                   the same forward on scratch blocks
    ("draft", next_ids, rows, positions, tables)    the MTP passes after the last forward
                                                    (speculative decoding: engine/spec.py)
    ("wait", kind, seq)                             wait_loads / drain / storage_drain, then ("ack", seq)
    ("close",)

From a rank: ("sized", n) (the device blocks that fit it), ("ready",), ("landed", [(op_id,
failed), ...]) after any message that landed copies, ("ack", seq), ("error", text) before it
exits on an exception.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

import torch

from kvtier.engine.fatal import DeviceLost

log = logging.getLogger(__name__)


# loading a shard, compiling and capturing may take minutes (a rank that dies meanwhile is seen at once)
STARTUP_TIMEOUT = 1800.0


class RankLost(DeviceLost):
    """A tensor-parallel rank died, failed or did not answer in time: the ranks can no longer be
    kept in step, so the engine stops (the message names the rank)."""


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the GPU ``rank`` places after rank 0's (cuda), else the CPU."""
    if device.type != "cuda":
        return torch.device("cpu")
    base = device.index if device.index is not None else torch.cuda.current_device()
    return torch.device("cuda", base + rank)


def init_group(backend: str, store: str, rank: int, size: int, timeout: float, device: torch.device) -> Any:
    """Join the ranks' process group (a file store in rank 0's private directory); every
    collective in it raises (gloo) or ends the process (NCCL's watchdog) after ``timeout`` s."""
    import torch.distributed as dist

    options: dict[str, Any] = {}
    if backend == "nccl":
        options["device_id"] = device
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=size, timeout=timedelta(seconds=timeout), **options
    )
    return dist.group.WORLD


def destroy_group(timeout: float = 30.0) -> None:
    """Leave the process group (an engine closed; a later engine makes its own). The teardown
    runs on a thread of its own: if it has not returned within ``timeout`` s (a rank that never
    joins it), the close goes on without it, saying so (the group then stays, and this process
    cannot start another tensor-parallel engine)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    done = threading.Event()

    def destroy() -> None:
        dist.destroy_process_group()
        done.set()

    threading.Thread(target=destroy, name="kvtier-tp-teardown", daemon=True).start()
    if not done.wait(timeout):
        log.warning("the tensor-parallel process group's teardown did not finish within %g s: left behind", timeout)


class Ranks:
    """Ranks 1..size-1, as rank 0 talks to them. :meth:`start` spawns them and returns at once
    (they load their shards while rank 0 loads its own)."""

    def __init__(self, size: int, timeout: float, backend: str = "gloo") -> None:
        self.size = size
        self.backend = backend
        self.timeout = timeout
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []  # conns[i] talks to rank i + 1
        self.on_landed: Callable[[int, list[tuple[int, list[int]]]], None] = lambda rank, landed: None
        self._dir = tempfile.mkdtemp(prefix="kvtier-tp-")  # 0700: the store is this user's
        self.store = os.path.join(self._dir, "store")
        self._acks: dict[int, set[int]] = {}
        self._sizes: dict[int, int] = {}  # rank -> the device blocks that fit it
        self._ready: set[int] = set()
        self._seq = 0
        self._lost: str | None = None  # why the ranks cannot go on (the watchdog or a reader)
        self._told = False  # a RankLost was raised to the engine (the watchdog need not end the process)
        self._closed = False
        self._watchdog: threading.Thread | None = None
        self._threads: int | None = None  # rank 0's torch threads before the ranks shared the cores

    @classmethod
    def start(cls, size: int, model: str, config: Any, device: torch.device, timeout: float) -> "Ranks":
        self = cls(size, timeout, backend_for(device))
        env = dict(os.environ)
        if device.type == "cpu":  # the ranks share the cores: each takes its part (until close)
            self._threads = torch.get_num_threads()
            threads = max(1, self._threads // size)
            env["OMP_NUM_THREADS"] = str(threads)
            torch.set_num_threads(threads)
        try:
            for rank in range(1, size):
                mine, theirs = socket.socketpair()
                proc = subprocess.Popen(
                    [sys.executable, "-m", "kvtier.engine.tp.worker", str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),),
                    env=env,
                )
                theirs.close()
                conn = Connection(mine.detach())
                self.procs.append(proc)
                self.conns.append(conn)
                conn.send(("init", rank, size, self.store, model, config))
        except BaseException:
            self.close()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="kvtier-tp-watchdog", daemon=True)
        self._watchdog.start()
        return self

    # ------------------------------------------------------------------ sending
    def send(self, msg: tuple) -> None:
        self.check()
        for rank, conn in enumerate(self.conns, 1):
            try:
                conn.send(msg)
            except OSError as e:
                raise self.lost(f"tensor-parallel rank {rank} cannot be reached ({e})") from e

    def forward(self, host: Any) -> None:
        """The runner's hook (engine/runner.py Peers): the forward rank 0 is about to queue."""
        self.send(("forward", host))

    def score(self, token_ids: list[int], routing_in: Any) -> None:
        self.send(("score", token_ids, routing_in))

    def draft(self, next_ids: list[int], rows: list[int], positions: list[int], tables: list[list[int]]) -> None:
        """Speculative decoding: the MTP passes after the forward just sent (engine/spec.py)."""
        self.send(("draft", next_ids, rows, positions, tables))

    # ------------------------------------------------------------------ receiving
    def poll(self, timeout: float = 0.0) -> None:
        """Take whatever the ranks have sent (waiting up to ``timeout`` s for something)."""
        if timeout > 0:
            self.check()
            wait(self.conns, timeout)
        for rank, conn in enumerate(self.conns, 1):
            while self._readable(conn, rank, 0):
                self._take(rank, conn)

    def wait_all(self, kind: str) -> None:
        """Every rank runs ``kind`` ("wait_loads" or "drain") and acks; their landed copies come
        in before the acks."""
        self._seq += 1
        seq = self._seq
        self.send(("wait", kind, seq))
        self._gather(lambda rank: seq in self._acks.get(rank, ()), f"{kind} ack")
        for acks in self._acks.values():
            acks.discard(seq)

    def gather_sizes(self) -> list[int]:
        """The device blocks that fit each rank (after its shard loaded)."""
        self._gather(lambda rank: rank in self._sizes, "its device block count", STARTUP_TIMEOUT)
        return [self._sizes[r] for r in range(1, self.size)]

    def wait_ready(self) -> None:
        what = "ready (tiers allocated, kernels compiled, graphs captured)"
        self._gather(lambda rank: rank in self._ready, what, STARTUP_TIMEOUT)

    def _gather(self, have: Callable[[int], bool], what: str, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        for rank, conn in enumerate(self.conns, 1):
            while not have(rank):
                left = deadline - time.monotonic()
                if left <= 0 or not self._readable(conn, rank, left):
                    if have(rank):
                        break
                    bound = self.timeout if timeout is None else timeout
                    raise self.lost(f"tensor-parallel rank {rank} did not send {what} within {bound:g} s")
                self._take(rank, conn)

    def _readable(self, conn: Connection, rank: int, timeout: float) -> bool:
        self.check()
        try:
            return bool(wait([conn], timeout))
        except OSError as e:
            raise self.lost(f"tensor-parallel rank {rank} cannot be reached ({e})") from e

    def _take(self, rank: int, conn: Connection) -> None:
        try:
            msg = conn.recv()
        except (EOFError, OSError) as e:
            raise self.lost(f"tensor-parallel rank {rank} {self._exit_text(rank)}") from e
        kind = msg[0]
        if kind == "landed":
            self.on_landed(rank, msg[1])
        elif kind == "ack":
            self._acks.setdefault(rank, set()).add(msg[1])
        elif kind == "sized":
            self._sizes[rank] = msg[1]
        elif kind == "ready":
            self._ready.add(rank)
        elif kind == "error":
            raise self.lost(f"tensor-parallel rank {rank} failed: {msg[1]}")
        else:
            raise self.lost(f"tensor-parallel rank {rank} sent an unknown message {kind!r}")

    # ------------------------------------------------------------------ failures
    def _exit_text(self, rank: int) -> str:
        proc = self.procs[rank - 1]
        try:
            code = proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return "closed its connection"
        return f"exited with status {code}" if code >= 0 else f"was killed by signal {-code}"

    def _watch(self) -> None:
        """A rank process that exits while the engine runs: rank 0 may be inside a collective
        with it, which gloo ends with an error but NCCL only after its timeout; the reason is
        kept for the error rank 0 raises (:meth:`check`), and if rank 0 has neither raised it
        nor closed ``tp_timeout`` seconds later (stuck in an NCCL collective), the process
        ends, naming the rank, instead of hanging."""
        while not self._closed:
            for rank, proc in enumerate(self.procs, 1):
                if proc.poll() is not None and not self._closed:
                    self._lost = self._lost or f"tensor-parallel rank {rank} {self._exit_text(rank)}"
                    log.error("%s; the engine stops", self._lost)
                    deadline = time.monotonic() + self.timeout
                    while not (self._closed or self._told) and time.monotonic() < deadline:
                        time.sleep(0.1)
                    if not (self._closed or self._told) and self.backend == "nccl":  # (gloo raises)
                        log.critical("%s and rank 0 did not stop within %g s: exiting", self._lost, self.timeout)
                        os._exit(70)
                    return
            time.sleep(0.1)

    def check(self) -> None:
        if self._lost is not None:
            self._told = True
            raise RankLost(self._lost)

    def lost(self, why: str) -> RankLost:
        """The error that stops the engine (the first reason found wins; the caller raises it)."""
        self._lost = self._lost or why
        self._told = True
        return RankLost(self._lost)

    def explain(self, exc: BaseException) -> RankLost:
        """A step raised ``exc`` on rank 0: the ranks can no longer be kept in step. Which rank
        is gone, if one is (a collective fails when a peer dies), else ``exc`` itself."""
        if isinstance(exc, RankLost):
            return exc
        deadline = time.monotonic() + 2.0  # the watchdog notices an exit within 0.1 s
        while self._lost is None and time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                time.sleep(0.2)
                break
            time.sleep(0.05)
        try:
            self.poll()  # a rank's own error message, if it sent one
        except RankLost:
            pass
        err = self.lost(f"a tensor-parallel step failed on rank 0: {exc!r}")
        err.__cause__ = exc
        return err

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        """Tell every rank to exit, leave the process group beside them (NCCL's teardown waits for
        every rank's), and wait for them; those that do not exit within 10 s are killed. After a
        lost rank an NCCL group is left as it is: tearing it down would wait for the missing rank
        (this process cannot start another tensor-parallel engine then)."""
        if self._closed:
            return
        self._closed = True
        for conn in self.conns:
            try:
                conn.send(("close",))
            except OSError:
                pass
        if self._lost is None or self.backend == "gloo":
            destroy_group()
        else:
            log.warning("the tensor-parallel process group is left as it is (%s)", self._lost)
        deadline = time.monotonic() + 10.0
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()
        try:
            os.unlink(self.store)
        except OSError:
            pass
        try:
            os.rmdir(self._dir)
        except OSError:
            pass
        if self._threads is not None:
            torch.set_num_threads(self._threads)
