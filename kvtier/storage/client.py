"""StorageClient: the storage tier as the manager and the engine see it (DESIGN §7).

::

    scheduler thread                         worker threads (ThreadPoolExecutor)
    ────────────────                         ───────────────────────────────────
    lookup_prefix(keys) ─ exists ──────────► backend   (one round trip; 0 while the breaker is open)
    submit(fetch op) ─ split in batches ───► get_into(staging) ─ check blob ─ copy into host block
    submit(put op)   ─ split in batches ───► encode host block into staging ─ put_from(staging)
    poll() ◄─ ops whose every batch returned (fetches in submission order) ─┘

Invariants:

1. an op is reported only after every worker touching its host blocks has returned, so a fetch
   that is late (slow pool, timeout) can never write into a host block handed to someone else:
   the manager keeps the blocks reserved until :meth:`poll` reports the op;
2. a fetched item counts as landed only if its object passed every check of
   :meth:`BlobLayout.check` (namespace, key, dtype, shape, sizes, checksum); any other object
   under the block's name is reported failed (a miss: the tokens are recomputed), counted
   (``corrupt``: damaged; ``foreign``: another layout or namespace) and deleted
   (``replaced_corrupt``), so that the next put stores a good one — puts skip names that exist,
   so an object left in place would keep the block out of the pool for good. The name is ours to
   clear: it is the block key, chained from a seed that holds the whole model fingerprint, so no
   other engine's good object can have it (a new blob format must bump the key format version);
3. a backend that raises is retried ``retries`` times, then the batch's items are failed; after
   ``breaker_threshold`` failed calls in a row the breaker opens: lookups answer 0, new ops and
   every batch still queued fail at once without I/O (requests go on by recompute) until
   ``breaker_cooldown`` has passed; then one call probes the backend: success closes the breaker,
   failure opens it again for twice as long (at most 60 s);
4. staging memory comes from a fixed arena (one slot of ``batch`` objects per thread), registered
   once with the backend (zero-copy clients); a slot is used by one batch at a time;
5. fetches and puts run on separate threads (``workers`` and ``max(1, workers // 2)``): a fetch,
   which a request waits for, never queues behind a bulk of write-through puts.

Health (:meth:`StorageClient.health`, shown by the server's ``/health``) is read from state the
I/O paths record (last success, last error, the breaker): no I/O on the caller's thread, no wait
on a worker. So that an idle engine notices a pool that died (and one that came back), a daemon
thread probes it (``exists`` of one name) every ``probe_interval`` seconds in which no call
succeeded; a probe that fails counts toward the breaker, one that succeeds closes it, one that
has not returned after ``probe_timeout`` makes the pool unhealthy. :meth:`close` stops it.

Over 600 lines: one class, the storage tier's client (batching, retries, circuit breaker, health
probe) with its worker threads; not split yet.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from queue import SimpleQueue
from typing import Callable, Sequence

import numpy as np

from kvtier.cache.keys import object_name
from kvtier.cache.plan import TransferOp
from kvtier.cpus import usable_cpus
from kvtier.redact import redact_url
from kvtier.storage.base import MISSING, TOO_LARGE, Backend
from kvtier.storage.blob import HEADER_NBYTES, BlobLayout, BlobStatus

log = logging.getLogger(__name__)


_LOOKUP_SLICE = 128  # names per exists call when a lookup is split across threads

# failed checks counted as ``corrupt`` (our object, damaged); any other failure is ``foreign``
_DAMAGED = (BlobStatus.BAD_CHECKSUM, BlobStatus.TRUNCATED, BlobStatus.WRONG_KEY)


def _flat(a: np.ndarray) -> memoryview:
    """A host block's bytes as a flat writable view (host blocks are contiguous)."""
    assert a.flags.c_contiguous
    return a.reshape(-1).data


def default_storage_workers() -> int:
    """Fetch threads when not told: one per core, 2 to 16 (they wait on I/O)."""
    return min(16, max(2, usable_cpus()))


def start_pool_threads(pool: ThreadPoolExecutor, n: int) -> None:
    """Start all ``n`` threads of ``pool`` now, each held at a barrier until all run. A pool
    starts a thread per submitted task, on first use, in the submitting thread: the first op
    would pay for them (``kvtier bench storage`` timed that: file get 0.50 of raw -> 0.66-0.74
    once started before, docs/BENCHMARKS.md)."""
    started = threading.Barrier(n)
    list(pool.map(lambda _: started.wait(5), range(n)))


class CircuitBreaker:
    """Closed: every call goes. Open (``threshold`` failed calls in a row): no call goes until
    ``cooldown`` has passed; then one call, the probe, goes: success closes it, failure opens it
    again for twice as long (at most ``max_cooldown``)."""

    CLOSED, PROBE = "closed", "probe"

    def __init__(self, threshold: int = 3, cooldown: float = 2.0, max_cooldown: float = 60.0) -> None:
        self.threshold = threshold
        self.base_cooldown = cooldown
        self.cooldown = cooldown
        self.max_cooldown = max_cooldown
        self.failures = 0
        self.open_until: float | None = None
        self.trips = 0
        self._probing = False
        self._lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        return self.open_until is not None

    def blocked(self) -> bool:
        """Would a call be refused now? (claims nothing)"""
        with self._lock:
            return self.open_until is not None and (self._probing or time.monotonic() < self.open_until)

    def allow(self) -> str | None:
        """A token if a call may go now (``PROBE``: this call is the one probe), else None. A
        probe token must be given back with :meth:`release` once the call returned."""
        with self._lock:
            if self.open_until is None:
                return self.CLOSED
            if self._probing or time.monotonic() < self.open_until:
                return None
            self._probing = True
            return self.PROBE

    def release(self, token: str | None) -> None:
        """The call that got ``token`` is over (its success/failure, if any, already recorded)."""
        if token == self.PROBE:
            with self._lock:
                self._probing = False

    def success(self) -> None:
        with self._lock:
            if self.open_until is not None:
                log.warning("storage is back: circuit breaker closed")
            self.failures, self.open_until, self._probing = 0, None, False
            self.cooldown = self.base_cooldown

    def probe_failed(self) -> None:
        """A health probe (not a call of the breaker's own) failed: it counts toward opening a
        closed breaker; an open one is left to its own probe and cooldown."""
        with self._lock:
            if self.open_until is not None:
                return
        self.failure()

    def failure(self) -> None:
        with self._lock:
            self.failures += 1
            if self._probing:  # the probe failed: open again, for longer
                self._probing = False
                self.cooldown = min(self.cooldown * 2, self.max_cooldown)
                self.open_until = time.monotonic() + self.cooldown
            elif self.open_until is None and self.failures >= self.threshold:
                self.trips += 1
                self.open_until = time.monotonic() + self.cooldown
                log.warning(
                    "storage failed %d times in a row: circuit breaker open for %.1f s (requests go on by recompute)",
                    self.failures,
                    self.cooldown,
                )


@dataclass(slots=True)
class _Op:
    op: TransferOp
    futures: list[Future]
    starts: list[int]  # first item index of each batch
    failed: list[int] = field(default_factory=list)


class StorageClient:
    def __init__(
        self,
        backend: Backend,
        namespace: str = "default",
        *,
        workers: int = 4,
        batch: int = 16,
        put_workers: int | None = None,
        retries: int = 1,
        breaker_threshold: int = 3,
        breaker_cooldown: float = 2.0,
        on_fetch_io: Callable[[int, float], None] | None = None,
        on_fetch_busy: Callable[[int, float], None] | None = None,
        probe_interval: float | None = 2.0,
        probe_timeout: float = 5.0,
    ) -> None:
        if workers < 1 or batch < 1 or retries < 0:
            raise ValueError(f"workers and batch must be >= 1 and retries >= 0, got {workers}, {batch}, {retries}")
        self.backend = backend
        self.namespace = namespace
        self.workers = workers
        self.batch = batch
        self.retries = retries
        self.breaker = CircuitBreaker(breaker_threshold, breaker_cooldown)
        self.on_fetch_io = on_fetch_io  # cost model: (bytes, seconds) of each get call
        self.on_fetch_busy = on_fetch_busy  # cost model: (bytes, wall seconds) of each busy period
        self._reads_active = 0  # read calls in flight (busy period bookkeeping)
        self._busy_start = 0.0
        self._busy_bytes = 0
        self._busy_tainted = False
        self.layout: BlobLayout | None = None
        self._kv: Callable[[int], np.ndarray] | None = None
        self._routing: Callable[[int], np.ndarray] | None = None
        self._pool: ThreadPoolExecutor | None = None  # fetches (and calibration)
        self._put_pool: ThreadPoolExecutor | None = None  # puts
        self._lookup_pool: ThreadPoolExecutor | None = None  # slices of long lookups (never queued behind I/O)
        self._arrival_pool: ThreadPoolExecutor | None = None  # whole lookups started at a request's arrival
        self.put_workers = put_workers if put_workers is not None else max(1, workers // 2)
        if self.put_workers < 1:
            raise ValueError(f"put_workers must be >= 1, got {put_workers}")
        self._slots: SimpleQueue[np.ndarray] = SimpleQueue()
        self._inflight: deque[_Op] = deque()
        self._known: OrderedDict[bytes | str, None] = OrderedDict()  # keys stored (a hint for skipping puts)
        self.tp_rank: int | None = None  # tensor parallel: whose shards this client moves (shard())
        self.tp_size = 1
        self.writes = True  # False: a rank > 0 of a replicated cache, whose puts rank 0 makes (shard())
        self._lock = threading.Lock()
        self.counters: dict[str, float] = {
            k: 0
            for k in (
                "lookups",
                "lookup_hits",
                "hits",
                "misses",
                "corrupt",
                "foreign",
                "replaced_corrupt",
                "skipped_breaker_open",
                "put_blocks",
                "put_refused",
                "failed_calls",
                "bytes_read",
                "bytes_written",
                "fetch_seconds",
                "put_seconds",
                "busy_read_bytes",
                "busy_read_seconds",
            )
        }  # reads over wall time while any was in flight
        self._closed = False
        self.where = redact_url(backend.describe())  # for logs, stats, health (a backend's own
        #                                               describe() is not trusted to hide every secret)
        # health: written by the I/O paths and the probe, read by health() (one short lock)
        self._health_lock = threading.Lock()
        self._last_ok: float | None = None  # monotonic time of the last call that succeeded
        self._last_error: tuple[float, str] | None = None
        self._probe_started: float | None = None  # a probe call in flight since
        self.probe_interval, self.probe_timeout = probe_interval, probe_timeout
        self._stop_probe = threading.Event()
        self._probe_thread: threading.Thread | None = None
        if probe_interval is not None:
            if probe_interval <= 0 or probe_timeout <= 0:
                raise ValueError(f"probe_interval and probe_timeout must be > 0, got {probe_interval}, {probe_timeout}")
            self._probe_thread = threading.Thread(target=self._probe_loop, name="kvtier-storage-probe", daemon=True)
            self._probe_thread.start()

    # ------------------------------------------------------------------ set-up
    def bind(
        self, layout: BlobLayout, kv: Callable[[int], np.ndarray], routing: Callable[[int], np.ndarray] | None = None
    ) -> None:
        """Where host block ``h``'s bytes are: ``kv(h)`` (and ``routing(h)``), uint8 views."""
        self.layout, self._kv, self._routing = layout, kv, routing
        arena = np.empty((self.workers + self.put_workers, self.batch, layout.nbytes), np.uint8)
        self.backend.register_buffer(arena.reshape(-1).data)
        self._arena = arena
        for w in range(len(arena)):
            self._slots.put(arena[w])
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="kvtier-fetch")
        self._put_pool = ThreadPoolExecutor(self.put_workers, thread_name_prefix="kvtier-put")
        self._lookup_pool = ThreadPoolExecutor(self.workers, thread_name_prefix="kvtier-lookup")
        # its own threads: a lookup there may wait for slices on the lookup pool above
        self._arrival_pool = ThreadPoolExecutor(2, thread_name_prefix="kvtier-lookup-arrival")

    def start_threads(self) -> None:
        """Start every fetch and put thread now (:func:`start_pool_threads`), not in the first op."""
        if self._pool is None or self._put_pool is None:
            raise RuntimeError("StorageClient.bind() was not called")
        start_pool_threads(self._pool, self.workers)
        start_pool_threads(self._put_pool, self.put_workers)

    def shard(self, rank: int, size: int, replicated: bool = False) -> None:
        """Tensor parallel: this client reads and writes rank ``rank``'s shard of each block
        (``:tp<rank>of<size>`` names), and a block counts as stored only when every rank's shard
        is (:meth:`lookup_prefix` asks for all of them). ``replicated``: every rank holds the same
        bytes (a latent cache: multi-head latent attention), so a block is one object, named as
        without tensor parallelism, written by rank 0 alone and read by every rank (and by an
        engine of any tensor-parallel size)."""
        object_name(b"", self.namespace, rank, size)  # (checks the pair)
        if replicated:
            self.tp_rank, self.tp_size, self.writes = None, 1, rank == 0
        else:
            self.tp_rank, self.tp_size = rank, size

    def name(self, key: bytes | str) -> str:
        return object_name(key, self.namespace, self.tp_rank, self.tp_size)

    def _all_names(self, key: bytes | str) -> list[str]:
        """Every rank's name of ``key`` (one name without tensor parallelism)."""
        return [object_name(key, self.namespace, r, self.tp_size) for r in range(self.tp_size)]

    # ------------------------------------------------------------------ what the manager asks
    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the pool holds (0 while the breaker is open)."""
        if not keys:
            return 0
        token = self.breaker.allow()
        if token is None:
            return 0
        per = self.tp_size  # names per key: every rank's shard
        names = [n for k in keys for n in self._all_names(k)]
        try:
            # a prefix is usable only from its first block: a prompt the pool has never seen (the
            # usual cold request) is answered by one name, not one stat or key per block
            if len(keys) > 1 and keys[0] not in self._known and not all(self.backend.exists(names[:per])):
                present = [False]
            elif len(names) > 2 * _LOOKUP_SLICE and self._lookup_pool is not None:
                # a long prompt: slices looked up at once on the lookup threads (a file pool
                # answers with one stat per name; a server pipelines each slice)
                slices = [names[i : i + _LOOKUP_SLICE] for i in range(0, len(names), _LOOKUP_SLICE)]
                present = [p for part in self._lookup_pool.map(self.backend.exists, slices) for p in part]
            else:
                present = self.backend.exists(names)
        except Exception as e:  # a dead pool is a miss
            self._call_failed("lookup", e)
            return 0
        finally:
            self.breaker.release(token)
        self._succeeded()
        if per > 1:  # a block is there when every rank's shard is
            present = [all(present[i : i + per]) for i in range(0, len(present), per)]
        n = 0
        for p in present:
            if not p:
                break
            n += 1
        with self._lock:  # (lookups run on the engine thread and on the arrival threads)
            for k, p in zip(keys, present):
                if p:
                    self._remember(k)
                else:
                    self._known.pop(k, None)  # evicted from the pool: put it again next time
            self.counters["lookups"] += 1
            self.counters["lookup_hits"] += n
        return n

    def lookup_prefix_async(self, keys: Sequence[bytes]) -> Future:
        """:meth:`lookup_prefix` on a storage thread (a request's arrival); its Future's result is
        the count (0 on any failure, as there)."""
        keys = list(keys)
        if self._arrival_pool is None or self._closed:
            done: Future = Future()
            done.set_result(0 if self._closed else self.lookup_prefix(keys))
            return done
        return self._arrival_pool.submit(self.lookup_prefix, keys)

    def contains(self, key: bytes) -> bool:
        """Known to be stored (written or seen by this client): no I/O. Used to skip puts."""
        return key in self._known

    def forget(self, keys: Sequence[bytes | str]) -> None:
        """Not known to be stored after all (tensor parallel: another rank's shard failed)."""
        with self._lock:
            for k in keys:
                self._known.pop(k, None)

    def add(self, key: bytes) -> None:
        """The manager's ack of a put: already recorded when the put returned (``_put_batch``)."""

    def _remember(self, key: bytes | str) -> None:
        known = self._known
        known[key] = None
        known.move_to_end(key)
        if len(known) > 1_000_000:
            known.popitem(last=False)

    # ------------------------------------------------------------------ ops
    def submit(self, op: TransferOp) -> None:
        """Start ``op`` (fetch: into ``op.dst_blocks``; put: from ``op.src_blocks``) on the workers."""
        if self._pool is None:
            raise RuntimeError("StorageClient.bind() was not called")
        if op.kind not in ("fetch", "put"):
            raise ValueError(f"storage client runs fetch and put ops, not {op.kind!r}")
        blocks = op.dst_blocks if op.kind == "fetch" else op.src_blocks
        run = self._fetch_batch if op.kind == "fetch" else self._put_batch
        pool = self._pool if op.kind == "fetch" else self._put_pool
        assert pool is not None  # bind() starts both
        futures, starts = [], []
        if not self.breaker.blocked():
            for s in range(0, op.num_blocks, self.batch):
                futures.append(pool.submit(self._gated, run, op.keys[s : s + self.batch], blocks[s : s + self.batch]))
                starts.append(s)
        entry = _Op(op, futures, starts)
        if not futures:  # breaker open: fail at once, no I/O
            entry.failed = list(range(op.num_blocks))
        self._inflight.append(entry)

    def poll(self) -> list[tuple[int, list[int]]]:
        """Ops whose every batch has returned, as (op_id, failed item indices); never blocks.
        In any order: the manager lands a prefetch's chunks in order itself."""
        out = []
        for entry in list(self._inflight):
            if not all(f.done() for f in entry.futures):
                continue
            self._inflight.remove(entry)
            for start, fut in zip(entry.starts, entry.futures):
                try:
                    entry.failed.extend(start + i for i in fut.result())
                except Exception as e:  # the worker itself broke: the whole batch failed
                    log.warning("storage %s batch failed: %s", entry.op.kind, e)
                    n = min(self.batch, entry.op.num_blocks - start)
                    entry.failed.extend(range(start, start + n))
            out.append((entry.op.op_id, sorted(entry.failed)))
        return out

    def wait(self, timeout: float | None = None) -> list[tuple[int, list[int]]]:
        """Block until at least one op can be reported (or ``timeout``), then poll."""
        pending = [f for e in self._inflight for f in e.futures if not f.done()]
        if pending:
            wait_futures(pending, timeout=timeout, return_when="FIRST_COMPLETED")
        return self.poll()

    def wait_all(self) -> None:
        """Block until every op in flight has returned, taking none of them: the next
        :meth:`poll` reports them all."""
        wait_futures([f for e in self._inflight for f in e.futures])

    def drain(self) -> list[tuple[int, list[int]]]:
        """Block until every op returned; their completions."""
        self.wait_all()
        return self.poll()

    @property
    def num_in_flight(self) -> int:
        return len(self._inflight)

    # ------------------------------------------------------------------ workers
    def _call(self, what: str, fn, *args):
        """fn(*args) with bounded retries (none once the breaker is open); raises after the last
        failure (counted)."""
        for attempt in range(self.retries + 1):
            try:
                result = fn(*args)
            except Exception as e:
                if attempt == self.retries or self.breaker.is_open:
                    self._call_failed(what, e)
                    raise
                continue
            self._succeeded()
            return result

    def _succeeded(self) -> None:
        with self._health_lock:
            self._last_ok = time.monotonic()
        self.breaker.success()

    def _call_failed(self, what: str, e: Exception) -> None:
        with self._lock:
            self.counters["failed_calls"] += 1
        with self._health_lock:
            self._last_error = (time.monotonic(), f"{what}: {redact_url(e) or type(e).__name__}")
        self.breaker.failure()
        log.warning("storage %s failed on %s: %s", what, self.where, redact_url(e))

    def _gated(self, run, keys: Sequence[bytes | str], host_blocks: Sequence[int]) -> list[int]:
        """Run one batch unless the breaker opened since the op was queued (then fail it at once,
        no I/O); the batch that gets the probe token gives it back whatever happens."""
        token = self.breaker.allow()
        if token is None:
            with self._lock:
                self.counters["skipped_breaker_open"] += len(keys)
            return list(range(len(keys)))
        try:
            return run(keys, host_blocks)
        finally:
            self.breaker.release(token)

    def _fetch_batch(self, keys: Sequence[bytes | str], host_blocks: Sequence[int]) -> list[int]:
        layout, n = self.layout, len(keys)
        assert layout is not None and self._kv is not None
        slot = self._slots.get()
        parts = self.backend.supports_parts
        try:
            names = [self.name(k) for k in keys]
            kvs = [self._kv(hb) for hb in host_blocks]
            rts = [self._routing(hb) for hb in host_blocks] if self._routing else [None] * n
            t0 = self._read_started()
            try:
                if parts:  # header into staging, payload straight into the host block
                    sizes = self._call(
                        "get",
                        self.backend.get_into_parts,
                        names,
                        [
                            [slot[j, :HEADER_NBYTES].data, _flat(kv), *([_flat(rt)] if rt is not None else [])]
                            for j, (kv, rt) in enumerate(zip(kvs, rts))
                        ],
                    )
                else:
                    sizes = self._call("get", self.backend.get_into, names, [memoryview(slot[j]) for j in range(n)])
            except Exception:
                self._read_ended(0, failed=True)
                return list(range(n))
            dt = time.perf_counter() - t0
            self._read_ended(sum(s for s in sizes if s > 0))
            failed, bad, corrupt, nbytes = [], [], 0, 0
            for j, (size, key, hb) in enumerate(zip(sizes, keys, host_blocks)):
                if size == MISSING:
                    failed.append(j)
                    continue
                if size == TOO_LARGE:
                    status = BlobStatus.BAD_HEADER  # larger than this layout: not ours
                elif parts:
                    status = layout.check_parts(slot[j], size, key, kvs[j], rts[j])
                else:
                    status = layout.check(slot[j], size, key)
                if status is not BlobStatus.OK:  # a miss; deleted so a put replaces it
                    failed.append(j)
                    bad.append(names[j])
                    corrupt += status in _DAMAGED
                    log.warning("storage object %s is bad (%s): a miss, deleted to be written again", names[j], status.value)
                    continue
                if not parts:
                    layout.decode_into(slot[j], kvs[j], rts[j])
                nbytes += size
            replaced = 0
            if bad:
                try:
                    self.backend.delete(bad)
                    replaced = len(bad)
                except Exception as e:
                    log.warning("could not delete bad storage objects: %s", e)
            with self._lock:
                c = self.counters
                c["hits"] += n - len(failed)
                c["misses"] += len(failed) - len(bad)
                c["corrupt"] += corrupt
                c["foreign"] += len(bad) - corrupt
                c["replaced_corrupt"] += replaced
                c["bytes_read"] += nbytes
                c["fetch_seconds"] += dt
                for j in failed:  # not (or no longer) stored intact: put it again
                    self._known.pop(keys[j], None)
            if nbytes and self.on_fetch_io is not None:
                self.on_fetch_io(nbytes, dt)
            return failed
        finally:
            self._slots.put(slot)

    def _read_started(self) -> float:
        now = time.perf_counter()
        with self._lock:
            if not self._reads_active:
                self._busy_start, self._busy_bytes, self._busy_tainted = now, 0, False
            self._reads_active += 1
        return now

    def _read_ended(self, nbytes: int, failed: bool = False) -> None:
        """A busy period (some read in flight) ends when the last read returns: its bytes over
        its wall time is the pool's aggregate read rate, whatever the number of calls in it. A
        period with a failed call says nothing about the rate (the breaker deals with failures)."""
        with self._lock:
            self._reads_active -= 1
            self._busy_bytes += nbytes
            self._busy_tainted |= failed
            if self._reads_active:
                return
            period, nbytes, tainted = time.perf_counter() - self._busy_start, self._busy_bytes, self._busy_tainted
            self.counters["busy_read_bytes"] += nbytes
            self.counters["busy_read_seconds"] += period
        if nbytes and not tainted and self.on_fetch_busy is not None:
            self.on_fetch_busy(nbytes, period)

    def _put_batch(self, keys: Sequence[bytes | str], host_blocks: Sequence[int]) -> list[int]:
        if not self.writes:  # rank 0 stores the one object (shard(replicated=True)); its failures are every rank's
            return []
        layout, n = self.layout, len(keys)
        assert layout is not None and self._kv is not None
        slot = self._slots.get()
        try:
            names = [self.name(k) for k in keys]
            kvs = [self._kv(hb) for hb in host_blocks]
            rts = [self._routing(hb) for hb in host_blocks] if self._routing else [None] * n
            objects: list[list[memoryview]] | list[memoryview]
            put: Callable[..., list[bool]]
            if self.backend.supports_parts:  # header, then the host block's bytes as they are
                objects = [
                    [memoryview(layout.header_for(k, kv, rt)), _flat(kv), *([_flat(rt)] if rt is not None else [])]
                    for k, kv, rt in zip(keys, kvs, rts)
                ]
                put = self.backend.put_from_parts
            else:
                for j in range(n):
                    layout.encode_into(slot[j], keys[j], kvs[j], rts[j])
                objects = [memoryview(slot[j]) for j in range(n)]
                put = self.backend.put_from
            t0 = time.perf_counter()
            try:
                ok = self._call("put", put, names, objects)
            except Exception:
                return list(range(n))
            dt = time.perf_counter() - t0
            failed = [j for j, good in enumerate(ok) if not good]
            with self._lock:
                c = self.counters
                c["put_blocks"] += n - len(failed)
                c["put_refused"] += len(failed)
                c["bytes_written"] += (n - len(failed)) * layout.nbytes
                c["put_seconds"] += dt
                for j, good in enumerate(ok):
                    if good:
                        self._remember(keys[j])
            return failed
        finally:
            self._slots.put(slot)

    # ------------------------------------------------------------------ health
    def health(self) -> dict:
        """The pool's state for ``/health``, from what the I/O paths and the probe recorded: no
        I/O, no wait on a worker, safe from any thread::

            {"ok": bool, "reason": str | None, "backend": url (redacted),
             "breaker_open": bool, "failures_in_a_row": int, "last_error": str | None,
             "last_error_s_ago": float | None, "last_ok_s_ago": float | None}

        Not ok while the breaker is open, while the last call failed, or while a probe has been
        stuck longer than ``probe_timeout``."""
        now = time.monotonic()
        with self._health_lock:
            last_ok, last_error, probe_started = self._last_ok, self._last_error, self._probe_started
        breaker_open, failures = self.breaker.is_open, self.breaker.failures
        error = last_error[1] if last_error else None
        reason = None
        if probe_started is not None and now - probe_started > self.probe_timeout:
            reason = f"the pool has not answered a probe for {now - probe_started:.1f} s"
        elif breaker_open:
            reason = f"circuit breaker open after {failures} failed calls (last: {error})"
        elif failures:
            reason = f"the last call failed ({error})"
        return {
            "ok": reason is None,
            "reason": reason,
            "backend": self.where,
            "breaker_open": breaker_open,
            "failures_in_a_row": failures,
            "last_error": error,
            "last_error_s_ago": None if last_error is None else now - last_error[0],
            "last_ok_s_ago": None if last_ok is None else now - last_ok,
        }

    def _probe_loop(self) -> None:
        """Probe the pool when nothing succeeded for ``probe_interval`` seconds."""
        assert self.probe_interval is not None
        while not self._stop_probe.wait(self.probe_interval):
            with self._health_lock:
                last_ok = self._last_ok
            if last_ok is not None and time.monotonic() - last_ok < self.probe_interval:
                continue  # busy and well: nothing to learn
            self.probe()

    def probe(self) -> bool:
        """One light call (``exists`` of a name never written), recorded like any other call:
        a success closes the breaker, a failure counts toward opening it (never while open, so
        that it does not stretch the breaker's own probing). Called by the probe thread."""
        with self._health_lock:
            self._probe_started = time.monotonic()
        try:
            self.backend.exists([f"{self.name(b'')}health-probe"])
        except Exception as e:
            with self._health_lock:
                was_ok = self._last_error is None or (self._last_ok or 0) > self._last_error[0]
                self._last_error = (time.monotonic(), f"probe: {redact_url(e) or type(e).__name__}")
            if was_ok:  # logged once per outage, not once per probe
                log.warning("storage %s does not answer: %s", self.where, redact_url(e))
            self.breaker.probe_failed()
            return False
        else:
            self._succeeded()
            return True
        finally:
            with self._health_lock:
                self._probe_started = None

    def calibrate(self, num_objects: int = 4) -> bool:
        """Time reads of 1 and ``num_objects`` objects of this layout's size (written, read back,
        deleted under ``…:calibrate:<pid>`` names), so the cost model starts from this pool's
        real latency and bandwidth instead of a guess. False (nothing learned) if the pool fails."""
        assert self.layout is not None and self._pool is not None, "bind() first"
        n = max(1, min(num_objects, self.batch))
        slot = self._slots.get()
        names = [f"{self.name(b'')}calibrate:{os.getpid()}:{i}" for i in range(n)]
        try:
            bufs = [memoryview(slot[j]) for j in range(n)]
            slot[:n, :64] = 0  # not a valid blob: never read as KV
            if not all(self.backend.put_from(names, bufs)):
                return False
            for count in (1, n, 1, n):  # one call at a time: latency and per-call rate
                t0 = self._read_started()
                sizes = self.backend.get_into(names[:count], bufs[:count])
                dt = time.perf_counter() - t0
                self._read_ended(0)  # (per-call sample only)
                if any(s < 0 for s in sizes):
                    return False
                if self.on_fetch_io is not None:
                    self.on_fetch_io(sum(sizes), dt)
            self.start_threads()  # every fetch thread first (not timed)
            others = [self._slots.get() for _ in range(self.workers - 1)]
            try:  # every worker at once: the aggregate rate
                views = [bufs] + [[memoryview(o[j]) for j in range(n)] for o in others]

                def read(v):
                    self._read_started()
                    got = []
                    try:
                        got = self.backend.get_into(names, v)
                    finally:
                        self._read_ended(sum(s for s in got if s > 0))
                    return got

                results = list(self._pool.map(read, views))
            finally:
                for o in others:
                    self._slots.put(o)
            return all(s >= 0 for got in results for s in got)
        except Exception as e:
            log.warning("storage calibration failed on %s: %s", self.where, e)
            return False
        finally:
            try:
                self.backend.delete(names)
            except Exception:
                pass
            self._slots.put(slot)

    # ------------------------------------------------------------------ stats, close
    def stats(self) -> dict:
        c = dict(self.counters)
        out = {"backend": self.where, **c, "breaker_open": self.breaker.is_open, "breaker_trips": self.breaker.trips}
        if c["fetch_seconds"] > 0:
            out["read_gbps"] = c["bytes_read"] / c["fetch_seconds"] / 1e9
        if c["put_seconds"] > 0:
            out["write_gbps"] = c["bytes_written"] / c["put_seconds"] / 1e9
        try:
            out["server"] = self.backend.stats()
        except Exception as e:
            out["server"] = {"error": str(e)}
        return out

    def close(self) -> None:
        """Stop the health probe, wait for every op in flight (their completions must have been
        polled by the caller before, or are dropped), then close the backend."""
        if self._closed:
            return
        self._closed = True
        self._stop_probe.set()
        if self._probe_thread is not None:  # a probe stuck in the backend: left (a daemon)
            self._probe_thread.join(self.probe_timeout)
        for pool in (self._arrival_pool, self._pool, self._put_pool, self._lookup_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self.backend.close()
