"""MooncakeBackend against a real mooncake_master + pool node over TCP on 127.0.0.1.

Fixtures ``mooncake_launch`` / ``make_mooncake_launch`` come from ``mooncake_servers.py`` (via the
conftest); without the ``mooncake`` package they skip with the reason. The URL tests and the
missing-package test run everywhere.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from kvtier.storage.base import MISSING, TOO_LARGE, StorageError
from kvtier.storage.mooncake import MooncakeBackend, parse_mooncake_url

ROOT = Path(__file__).resolve().parents[2]
_seq = [0]


def names(n: int, tag: str = "t") -> list[str]:
    _seq[0] += 1
    return [f"kvt:default:{tag}{_seq[0]:06d}{i:058x}" for i in range(n)]


def payloads(sizes, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, s, dtype=np.uint8).tobytes() for s in sizes]


class Arena:
    """A registered staging arena handing out consecutive slices."""

    def __init__(self, backend: MooncakeBackend, nbytes: int) -> None:
        self.mem = np.zeros(nbytes, dtype=np.uint8)
        backend.register_buffer(self.mem.data)
        self.off = 0

    def take(self, n: int, fill: bytes | None = None) -> memoryview:
        assert self.off + n <= self.mem.nbytes
        v = self.mem.data[self.off : self.off + n]
        self.off += n
        if fill is not None:
            v[:] = fill
        return v


@pytest.fixture(scope="module")
def backend(mooncake_launch):
    """One client for the module (closing a Mooncake client takes ~1 s)."""
    b = MooncakeBackend.from_url(mooncake_launch.url)
    yield b
    b.close()


def delta(backend: MooncakeBackend, before: dict) -> dict:
    now = backend.stats()
    return {k: v - before[k] for k, v in now.items() if isinstance(v, int) and not isinstance(v, bool)}


HANG_S = 60.0  # bounds a call that hangs; every bound the backend sets (timeout=1..2 s, retries) is far below it


def bounded(fn: Callable[..., Any], *args: Any) -> Any:
    """What ``fn(*args)`` returns, or the StorageError it raises, run on a thread of its own: a
    call still running after HANG_S hung (the client library's own waits are 30 s each, its
    set-up retries minutes) and fails the test. How fast a call gives up is the storage
    bench's to measure. Other exceptions go on to the test."""
    outcome: list[Any] = []
    raised: list[BaseException] = []

    def call() -> None:
        try:
            outcome.append(fn(*args))
        except StorageError as e:
            outcome.append(e)
        except BaseException as e:  # re-raised on the test's thread below
            raised.append(e)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(HANG_S)
    if thread.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} hung: no answer, no error after {HANG_S:g} s")
    if raised:
        raise raised[0]
    return outcome[0]


# ------------------------------------------------------------------------------------------------
# URLs and packaging (no pool needed)


@pytest.mark.parametrize(
    "url, word",
    [
        ("mooncake://", "host:port"),
        ("mooncake://127.0.0.1", "port"),
        ("mooncake://127.0.0.1:notaport", "port"),
        ("mooncake://127.0.0.1:0", "port"),
        ("mooncake://127.0.0.1:99999", "port"),
        ("mooncake://127.0.0.1:50051?protocol=udp", "protocol"),
        ("mooncake://127.0.0.1:50051?segment=lots", "segment"),
        ("mooncake://127.0.0.1:50051?local_buffer=0", "local_buffer"),
        ("mooncake://127.0.0.1:50051?timeout=soon", "timeout"),
        ("mooncake://127.0.0.1:50051?timeout=-1", "timeout"),
        ("mooncake://127.0.0.1:50051?bogus=1", "bogus"),
        ("mooncake://127.0.0.1:50051?protocol=tcp&protocol=rdma", "protocol"),
        ("mooncake://127.0.0.1:50051?metadata=", "metadata"),
        ("mooncake://127.0.0.1:50051/some/path", "path"),
        ("mooncake://user:pw@127.0.0.1:50051", "password"),
        ("redis://127.0.0.1:50051", "mooncake"),
    ],
)
def test_bad_urls_raise_value_error_naming_the_part(url, word):
    with pytest.raises(ValueError, match=re.escape(word)):
        MooncakeBackend.from_url(url)


def test_url_parsing():
    kw = parse_mooncake_url(
        "mooncake://10.0.0.2:5000?protocol=tcp&segment=4GiB&local_buffer=8MiB&metadata=P2PHANDSHAKE&timeout=2.5"
    )
    assert kw == dict(
        host="10.0.0.2", port=5000, protocol="tcp", segment=4 << 30, local_buffer=8 << 20, metadata="P2PHANDSHAKE", timeout=2.5
    )
    assert parse_mooncake_url("mooncake://h:1") == dict(host="h", port=1)
    assert parse_mooncake_url("mooncake://h:1?segment=0")["segment"] == 0


def test_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import fails
    with pytest.raises(ImportError, match=re.escape("pip install 'kvtier[mooncake]'")) as e:
        MooncakeBackend.from_url("mooncake://127.0.0.1:50051?protocol=tcp")
    assert "mooncake-transfer-engine-non-cuda" in str(e.value)


# ------------------------------------------------------------------------------------------------
# data path


SIZES = [1, 4096, 100_003, 1 << 20, (4 << 20) - 7]


def test_round_trip_zero_copy_is_byte_exact(backend):
    data = payloads(SIZES, seed=1)
    ks = names(len(data))
    arena = Arena(backend, 2 * sum(SIZES) + 4096)
    before = backend.stats()
    src = [arena.take(len(d), d) for d in data]
    assert backend.put_from(ks, src) == [True] * len(ks)
    dst = [arena.take(len(d) + 100) for d in data]  # bigger buffers are fine
    assert backend.get_into(ks, dst) == SIZES
    for d, v in zip(data, dst):
        assert bytes(v[: len(d)]) == d
    s = delta(backend, before)
    assert s["zero_copy_items"] == 2 * len(ks) and s["bounce_items"] == 0
    assert s["bytes_written"] == sum(SIZES) and s["bytes_read"] == sum(SIZES)
    assert s["round_trips"] == 2 and s["hits"] == len(ks)


def test_round_trip_fallback_unregistered_buffers(backend):
    data = payloads(SIZES, seed=2)
    ks = names(len(data))
    before = backend.stats()
    srcs = [
        memoryview(data[0]),
        memoryview(bytearray(data[1])),  # read-only, bytearray,
        np.frombuffer(data[2], np.uint8).copy().data,  # numpy
        np.frombuffer(data[3], np.uint8).reshape(256, -1).data,  # 2-D, read-only
        memoryview(bytearray(data[4])),
    ]
    assert backend.put_from(ks, srcs) == [True] * len(ks)
    dst = [bytearray(len(d)) for d in data]
    assert backend.get_into(ks, [memoryview(b) for b in dst]) == SIZES
    assert [bytes(b) for b in dst] == data
    s = delta(backend, before)
    assert s["bounce_items"] == 2 * len(ks) and s["zero_copy_items"] == 0


def test_mixed_registered_and_unregistered_in_one_batch(backend):
    data = payloads([300_000] * 4, seed=3)
    ks = names(4)
    arena = Arena(backend, 4 << 20)
    assert (
        backend.put_from(
            ks, [arena.take(len(data[0]), data[0]), memoryview(data[1]), arena.take(len(data[2]), data[2]), memoryview(data[3])]
        )
        == [True] * 4
    )
    loose = [bytearray(len(data[0])) for _ in range(2)]
    dst = [memoryview(loose[0]), arena.take(len(data[1])), memoryview(loose[1]), arena.take(len(data[3]))]
    assert backend.get_into(ks, dst) == [300_000] * 4
    assert [bytes(v) for v in dst] == data


def test_exists_missing_and_too_large(backend):
    data = payloads([1 << 20, 5000], seed=4)
    ks = names(2)
    assert backend.put_from(ks, [memoryview(d) for d in data]) == [True, True]
    before = backend.stats()
    absent = names(2, "absent")
    assert backend.exists([absent[0], ks[0], absent[1], ks[1]]) == [False, True, False, True]
    assert backend.exists([]) == []
    arena = Arena(backend, 2 << 20)
    for small in (memoryview(bytearray(1000)), arena.take(1000)):  # fallback and zero-copy
        big = memoryview(bytearray(6000))
        got = backend.get_into([ks[0], absent[0], ks[1]], [small, big, memoryview(bytearray(5000))])
        assert got == [TOO_LARGE, MISSING, 5000]
    assert backend.get_into(absent, [arena.take(10), memoryview(bytearray(10))]) == [MISSING, MISSING]
    s = delta(backend, before)
    assert s["too_large"] == 2 and s["misses"] == 4 and s["errors"] == 0


def test_put_of_an_existing_name_keeps_the_first_value(backend):
    k = names(1)
    first, second = payloads([2000, 2000], seed=5)
    assert backend.put_from(k, [memoryview(first)]) == [True]
    assert backend.put_from(k, [memoryview(second)]) == [True]
    buf = bytearray(2000)
    assert backend.get_into(k, [memoryview(buf)]) == [2000]
    assert bytes(buf) == first


def test_delete(mooncake_launch, backend):
    ks = names(3)
    assert all(backend.put_from(ks, [memoryview(b"x" * 1000)] * 3))
    backend.delete([ks[0], names(1, "never")[0]])  # a missing name is fine
    assert backend.exists(ks) == [False, True, True]
    backend.get_into(ks[1:2], [memoryview(bytearray(1000))])
    backend.delete(ks[1:2])  # just read: leased for a while; best effort, no error
    time.sleep(mooncake_launch.lease_ttl_ms / 1000 + 0.2)  # (exists() takes a lease too)
    backend.delete(ks[1:2])
    assert backend.exists(ks) == [False, False, True]
    backend.delete([])


def test_two_clients_see_each_others_objects(mooncake_launch):
    a = MooncakeBackend.from_url(mooncake_launch.url)
    b = MooncakeBackend.from_url(mooncake_launch.url + "&timeout=3")
    try:
        ka, kb = names(2, "a"), names(2, "b")
        da, db = payloads([70_000, 1 << 20], seed=6), payloads([123, 2 << 20], seed=7)
        assert a.put_from(ka, [memoryview(d) for d in da]) == [True, True]
        assert b.put_from(kb, [memoryview(d) for d in db]) == [True, True]
        assert a.exists(kb) == [True, True] and b.exists(ka) == [True, True]
        bufs = [bytearray(len(d)) for d in db]
        assert a.get_into(kb, [memoryview(x) for x in bufs]) == [len(d) for d in db]
        assert [bytes(x) for x in bufs] == db
        arena = Arena(b, 1 << 20)
        v = arena.take(70_000)
        assert b.get_into(ka[:1], [v]) == [70_000] and bytes(v) == da[0]
    finally:
        a.close()
        b.close()


def test_four_threads_share_one_backend(backend):
    n_threads, per, size, rounds = 4, 4, 256 << 10, 12
    arena = Arena(backend, n_threads * 2 * per * size)
    shared = names(per, "shared")
    shared_data = payloads([size] * per, seed=8)
    errors: list[str] = []

    def work(t: int) -> None:
        src = [arena.mem[(t * 2 * per + j) * size : (t * 2 * per + j + 1) * size] for j in range(per)]
        dst = [arena.mem[(t * 2 * per + per + j) * size : (t * 2 * per + per + j + 1) * size] for j in range(per)]
        try:
            for r in range(rounds):
                ks = names(per, f"th{t}")
                data = payloads([size] * per, seed=1000 * t + r)
                for s_, d in zip(src, data):
                    s_[:] = np.frombuffer(d, np.uint8)
                if backend.put_from(ks, [s_.data for s_ in src]) != [True] * per:
                    errors.append("put refused")
                got = backend.get_into(ks, [d_.data for d_ in dst])
                for j in range(per):
                    if got[j] != size or dst[j].tobytes() != data[j]:
                        errors.append(f"thread {t} round {r} item {j}: {got[j]}")
                backend.put_from(shared, [memoryview(d) for d in shared_data])  # same names
                loose = [bytearray(size) for _ in range(per)]
                got = backend.get_into(shared, [memoryview(x) for x in loose])
                if got != [size] * per or [bytes(x) for x in loose] != shared_data:
                    errors.append(f"thread {t} shared read {got}")
                if backend.exists(ks) != [True] * per:
                    errors.append("exists")
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads)
    assert errors == []


def test_close_is_idempotent_and_later_calls_raise(mooncake_launch):
    b = MooncakeBackend.from_url(mooncake_launch.url)
    assert b.exists(names(1)) == [False]
    b.close()
    b.close()
    with pytest.raises(StorageError):
        b.exists(names(1))
    assert b.describe().startswith(mooncake_launch.url)


def test_unreachable_master_is_a_storage_error_naming_it():
    """Every call against a master nobody listens for gives up with an error that says so (the
    port refused: the set-up, whose retries against a dead master take minutes, is not tried)."""
    from kvtier.storage.mooncake_launch import free_port

    port = free_port()
    b = bounded(MooncakeBackend.from_url, f"mooncake://127.0.0.1:{port}?protocol=tcp&timeout=2")
    try:
        for _ in range(3):
            for err in (bounded(b.exists, ["x"]), bounded(b.get_into, ["x"], [memoryview(bytearray(10))])):
                assert isinstance(err, StorageError), err
                assert f"127.0.0.1:{port}" in str(err) and ("unreachable" in str(err) or "retrying shortly" in str(err)), err
        s = b.stats()
        assert s["connected"] is False and s["connect_failures"] == s["connects"] >= 1
    finally:
        bounded(b.close)


# ------------------------------------------------------------------------------------------------
# a pool that fills up, dies or hangs


def test_a_full_pool_refuses_or_evicts_never_raises(make_mooncake_launch):
    pool = make_mooncake_launch(size="24MiB", lease_ttl_ms=200)
    b = MooncakeBackend.from_url(pool.url)
    try:
        size, n = 1 << 20, 60  # 60 MiB into 24 MiB
        arena = Arena(b, 4 * size)
        written: dict[str, bytes] = {}
        refused = 0
        for i in range(0, n, 4):
            ks = names(4, "fill")
            data = payloads([size] * 4, seed=i)
            for j, d in enumerate(data):
                arena.mem[j * size : (j + 1) * size] = np.frombuffer(d, np.uint8)
            ok = b.put_from(ks, [arena.mem[j * size : (j + 1) * size].data for j in range(4)])
            refused += ok.count(False)
            written.update({k: d for k, d, o in zip(ks, data, ok) if o})
        ks = list(written)
        present = b.exists(ks)
        assert refused > 0 or not all(present), "nothing was refused or evicted"
        hits = 0
        for i in range(0, len(ks), 4):
            chunk = ks[i : i + 4]
            dst = [arena.mem[j * size : (j + 1) * size] for j in range(len(chunk))]
            for view in dst:
                view[:] = 0xAB
            got = b.get_into(chunk, [view.data for view in dst])
            for k, g, view in zip(chunk, got, dst):
                assert g in (size, MISSING)
                if g == size:
                    hits += 1
                    assert view.tobytes() == written[k]  # never wrong bytes
        assert 0 < hits < n
        time.sleep(0.5)  # eviction makes room again
        assert b.put_from(names(1, "late"), [memoryview(b"y" * size)]) in ([True], [False])
    finally:
        b.close()


def test_a_killed_pool_node_or_master_is_an_error_or_a_miss_in_bounded_time(make_mooncake_launch):
    pool = make_mooncake_launch(size="64MiB")
    b = MooncakeBackend.from_url(pool.url + "&timeout=2")
    try:
        data = payloads([1 << 20] * 4, seed=9)
        ks = names(4, "dead")
        arena = Arena(b, 8 << 20)
        assert b.put_from(ks, [arena.take(len(d), d) for d in data]) == [True] * 4
        pool.kill_node()
        dst = [arena.take(1 << 20) for _ in ks]
        for v in dst:
            v[:] = b"\xee" * len(v)
        for call, args in (
            (b.get_into, (ks, dst)),
            (b.exists, (ks,)),
            (b.put_from, (names(2, "after"), [memoryview(d) for d in data[:2]])),
            (b.get_into, (ks, [memoryview(bytearray(1 << 20)) for _ in ks])),
        ):
            result = bounded(call, *args)
            if call.__name__ == "get_into" and not isinstance(result, StorageError):
                assert all(r == MISSING for r in result), result  # the data died with the node
            if call.__name__ == "put_from" and not isinstance(result, StorageError):
                assert result == [False, False]
        assert "TRANSFER_FAIL" in str(bounded(b.get_into, ks, dst))  # -800: a StorageError
        assert all(bytes(v) == b"\xee" * len(v) for v in dst)  # nothing half-written
        pool.kill_master()
        calls: tuple[tuple[Callable[..., Any], tuple[Any, ...]], ...] = (
            (b.exists, (ks,)),
            (b.get_into, (ks, dst)),
            (b.put_from, (ks[:1], [memoryview(data[0])])),
            (b.delete, (ks,)),
        )
        for call, args in calls:
            result = bounded(call, *args)
            assert isinstance(result, StorageError), (call.__name__, result)
        assert b.stats()["errors"] >= 5
    finally:
        bounded(b.close)  # it waits for calls in flight, each bounded: it never hangs


def test_a_hung_pool_node_costs_a_timeout_not_a_hang(make_mooncake_launch):
    pool = make_mooncake_launch(size="64MiB")
    b = MooncakeBackend.from_url(pool.url + "&timeout=1")
    try:
        data = payloads([1 << 20] * 2, seed=10)
        ks = names(2, "hung")
        arena = Arena(b, 4 << 20)
        assert b.put_from(ks, [arena.take(len(d), d) for d in data]) == [True, True]
        pool.pause_node()  # SIGSTOP: connections accepted, never answered
        dst = [arena.take(1 << 20), arena.take(1 << 20)]
        result = bounded(b.get_into, ks, dst)
        assert isinstance(result, StorageError) and "TRANSFER_FAIL" in str(result), result  # its TCP timeout
        result = bounded(b.put_from, names(2, "hung2"), [memoryview(d) for d in data])
        assert isinstance(result, StorageError) or result == [False, False], result
        pool.resume_node()  # back: after reconnecting, hits or misses
        deadline = time.monotonic() + HANG_S
        while True:
            got = bounded(b.get_into, ks, dst)
            if not isinstance(got, StorageError) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not isinstance(got, StorageError), got
        for g, v, d in zip(got, dst, data):
            assert g in (len(d), MISSING)
            if g == len(d):
                assert bytes(v) == d
    finally:
        pool.resume_node()
        b.close()


# ------------------------------------------------------------------------------------------------
# the pool command


def test_pool_command_prints_the_url_and_stops_both_processes_on_sigterm(tmp_path):
    from kvtier.storage.mooncake_launch import free_port
    from tests.storage.mooncake_servers import mooncake_unavailable

    if why := mooncake_unavailable():
        pytest.skip(why)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvtier.storage.mooncake_launch",
            "--port",
            str(port),
            "--size",
            "32MiB",
            "--workdir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert p.stdout is not None
    pids: list[int] = []
    try:
        lines = []
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"master pid (\d+), node pid (\d+)", line)
            if m:
                pids = [int(m.group(1)), int(m.group(2))]
            if line.startswith("mooncake://"):
                break
        url = f"mooncake://127.0.0.1:{port}?protocol=tcp"
        assert lines and lines[-1].strip() == url, "".join(lines)
        b = MooncakeBackend.from_url(url)
        try:
            k = names(1, "cli")
            assert b.put_from(k, [memoryview(b"z" * 4096)]) == [True]
            assert b.exists(k) == [True]
        finally:
            b.close()
        p.send_signal(signal.SIGTERM)
        assert p.wait(HANG_S) == 0
        for pid in pids:  # reaped by the command
            deadline = time.monotonic() + HANG_S
            while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not os.path.exists(f"/proc/{pid}"), f"pid {pid} left running"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
