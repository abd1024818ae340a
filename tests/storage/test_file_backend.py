"""file:// backend: atomic objects, size bound with eviction, several processes on one directory."""
from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pytest

from kvtier.storage import MISSING, TOO_LARGE, open_backend
from kvtier.storage.file import FileBackend


def blob(i: int, n: int = 4096) -> memoryview:
    return memoryview(np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8))


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


def test_a_second_open_sees_the_objects(tmp_path):
    FileBackend(str(tmp_path)).put_from(["a"], [blob(1)])
    again = FileBackend(str(tmp_path))
    buf = memoryview(bytearray(4096))
    assert again.get_into(["a"], [buf]) == [4096] and bytes(buf) == bytes(blob(1))


def test_capacity_is_kept_by_evicting_least_recently_used(tmp_path):
    be = FileBackend(str(tmp_path), capacity_bytes=10 * 4096)
    for i in range(30):
        assert be.put_from([f"o{i}"], [blob(i)]) == [True]
        if i == 5:
            be.get_into(["o0"], [memoryview(bytearray(4096))])      # o0 used recently
            os.utime(os.path.join(be._path("o0")), (2e9, 2e9))      # (mtime resolution: make it newest)
    present = be.exists([f"o{i}" for i in range(30)])
    assert sum(present) <= 10 and present[29] and present[0] and not present[1]
    assert be.evictions >= 20
    assert be._scan_size() <= 10 * 4096


def test_no_temp_files_or_partial_objects_are_left(tmp_path):
    be = FileBackend(str(tmp_path))
    be.put_from([f"o{i}" for i in range(20)], [blob(i) for i in range(20)])
    leftovers = [f for _, f, _ in be._files() if f.startswith(".")]
    assert leftovers == []


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
    assert be._scan_size() <= 3 * 40 * 4096       # bounded (each process may overshoot by what it wrote)


@pytest.mark.parametrize("url,msg", [
    ("file://relative/dir", "no host"),
    ("file:///", "needs a directory"),
    ("file:///tmp/x?capacity=lots", "bad size"),
    ("file:///tmp/x?size=1GiB", "unknown parameter 'size'"),
    ("ftp://host/x", "unknown storage URL scheme 'ftp'"),
    ("just-a-path", "storage must be a URL"),
])
def test_bad_urls_name_the_problem(url, msg):
    with pytest.raises(ValueError, match=msg):
        open_backend(url)


def test_throttle_slows_reads_and_writes(tmp_path):
    import time
    be = open_backend(f"file://{tmp_path}?throttle=4MB")
    t0 = time.monotonic()
    be.put_from(["a", "b"], [blob(1, 1 << 20), blob(2, 1 << 20)])      # 2 MiB at 4 MB/s
    assert time.monotonic() - t0 >= 0.45
    assert "throttled" in be.describe()
