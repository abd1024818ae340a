"""file:// backend: atomic objects, size bound with eviction, several processes on one directory,
a private pool (modes, owner, no symlink followed), a full disk that evicts."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import stat
import threading
from typing import Any

import numpy as np
import pytest

from kvtier.storage import MISSING, TOO_LARGE, open_backend
from kvtier.storage.file import FileBackend


def blob(i: int, n: int = 4096) -> memoryview:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).data


def test_put_get_round_trip_and_exists(tmp_path):
    be = open_backend(f"file://{tmp_path}/pool?capacity=1MiB")
    names = [f"kvt:default:{i:064x}" for i in range(5)]
    assert be.put_from(names[:3], [blob(i) for i in range(3)]) == [True] * 3
    assert be.exists(names) == [True, True, True, False, False]
    bufs = [memoryview(bytearray(8192)) for _ in names]
    sizes = be.get_into(names, bufs)
    assert sizes[:3] == [4096] * 3 and sizes[3:] == [MISSING, MISSING]
    for i in range(3):
        assert bytes(bufs[i][:4096]) == bytes(blob(i))
    assert be.get_into(names[:1], [memoryview(bytearray(100))]) == [TOO_LARGE]
    be.delete(names[:1])
    assert be.exists(names[:1]) == [False]


def test_reads_fill_any_buffer_in_parts_and_size_objects_exactly(tmp_path):
    """Destinations of any buffer type and shape, an object split over parts, a short read
    (object smaller than the parts), and one byte too many (TOO_LARGE)."""
    be = FileBackend(str(tmp_path))
    data = np.arange(1000, dtype=np.float32)
    assert be.put_from(["a"], [data.data]) == [True]
    dsts: tuple[Any, ...] = (bytearray(4000), np.zeros(1000, np.float32), np.zeros((10, 100), np.float32).data)  # (any buffer)
    for dst in dsts:
        assert be.get_into(["a"], [dst]) == [4000]
        assert bytes(memoryview(dst).cast("B")) == data.tobytes()
    head, rest = bytearray(7), np.zeros((3, 1331), np.uint8)  # 7 + 3993 bytes
    assert be.get_into_parts(["a"], [[memoryview(head), rest.data]]) == [4000]
    assert bytes(head) + rest.tobytes() == data.tobytes()
    big = bytearray(4100)
    assert be.get_into_parts(["a"], [[memoryview(head), memoryview(big)]]) == [4000]  # a short object
    assert bytes(head) + bytes(big[:3993]) == data.tobytes()
    assert be.get_into(["a"], [memoryview(bytearray(3999))]) == [TOO_LARGE]


def test_a_second_open_sees_the_objects(tmp_path):
    FileBackend(str(tmp_path)).put_from(["a"], [blob(1)])
    again = FileBackend(str(tmp_path))
    buf = memoryview(bytearray(4096))
    assert again.get_into(["a"], [buf]) == [4096] and bytes(buf) == bytes(blob(1))


def test_capacity_is_kept_by_evicting_least_recently_used(tmp_path):
    capacity = 4096 + 10 * 3 * 4096  # the root, 10 objects and their two folders
    be = FileBackend(str(tmp_path), capacity_bytes=capacity)
    for i in range(30):
        assert be.put_from([f"o{i}"], [blob(i)]) == [True]
        if i == 5:
            be.get_into(["o0"], [memoryview(bytearray(4096))])  # o0 used recently
            os.utime(be.path_of("o0"), (2e9, 2e9))  # (mtime resolution: make it newest)
    present = be.exists([f"o{i}" for i in range(30)])
    assert sum(present) <= 10 and present[29] and present[0] and not present[1]
    assert be.evictions >= 20
    assert be.scan_nbytes() <= capacity


def test_no_temp_files_or_partial_objects_are_left(tmp_path):
    be = FileBackend(str(tmp_path))
    be.put_from([f"o{i}" for i in range(20)], [blob(i) for i in range(20)])
    leftovers = [f for _, _, files in os.walk(tmp_path) for f in files if f.startswith(".")]
    assert leftovers == []  # (no eviction ran: no .evict.lock either)


def _writer(root: str, start: int) -> None:
    be = FileBackend(root, capacity_bytes=40 * 4096)
    for i in range(start, start + 60):
        be.put_from([f"o{i % 70}"], [blob(i % 70)])
        buf = memoryview(bytearray(4096))
        j = (i * 7) % 70
        if be.get_into([f"o{j}"], [buf]) == [4096]:
            assert bytes(buf) == bytes(blob(j)), f"torn or wrong object o{j}"


def test_several_processes_share_one_directory(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), k * 20)) for k in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    be = FileBackend(str(tmp_path), capacity_bytes=40 * 4096)
    names = [f"o{i}" for i in range(70)]
    for name, ok in zip(names, be.exists(names)):
        if ok:
            buf = memoryview(bytearray(4096))
            assert be.get_into([name], [buf]) == [4096] and bytes(buf) == bytes(blob(int(name[1:])))
    assert be.scan_nbytes() <= 3 * 40 * 4096  # bounded (each process may overshoot by what it wrote)


@pytest.mark.parametrize(
    "url,msg",
    [
        ("file://relative/dir", "no host"),
        ("file:///", "needs a directory"),
        ("file:///tmp/x?capacity=lots", "bad size"),
        ("file:///tmp/x?size=1GiB", "unknown parameter 'size'"),
        ("ftp://host/x", "unknown storage URL scheme 'ftp'"),
        ("just-a-path", "storage must be a URL"),
    ],
)
def test_bad_urls_name_the_problem(url, msg):
    with pytest.raises(ValueError, match=msg):
        open_backend(url)


class StillClock:
    """``time`` as the throttle reads it: a clock that stands still, as if every transfer came at
    the same moment from a thread of its own, and a log of each sleep asked for."""

    def __init__(self) -> None:
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return 1000.0

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def test_throttle_paces_reads_and_writes_to_its_byte_rate(tmp_path, monkeypatch):
    """?throttle=4MB: 2 MiB written wait 2 MiB / 4 MB/s; transfers that come together share the
    one link, each waiting for those before it (2 MiB read: twice as long, then 1 MiB: 2.5 times).
    The clock is a fake and the sleeps asked for are the observable: a throttle that does not
    sleep, paces at another rate, per call instead of per byte, or lets transfers overtake each
    other asks for other sleeps."""
    import kvtier.storage.throttle

    clock = StillClock()
    monkeypatch.setattr(kvtier.storage.throttle, "time", clock)
    be = open_backend(f"file://{tmp_path}?throttle=4MB")
    t = 2 * (1 << 20) / 4e6  # 2 MiB on a 4 MB/s link

    assert be.put_from(["a", "b"], [blob(1, 1 << 20), blob(2, 1 << 20)]) == [True, True]
    bufs = [memoryview(bytearray(1 << 20)) for _ in range(2)]
    assert be.get_into(["a", "b"], bufs) == [1 << 20] * 2
    assert be.get_into(["a"], bufs[:1]) == [1 << 20]
    assert bytes(bufs[0]) == bytes(blob(1, 1 << 20)) and bytes(bufs[1]) == bytes(blob(2, 1 << 20))
    assert clock.slept == pytest.approx([t, 2 * t, 2.5 * t])
    assert "throttled" in be.describe()


# ---------------------------------------------------------------- a private pool
def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_root_shards_and_objects_are_private(tmp_path):
    be = FileBackend(str(tmp_path / "pool"))
    be.put_from(["a"], [blob(1)])
    obj = be.path_of("a")
    shard2, shard1 = os.path.dirname(obj), os.path.dirname(os.path.dirname(obj))
    assert (mode(tmp_path / "pool"), mode(shard1), mode(shard2), mode(obj)) == (0o700, 0o700, 0o700, 0o600)
    be.evict()
    assert mode(tmp_path / "pool" / ".evict.lock") == 0o600


def test_an_open_root_of_ours_is_tightened_with_a_warning(tmp_path, caplog):
    root = tmp_path / "pool"
    root.mkdir()
    os.chmod(root, 0o755)
    FileBackend(str(root))
    assert mode(root) == 0o700
    assert "tightened to 700" in caplog.text


def test_a_root_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "pool"
    root.mkdir(mode=0o700)
    me = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: me + 1000)  # the directory is someone else's
    with pytest.raises(ValueError, match=rf"{root}.* uid {me}, not by this process's uid {me + 1000}"):
        FileBackend(str(root))


def test_a_symlinked_root_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    (tmp_path / "pool").symlink_to(target)
    real_lstat, me = os.lstat, os.geteuid()

    def lstat(path, *a, **kw):
        st = real_lstat(path, *a, **kw)
        if str(path) == str(tmp_path / "pool"):  # the link is someone else's
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, me + 1000, *tuple(st)[5:]))
        return st

    monkeypatch.setattr(os, "lstat", lstat)
    with pytest.raises(ValueError, match="symlink owned by uid"):
        FileBackend(str(tmp_path / "pool"))


def test_a_planted_symlink_at_the_temp_path_is_not_followed(tmp_path):
    be = FileBackend(str(tmp_path / "pool"))
    be.put_from(["other"], [blob(0)])  # (the shard of "a" may differ)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    obj = be.path_of("a")
    os.makedirs(os.path.dirname(obj), exist_ok=True)
    tmp = os.path.join(os.path.dirname(obj), f".a.{os.getpid()}.{threading.get_ident()}.tmp")
    os.symlink(victim, tmp)

    assert be.put_from(["a"], [blob(1)]) == [True]

    assert victim.read_bytes() == b"precious"
    buf = memoryview(bytearray(4096))
    assert be.get_into(["a"], [buf]) == [4096] and bytes(buf) == bytes(blob(1))


def test_a_symlinked_object_is_not_read_and_is_replaced_by_a_put(tmp_path):
    be = FileBackend(str(tmp_path / "pool"))
    secret = tmp_path / "secret"
    secret.write_bytes(bytes(blob(9)))
    be.put_from(["b"], [blob(0)])
    obj = be.path_of("a")
    os.makedirs(os.path.dirname(obj), exist_ok=True)
    os.symlink(secret, obj)

    assert be.exists(["a"]) == [False]
    assert be.get_into(["a"], [memoryview(bytearray(4096))]) == [MISSING]
    assert be.put_from(["a"], [blob(1)]) == [True]
    assert not os.path.islink(obj) and secret.read_bytes() == bytes(blob(9))


# ---------------------------------------------------------------- a full disk
def full_disk_until_evicted(be: FileBackend, monkeypatch) -> list[str]:
    """Writes (``os.writev``) fail with ENOSPC until the pool evicted something; returns the log of
    each write tried, with the evictions the pool had counted by then."""
    events: list[str] = []
    real_writev = os.writev

    def writev(fd: int, buffers: list[memoryview]) -> int:
        evicted = be.stats()["evictions"]
        if not evicted:
            events.append("ENOSPC")
            raise OSError(errno.ENOSPC, "No space left on device")
        events.append(f"wrote after {evicted} evictions")
        return real_writev(fd, buffers)

    monkeypatch.setattr(os, "writev", writev)
    return events


def test_a_full_disk_evicts_the_oldest_fifth_then_writes(tmp_path, monkeypatch):
    be = FileBackend(str(tmp_path), capacity_bytes=100 * 4096)
    for i in range(10):
        be.put_from([f"o{i}"], [blob(i)])
        os.utime(be.path_of(f"o{i}"), (1e9 + i, 1e9 + i))  # o0 oldest
    events = full_disk_until_evicted(be, monkeypatch)

    assert be.put_from(["new"], [blob(99)]) == [True]

    assert events == ["ENOSPC", "wrote after 2 evictions"]  # the oldest fifth of 10 objects, then the write
    assert be.exists([f"o{i}" for i in range(10)]) == [False, False] + [True] * 8  # down to 80%
    assert be.exists(["new"]) == [True]
    assert be.stats()["full_disk_evictions"] == 1


def test_a_disk_that_stays_full_refuses_the_put(tmp_path, monkeypatch):
    be = FileBackend(str(tmp_path), capacity_bytes=100 * 4096)
    be.put_from(["o0"], [blob(0)])

    def writev(fd: int, buffers: list[memoryview]) -> int:
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr(os, "writev", writev)

    assert be.put_from(["a", "b"], [blob(1), blob(2)]) == [False, False]  # refused, not an error
    assert be.stats()["full_disk_evictions"] == 1  # one eviction per call
    assert be.stats()["full_disk_refused"] == 2
