"""file:// pool: nothing found under the root is trusted. Shard folders planted as symlinks (to
another user's directory) or owned by another user are never used, a planted ``.evict.lock`` does
not turn eviction off, and the capacity bounds what the pool really takes on disk, its shard
folders included."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvtier.storage import MISSING
from kvtier.storage.file import FileBackend

OTHER_UID = 54321
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")


def blob(i: int, n: int = 4096) -> memoryview:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).data


def name(i: int) -> str:
    return f"kvt:default:{i:064x}"


def shard(n: str) -> str:
    """``aa/bb``: the shard folders of object ``n``."""
    h = xxhash.xxh64_hexdigest(n.encode())
    return f"{h[:2]}/{h[2:4]}"


def names_in(prefix: str, count: int, start: int = 0) -> list[str]:
    """``count`` object names whose shard path starts with ``prefix`` (``aa`` or ``aa/bb``)."""
    out: list[str] = []
    i = start
    while len(out) < count:
        if shard(name(i)).startswith(prefix):
            out.append(name(i))
        i += 1
    return out


def snapshot(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under ``root``: (size, mtime, content)."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            st = os.lstat(p)
            out[p] = (st.st_size, st.st_mtime_ns, Path(p).read_bytes())
    return out


def disk_use(root: Path) -> int:
    """Bytes that ``root`` and everything under it take on disk (blocks, at least the size)."""
    total = 0
    for dirpath, dirs, files in os.walk(root):
        for p in [dirpath, *(os.path.join(dirpath, f) for f in files)]:
            st = os.lstat(p)
            total += max(st.st_blocks * 512, st.st_size)
    return total


def object_bytes(root: Path) -> int:
    return sum(os.lstat(p).st_size for p in root.glob("*/*/*") if not p.name.startswith("."))


def warnings_about(caplog, path: str) -> int:
    return sum(f"{path} " in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def victim_pool(tmp_path: Path, names: list[str]) -> Path:
    """Another pool (standing for another user's directory) holding ``names``."""
    victim = FileBackend(str(tmp_path / "victim"))
    assert victim.put_from(names, [blob(i) for i in range(len(names))]) == [True] * len(names)
    return tmp_path / "victim"


# ---------------------------------------------------------------- planted shard folders
def test_first_level_shards_planted_as_symlinks_are_never_followed(tmp_path, caplog):
    stored = [name(i) for i in range(64)]
    victim = victim_pool(tmp_path, stored)
    pool = tmp_path / "pool"
    pool.mkdir(mode=0o700)
    for i in range(256):  # every first-level shard points into the other directory
        (pool / f"{i:02x}").symlink_to(victim / f"{i:02x}", target_is_directory=True)
    before = snapshot(victim)
    be = FileBackend(str(pool), capacity_bytes=1 << 20)

    assert be.exists(stored) == [False] * 64
    bufs = [memoryview(bytearray(4096)) for _ in stored]
    assert be.get_into(stored, bufs) == [MISSING] * 64  # no hit served from the other directory
    fresh = [name(i) for i in range(1000, 1064)]
    assert be.put_from(fresh, [blob(i) for i in range(64)]) == [False] * 64  # refused, not raised
    be.delete(stored)
    be.evict()

    assert snapshot(victim) == before  # nothing read, written, touched or removed there
    for n in stored + fresh:  # each bad folder named once, however often it was met
        assert warnings_about(caplog, f"{pool}/{shard(n)[:2]}") == 1
    assert all(os.path.islink(pool / f"{i:02x}") for i in range(256))  # left as they are


def test_a_second_level_shard_planted_as_a_symlink_is_never_followed(tmp_path, caplog):
    stored = names_in("", 8)
    victim = victim_pool(tmp_path, stored)
    target = stored[0]
    d1, d2 = shard(target).split("/")
    pool = tmp_path / "pool"
    (pool / d1).mkdir(parents=True, mode=0o700)
    os.chmod(pool, 0o700)
    (pool / d1 / d2).symlink_to(victim / d1 / d2, target_is_directory=True)
    before = snapshot(victim)
    be = FileBackend(str(pool), capacity_bytes=1 << 20)

    assert be.exists([target]) == [False]
    assert be.get_into([target], [memoryview(bytearray(4096))]) == [MISSING]
    neighbour = names_in(f"{d1}/{d2}", 1, start=10_000)[0]
    assert be.put_from([neighbour], [blob(5)]) == [False]
    be.delete([target])
    assert snapshot(victim) == before
    assert warnings_about(caplog, f"{pool}/{d1}/{d2}") == 1

    # the rest of the pool works: another second-level shard of the same first-level one
    other = next(n for n in names_in(d1, 64, start=20_000) if shard(n) != f"{d1}/{d2}")
    assert be.put_from([other], [blob(6)]) == [True]
    buf = memoryview(bytearray(4096))
    assert be.get_into([other], [buf]) == [4096] and bytes(buf) == bytes(blob(6))


@as_root
@pytest.mark.parametrize("level", [1, 2])
def test_a_shard_owned_by_another_user_is_never_used(tmp_path, caplog, level):
    pool = tmp_path / "pool"
    FileBackend(str(pool)).put_from([name(1)], [blob(1)])
    d1, d2 = shard(name(1)).split("/")
    folder = pool / d1 if level == 1 else pool / d1 / d2
    os.chown(folder, OTHER_UID, OTHER_UID)  # as if another user had made it
    be = FileBackend(str(pool))

    assert be.exists([name(1)]) == [False]
    assert be.get_into([name(1)], [memoryview(bytearray(4096))]) == [MISSING]
    neighbour = names_in(f"{d1}/{d2}", 1, start=10_000)[0]
    assert be.put_from([neighbour], [blob(2)]) == [False]
    be.delete([name(1)])
    be.evict()
    assert os.path.isfile(pool / d1 / d2 / name(1))  # not removed either
    assert os.lstat(folder).st_uid == OTHER_UID
    assert warnings_about(caplog, str(folder)) == 1
    assert "owned by uid" in caplog.text


def test_an_open_shard_of_ours_is_tightened_with_a_warning(tmp_path, caplog):
    pool = tmp_path / "pool"
    FileBackend(str(pool)).put_from([name(1)], [blob(1)])
    d1, d2 = shard(name(1)).split("/")
    os.chmod(pool / d1, 0o777)
    os.chmod(pool / d1 / d2, 0o757)
    be = FileBackend(str(pool))

    buf = memoryview(bytearray(4096))
    assert be.get_into([name(1)], [buf]) == [4096] and bytes(buf) == bytes(blob(1))
    assert stat.S_IMODE(os.lstat(pool / d1).st_mode) == 0o700
    assert stat.S_IMODE(os.lstat(pool / d1 / d2).st_mode) == 0o700
    assert "tightened to 700" in caplog.text


@as_root
def test_files_planted_in_an_open_shard_of_ours_are_removed_when_it_is_tightened(tmp_path, caplog):
    pool = tmp_path / "pool"
    FileBackend(str(pool)).put_from([name(1)], [blob(1)])
    d1, d2 = shard(name(1)).split("/")
    os.chmod(pool / d1 / d2, 0o777)
    planted = names_in(f"{d1}/{d2}", 1, start=10_000)[0]  # a poisoned object, by another user
    (pool / d1 / d2 / planted).write_bytes(bytes(blob(9)))
    os.chown(pool / d1 / d2 / planted, OTHER_UID, OTHER_UID)
    be = FileBackend(str(pool))

    assert be.exists([planted, name(1)]) == [False, True]
    assert be.get_into([planted], [memoryview(bytearray(4096))]) == [MISSING]
    assert not os.path.lexists(pool / d1 / d2 / planted)
    assert planted in caplog.text


# ---------------------------------------------------------------- a planted eviction lock
def planted_lock(tmp_path: Path, kind: str) -> Path:
    pool = tmp_path / "pool"
    pool.mkdir(mode=0o700)
    lock = pool / ".evict.lock"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"not the pool's")
    if kind == "symlink":
        lock.symlink_to(elsewhere)
    elif kind == "dangling symlink":
        lock.symlink_to(tmp_path / "nowhere")
    elif kind == "directory":
        lock.mkdir()
    else:  # "another user's file"
        lock.write_bytes(b"")
        os.chown(lock, OTHER_UID, OTHER_UID)
    return lock


@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "directory", pytest.param("another user's file", marks=as_root)])
def test_a_planted_eviction_lock_does_not_turn_eviction_off(tmp_path, caplog, kind):
    lock = planted_lock(tmp_path, kind)
    capacity = 256 << 10
    be = FileBackend(str(tmp_path / "pool"), capacity_bytes=capacity)
    for i in range(200):
        assert be.put_from([name(i)], [blob(i)]) == [True]  # no exception, nothing refused
        assert object_bytes(tmp_path / "pool") <= capacity
    assert be.evictions > 0
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and str(lock) in errors[0]  # named once, not on every eviction
    assert disk_use(tmp_path / "pool") <= capacity
    assert (tmp_path / "elsewhere").read_bytes() == b"not the pool's"
    assert not os.path.exists(tmp_path / "nowhere")


# ---------------------------------------------------------------- capacity counts shard folders
@pytest.mark.parametrize("size", [4096, 1500])
def test_capacity_bounds_disk_use_shard_folders_included(tmp_path, size):
    """Small objects spread over many shards: each brings up to two folders of its own. What the
    pool takes on disk (objects by their blocks, every folder) stays within the capacity."""
    pool = tmp_path / "pool"
    capacity = 256 << 10
    be = FileBackend(str(pool), capacity_bytes=capacity)
    for i in range(0, 400, 4):
        assert be.put_from([name(j) for j in range(i, i + 4)], [blob(j, size) for j in range(i, i + 4)]) == [True] * 4
        assert disk_use(pool) <= capacity
    assert be.evictions > 0
    assert sum(be.exists([name(i) for i in range(396, 400)])) == 4  # the newest stay
    again = FileBackend(str(pool), capacity_bytes=capacity)  # a fresh scan agrees
    assert disk_use(pool) <= again.stats()["nbytes_estimate"] <= capacity
