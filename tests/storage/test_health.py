"""StorageClient.health(): the pool's state for /health, read without I/O; a background probe
lets an idle engine notice a dead pool and a revived one."""

from __future__ import annotations

import threading
import time

from kvtier.storage import MemoryBackend, StorageClient
from kvtier.storage.base import StorageError

SHAPE = {"ok", "reason", "backend", "breaker_open", "failures_in_a_row", "last_error", "last_error_s_ago", "last_ok_s_ago"}


class Switchable(MemoryBackend):
    """exists() raises while ``down`` and blocks while ``release`` is clear; counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.calls = 0
        self.release = threading.Event()
        self.release.set()

    def exists(self, names):
        self.calls += 1
        self.release.wait()
        if self.down:
            raise StorageError("connection refused (test)")
        return super().exists(names)


def eventually(predicate, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_a_working_pool_is_healthy():
    c = StorageClient(MemoryBackend())
    assert c.lookup_prefix([b"k" * 32]) == 0
    h = c.health()
    assert set(h) == SHAPE
    assert h["ok"] is True and h["reason"] is None and h["breaker_open"] is False
    assert h["backend"].startswith("memory://") and 0 <= h["last_ok_s_ago"] < 5
    c.close()


def test_health_does_no_io():
    backend = Switchable()
    c = StorageClient(backend, probe_interval=None)
    for _ in range(100):
        c.health()
    assert backend.calls == 0
    c.close()


def test_an_idle_client_notices_a_dead_pool_then_its_revival():
    backend = Switchable()
    c = StorageClient(backend, probe_interval=0.05, breaker_threshold=3, breaker_cooldown=0.1)
    backend.down = True

    assert eventually(lambda: not c.health()["ok"])  # no request needed: the probe
    assert "connection refused" in c.health()["reason"]
    assert eventually(lambda: c.health()["breaker_open"])  # probes count toward the breaker
    assert "circuit breaker open" in c.health()["reason"]

    backend.down = False
    assert eventually(lambda: c.health()["ok"])
    h = c.health()
    assert h["reason"] is None and not h["breaker_open"] and h["last_ok_s_ago"] < 5
    assert c.lookup_prefix([b"k" * 32]) == 0 and not c.breaker.is_open  # requests use it again
    c.close()


def test_a_hung_pool_is_unhealthy_and_health_does_not_wait_for_it():
    backend = Switchable()
    backend.release.clear()  # every call blocks
    c = StorageClient(backend, probe_interval=0.05, probe_timeout=0.2)
    assert eventually(lambda: backend.calls == 1)  # the probe is stuck in the backend

    assert eventually(lambda: not c.health()["ok"])  # while the backend call still hangs
    assert backend.calls == 1 and "has not answered a probe" in c.health()["reason"]
    backend.release.set()
    assert eventually(lambda: c.health()["ok"])
    c.close()


def test_close_stops_the_probe_thread():
    before = set(threading.enumerate())
    c = StorageClient(MemoryBackend(), probe_interval=0.05)
    (thread,) = [t for t in threading.enumerate() if t not in before and t.name == "kvtier-storage-probe"]
    assert thread.is_alive()
    c.close()
    assert not thread.is_alive()


def test_a_busy_healthy_pool_is_not_probed():
    backend = Switchable()
    c = StorageClient(backend, probe_interval=0.1)
    end = time.monotonic() + 0.5
    lookups = 0
    while time.monotonic() < end:  # a call succeeds every 10 ms
        c.lookup_prefix([b"k" * 32])
        lookups += 1
        time.sleep(0.01)
    assert backend.calls == lookups
    c.close()


def test_a_stopped_valkey_server_is_noticed_and_so_is_its_return(make_valkey):
    from kvtier.storage import open_backend

    server = make_valkey()
    c = StorageClient(open_backend(f"{server.url}?timeout=0.3"), probe_interval=0.1, probe_timeout=2.0)
    assert eventually(lambda: c.health()["last_ok_s_ago"] is not None)  # a first probe answered
    assert c.health()["ok"]

    server.pause()  # SIGSTOP: connections hang
    try:
        assert eventually(lambda: not c.health()["ok"])
        assert c.health()["reason"]
    finally:
        server.resume()
    assert eventually(lambda: c.health()["ok"])
    c.close()
