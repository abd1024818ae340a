"""StorageClient: worker threads, blob checks, retries, circuit breaker, ordering of completions."""

from __future__ import annotations

import threading
import time
from typing import Sequence

import numpy as np
import pytest

from kvtier.cache.cost import FetchCostModel
from kvtier.cache.plan import TransferOp
from kvtier.storage import MemoryBackend, StorageClient
from kvtier.storage.base import Backend, StorageError
from kvtier.storage.blob import BlobLayout, namespace_digest

NUM_HOST = 16
KV_NBYTES = 512
RT_NBYTES = 32
HANG_S = 60.0  # bounds a wait that only a client that never answers runs into
LAYOUT = BlobLayout(namespace_digest("default", b"m"), "float32", (2, 2, 4, 2, 4), 4, KV_NBYTES, RT_NBYTES)


class Host:
    """Host blocks as the engine exposes them: uint8 views by host block id."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.kv = rng.integers(0, 256, (NUM_HOST, KV_NBYTES), dtype=np.uint8)
        self.rt = rng.integers(0, 256, (NUM_HOST, RT_NBYTES), dtype=np.uint8)


def client_for(backend: Backend, host: Host, **kw) -> StorageClient:
    kw.setdefault("probe_interval", None)  # the specs below count calls: no health probe
    c = StorageClient(backend, workers=2, batch=4, **kw)
    c.bind(LAYOUT, host.kv.__getitem__, host.rt.__getitem__)
    return c


def host_memory_gone(host_block: int) -> np.ndarray:
    """A host-block view that fails: a batch that reads it raises before any I/O."""
    raise RuntimeError(f"host block {host_block} is gone")


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def put(c: StorageClient, op_id: int, blocks: list[int], keys: list[bytes]) -> list[int]:
    c.submit(TransferOp(op_id, "put", tuple(blocks), (), tuple(keys)))
    (done,) = c.drain()
    assert done[0] == op_id
    return done[1]


def fetch(c: StorageClient, op_id: int, blocks: list[int], keys: list[bytes]) -> list[int]:
    c.submit(TransferOp(op_id, "fetch", (), tuple(blocks), tuple(keys)))
    (done,) = c.drain()
    return done[1]


def test_put_then_fetch_into_other_host_blocks_is_byte_exact():
    src, dst = Host(1), Host(2)
    backend = MemoryBackend()
    assert put(client_for(backend, src), 0, list(range(8)), [key(i) for i in range(8)]) == []
    reader = client_for(backend, dst)
    assert reader.lookup_prefix([key(i) for i in range(10)]) == 8
    assert fetch(reader, 1, [15, 14, 13, 12, 11, 10, 9, 8], [key(i) for i in range(8)]) == []
    for i in range(8):
        assert np.array_equal(dst.kv[15 - i], src.kv[i]) and np.array_equal(dst.rt[15 - i], src.rt[i])
    assert reader.stats()["hits"] == 8


def test_corrupt_and_truncated_objects_are_misses_counted_and_deleted():
    host = Host(1)
    backend = MemoryBackend()
    c = client_for(backend, host)
    put(c, 0, [0, 1, 2, 3], [key(i) for i in range(4)])
    name1, name2 = c.name(key(1)), c.name(key(2))
    raw1, raw2 = backend.raw(name1), backend.raw(name2)
    assert raw1 is not None and raw2 is not None
    data = bytearray(raw1)
    data[200] ^= 1
    backend.set_raw(name1, bytes(data))  # one flipped bit
    backend.set_raw(name2, raw2[:-7])  # truncated
    failed = fetch(c, 1, [5, 6, 7, 8], [key(i) for i in range(4)])
    assert failed == [1, 2]
    assert c.stats()["corrupt"] == 2
    assert backend.exists([name1, name2]) == [False, False]  # deleted: the next writer replaces them
    assert np.array_equal(host.kv[5], host.kv[0]) and np.array_equal(host.kv[8], host.kv[3])


def test_an_object_of_another_model_under_our_name_is_a_miss_and_deleted():
    backend = MemoryBackend()
    put(client_for(backend, Host(1)), 0, [0], [key(0)])
    other = StorageClient(backend, workers=1, batch=2)
    other_layout = BlobLayout(namespace_digest("default", b"other-model"), "float32", (2, 2, 4, 2, 4), 4, KV_NBYTES, RT_NBYTES)
    host = Host(3)
    other.bind(other_layout, host.kv.__getitem__, host.rt.__getitem__)
    assert fetch(other, 1, [0], [key(0)]) == [0]
    assert other.stats()["foreign"] == 1
    assert backend.exists([other.name(key(0))]) == [False]  # (real keys chain the model: debris)


@pytest.mark.parametrize("garbage", [b"", b"not a blob", bytes(LAYOUT.nbytes), bytes(4 * LAYOUT.nbytes)])
@pytest.mark.parametrize("kind", ["memory", "file"])
def test_a_foreign_object_under_our_name_is_replaced_by_the_next_put(kind, garbage, tmp_path):
    from kvtier.storage.file import FileBackend

    backend = MemoryBackend() if kind == "memory" else FileBackend(str(tmp_path / "pool"))
    src, dst = Host(1), Host(2)
    c = client_for(backend, src)
    name = c.name(key(0))
    assert backend.put_from([name], [memoryview(garbage)]) == [True]  # planted first: puts skip it

    assert fetch(c, 0, [5], [key(0)]) == [0]  # a miss
    assert put(c, 1, [0], [key(0)]) == []
    assert fetch(client_for(backend, dst), 2, [5], [key(0)]) == []

    assert np.array_equal(dst.kv[5], src.kv[0]) and np.array_equal(dst.rt[5], src.rt[0])
    assert c.stats()["replaced_corrupt"] == 1


class Flaky(MemoryBackend):
    """Raises while ``down``; counts calls."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.calls = 0

    def _gate(self) -> None:
        self.calls += 1
        if self.down:
            raise StorageError("connection refused (test)")

    def exists(self, names: Sequence[str]) -> list[bool]:
        self._gate()
        return super().exists(names)

    def get_into(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[int]:
        self._gate()
        return super().get_into(names, bufs)

    def put_from(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[bool]:
        self._gate()
        return super().put_from(names, bufs)


def test_a_dead_backend_opens_the_breaker_then_it_recovers():
    backend = Flaky()
    c = client_for(backend, Host(1), retries=1, breaker_threshold=3, breaker_cooldown=0.2)
    put(c, 0, [0, 1], [key(0), key(1)])
    backend.down = True
    for _ in range(3):
        assert c.lookup_prefix([key(0)]) == 0  # a failed lookup is a miss
    assert c.breaker.is_open and c.breaker.trips == 1
    calls = backend.calls
    assert c.lookup_prefix([key(0)]) == 0 and fetch(c, 1, [2], [key(0)]) == [0]
    assert put(c, 2, [3], [key(3)]) == [0]
    assert backend.calls == calls  # open: no I/O at all
    time.sleep(0.25)
    assert c.lookup_prefix([key(0)]) == 0  # the probe fails: open again, longer
    assert c.breaker.is_open and c.breaker.cooldown == pytest.approx(0.4)
    backend.down = False
    time.sleep(0.45)
    assert c.lookup_prefix([key(0), key(1)]) == 2  # probe succeeds: closed
    assert not c.breaker.is_open
    assert fetch(c, 3, [4, 5], [key(0), key(1)]) == []


def test_failed_calls_are_retried_before_failing_the_batch():
    backend = Flaky()
    c = client_for(backend, Host(1), retries=2, breaker_threshold=100)
    put(c, 0, [0], [key(0)])
    orig = backend.get_into
    attempts = []

    def twice_bad(names: Sequence[str], bufs: Sequence[memoryview]) -> list[int]:
        attempts.append(1)
        if len(attempts) <= 2:
            raise StorageError("blip")
        return orig(names, bufs)

    backend.get_into = twice_bad  # type: ignore[method-assign]  # the pool fails twice, then reads
    assert fetch(c, 1, [3], [key(0)]) == [] and len(attempts) == 3


class Slow(MemoryBackend):
    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.writing = threading.Event()

    def get_into(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[int]:
        self.writing.set()
        self.release.wait(HANG_S)
        return super().get_into(names, bufs)


def test_a_fetch_is_never_reported_before_its_worker_returned():
    backend = Slow()
    host = Host(1)
    c = client_for(backend, host)
    c.lookup_prefix([])  # (no-op)
    backend.put_from([c.name(key(0))], [np.zeros(LAYOUT.nbytes, np.uint8).data])
    c.submit(TransferOp(7, "fetch", (), (3,), (key(0),)))
    assert backend.writing.wait(HANG_S)
    assert c.poll() == [] and c.wait(timeout=0.05) == [] and c.num_in_flight == 1
    backend.release.set()
    assert c.drain() == [(7, [0])]  # (a zero object: bad header -> failed)


def test_a_fast_fetch_is_not_held_behind_a_slow_one():
    backend = Slow()
    c = client_for(backend, Host(1))
    c.submit(TransferOp(2, "fetch", (), (1,), (key(1),)))  # blocks in the backend
    assert backend.writing.wait(HANG_S)
    c.backend = MemoryBackend()  # the next op is fast
    c.submit(TransferOp(3, "fetch", (), (2,), (key(2),)))
    deadline = time.monotonic() + HANG_S
    done: list[tuple[int, list[int]]] = []
    while not done and time.monotonic() < deadline:
        done = c.wait(timeout=0.1)
    assert [op for op, _ in done] == [3]  # (the manager orders chunks itself)
    backend.release.set()
    assert [op for op, _ in c.drain()] == [2]


def test_batches_queued_before_the_breaker_opened_fail_without_io():
    backend = Flaky()
    c = StorageClient(backend, workers=1, batch=1, retries=0, breaker_threshold=3, breaker_cooldown=30, probe_interval=None)
    host = Host(1)
    c.bind(LAYOUT, host.kv.__getitem__, host.rt.__getitem__)
    backend.down = True
    c.submit(TransferOp(1, "fetch", (), tuple(range(12)), tuple(key(i) for i in range(12))))
    (done,) = c.drain()
    assert done[1] == list(range(12))
    assert backend.calls == 3  # the breaker opened: 9 batches never went
    assert c.stats()["skipped_breaker_open"] == 9


def test_a_probe_that_breaks_before_its_call_does_not_wedge_the_breaker():
    backend = Flaky()
    c = client_for(backend, Host(1), retries=0, breaker_threshold=1, breaker_cooldown=0.05)
    backend.down = True
    assert c.lookup_prefix([key(0)]) == 0 and c.breaker.is_open
    time.sleep(0.06)
    c.bind(LAYOUT, host_memory_gone)  # the probe batch raises before any I/O
    c.submit(TransferOp(1, "put", (0,), (), (key(0),)))
    c.drain()
    c.bind(LAYOUT, Host(1).kv.__getitem__, Host(1).rt.__getitem__)
    backend.down = False
    time.sleep(0.06)
    assert c.lookup_prefix([key(0)]) == 0 and not c.breaker.is_open  # a later probe went


def test_a_prompt_whose_first_block_the_pool_lacks_is_answered_by_one_name():
    backend = MemoryBackend()
    c = client_for(backend, Host(1))
    put(c, 0, [0, 1, 2], [key(0), key(1), key(2)])
    asked: list[int] = []
    real = backend.exists

    def exists(names: Sequence[str]) -> list[bool]:
        asked.append(len(names))
        return real(names)

    backend.exists = exists  # type: ignore[method-assign]  # counts the names asked
    assert c.lookup_prefix([key(9)] + [key(i) for i in range(3)]) == 0  # first block unknown: 1 name
    assert asked == [1]
    assert client_for(backend, Host(2)).lookup_prefix([key(i) for i in range(5)]) == 3  # then the rest
    assert asked == [1, 1, 5]
    assert c.lookup_prefix([key(i) for i in range(5)]) == 3  # first block known stored
    assert asked == [1, 1, 5, 5]


def test_a_lookup_miss_forgets_that_a_key_was_stored():
    backend = MemoryBackend()
    c = client_for(backend, Host(1))
    put(c, 0, [0, 1], [key(0), key(1)])
    assert c.contains(key(1))
    backend.delete([c.name(key(1))])  # evicted by the pool
    assert c.lookup_prefix([key(0), key(1)]) == 1
    assert not c.contains(key(1))  # so the next write-through puts it again


def test_an_object_of_another_layout_under_our_name_is_a_miss_and_deleted():
    backend = MemoryBackend()
    put(client_for(backend, Host(1)), 0, [0], [key(0)])
    other = StorageClient(backend, workers=1, batch=2)
    bigger = BlobLayout(LAYOUT.namespace, "float32", (2, 2, 4, 2, 4), 4, KV_NBYTES, RT_NBYTES + 8)
    host = Host(3)
    other.bind(bigger, host.kv.__getitem__, lambda h: np.zeros(RT_NBYTES + 8, np.uint8))
    assert fetch(other, 1, [0], [key(0)]) == [0]
    assert other.stats()["foreign"] == 1 and other.stats()["corrupt"] == 0
    assert backend.exists([other.name(key(0))]) == [False]


def test_cost_model_fetches_only_when_cheaper_than_recompute():
    cost = FetchCostModel("file", workers=4, batch=16, block_nbytes=1 << 20, block_size=16)
    assert cost.blocks_to_fetch(64) == 64  # nothing measured: fetch
    cost.observe_prefill(16_000, 1.0)  # 16K tokens/s = 1K blocks/s
    for n in (1, 4, 16):  # a fast pool: 4 GB/s, 0.1 ms
        cost.observe_fetch(n << 20, 1e-4 + (n << 20) / 4e9)
    lat, bw = cost.call_model()
    assert lat == pytest.approx(1e-4, rel=0.05) and bw == pytest.approx(4e9, rel=0.05)
    assert cost.blocks_to_fetch(64) == 64
    slow = FetchCostModel("file", workers=4, batch=16, block_nbytes=1 << 20, block_size=16)
    slow.observe_prefill(16_000, 1.0)
    for n in (1, 4, 16):  # 20 MB/s: 52 ms per block > 1 ms
        slow.observe_fetch(n << 20, (n << 20) / 20e6)
    assert slow.blocks_to_fetch(64) == 0
    assert slow.decisions == {"fetch": 0, "partial": 0, "recompute": 1, "explore": 0}
    for _ in range(15):
        assert slow.blocks_to_fetch(64) == 0
    assert slow.blocks_to_fetch(64) == 64 and slow.decisions["explore"] == 1  # re-measure now and then
    laggy = FetchCostModel("redis", workers=4, batch=16, block_nbytes=1 << 10, block_size=16)
    laggy.observe_prefill(16_000, 1.0)
    for n in (1, 4, 16):  # 20 ms per call, fast bytes: pays only for long runs
        laggy.observe_fetch(n << 10, 0.02 + (n << 10) / 1e9)
    assert laggy.blocks_to_fetch(8) == 0 and laggy.blocks_to_fetch(4096) == 4096


def test_a_long_lookup_is_split_across_threads_and_counts_leading_keys():
    backend = MemoryBackend()
    c = client_for(backend, Host(1))
    keys = [i.to_bytes(32, "little") for i in range(600)]
    backend.put_from([c.name(k) for k in keys], [memoryview(b"x")] * 600)
    backend.delete([c.name(keys[417])])
    assert c.lookup_prefix(keys) == 417
    assert c.lookup_prefix(keys[:417]) == 417
