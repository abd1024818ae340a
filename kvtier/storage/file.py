"""Directory backend (``file:///abs/dir?capacity=100GiB``): the embedded pool that persists.

Layout: one file per object, ``<dir>/<aa>/<bb>/<name>`` (two levels of 256 shards by a hash of
the name, so no directory grows past a few thousand entries). Safe with several processes (and
engines) on one directory:

* a write goes to ``.<name>.<pid>.<thread>.tmp`` in the shard, then ``os.replace`` — readers see a
  whole object or none, never a partial one;
* a read opens the file and reads it whole; an eviction that unlinks it meanwhile does not affect
  the open file (POSIX), so a reader never sees a torn object;
* LRU order is by mtime: objects a process read are touched in batches on its write path, before
  an eviction scan and on close (never on the read path: a syscall per hit costs throughput);
* the size bound is kept by every process: each tracks the bytes it wrote since its last scan of
  the directory; when the estimate passes ``capacity``, it scans (under an ``flock`` on
  ``<dir>/.evict.lock``, so one process evicts at a time) and removes the least recently used
  files (by mtime; a hit touches its file) down to 90% of the capacity. Stray temp files older than
  ten minutes (a writer that died) go in the same scan.

Mounted distributed file systems (3FS, NFS, Lustre) work the same way through their mount point.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import threading
import time
from typing import Sequence
from urllib.parse import unquote, urlparse

import xxhash

from kvtier.storage.base import MISSING, TOO_LARGE, Backend, StorageError
from kvtier.storage.memory import parse_size, query_params

log = logging.getLogger(__name__)
_STALE_TMP_S = 600.0
_TOUCH_AFTER_S = 60.0


class FileBackend(Backend):
    scheme = "file"

    def __init__(self, root: str, capacity_bytes: int | None = None) -> None:
        if not os.path.isabs(root):
            raise ValueError(f"file:// storage needs an absolute directory, got {root!r}")
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create storage directory {root!r}: {e}") from None
        if not os.access(root, os.W_OK | os.X_OK):
            raise ValueError(f"storage directory {root!r} is not writable")
        self.root = root
        if capacity_bytes is None:         # default: half of the free space, at most 100 GiB
            capacity_bytes = max(1 << 20, min(100 << 30, shutil.disk_usage(root).free // 2))
        self.capacity = capacity_bytes
        self._lock = threading.Lock()
        self._written_since_scan = 0
        self._estimate = self._scan_size()
        self.evictions = 0
        self.round_trips = 0
        self._touch: list[str] = []        # objects read since the last mtime refresh

    @classmethod
    def from_url(cls, url: str) -> "FileBackend":
        p = urlparse(url)
        if p.netloc not in ("", "localhost"):
            raise ValueError(f"file:// URL must be file:///absolute/dir (no host), got {url!r}")
        q = query_params(url, ("capacity",))
        path = unquote(p.path)
        if not path or path == "/":
            raise ValueError(f"file:// URL needs a directory, got {url!r}")
        return cls(path, parse_size(q["capacity"]) if "capacity" in q else None)

    # ------------------------------------------------------------------ paths
    def _path(self, name: str) -> str:
        if "/" in name or name.startswith(".") or not name:
            raise ValueError(f"bad object name {name!r}")
        h = xxhash.xxh64_hexdigest(name.encode())
        return os.path.join(self.root, h[:2], h[2:4], name)

    # ------------------------------------------------------------------ Backend
    def exists(self, names: Sequence[str]) -> list[bool]:
        self.round_trips += 1
        return [os.path.isfile(self._path(n)) for n in names]

    def get_into(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[int]:
        return self.get_into_parts(names, [[b] for b in bufs])

    def put_from(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[bool]:
        return self.put_from_parts(names, [[b] for b in bufs])

    supports_parts = True        # readv/writev: objects go straight between files and host blocks

    def get_into_parts(self, names: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[int]:
        self.round_trips += 1
        out = []
        for name, bufs in zip(names, parts):
            path = self._path(name)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                out.append(MISSING)
                continue
            except OSError as e:
                raise StorageError(f"file storage {self.root}: cannot open {name}: {e}") from e
            try:
                # one readv with a 1-byte sentinel after the parts: a larger object fills it
                # (TOO_LARGE) without an fstat; fewer syscalls = fewer GIL hand-offs per object
                views = [memoryview(b).cast("B") for b in bufs]
                got = _readv_all(fd, [*views, memoryview(bytearray(1))])
            except OSError as e:
                raise StorageError(f"file storage {self.root}: cannot read {name}: {e}") from e
            finally:
                os.close(fd)
            out.append(TOO_LARGE if got > sum(len(v) for v in views) else got)
            if len(self._touch) < 65536:
                self._touch.append(path)           # LRU: touched later, off the read path
        return out

    def put_from_parts(self, names: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        self.round_trips += 1
        out, written = [], 0
        if len(self._touch) >= 256:
            self._touch_hits()
        for name, bufs in zip(names, parts):
            path = self._path(name)
            nbytes = sum(len(b) for b in bufs)
            if nbytes > self.capacity:
                out.append(False)
                continue
            if os.path.exists(path):           # immutable, content-addressed: already there
                out.append(True)
                continue
            shard = os.path.dirname(path)
            tmp = os.path.join(shard, f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
            try:
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                except FileNotFoundError:          # first object of this shard
                    os.makedirs(shard, exist_ok=True)
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    _writev_all(fd, [memoryview(b).cast("B") for b in bufs])
                finally:
                    os.close(fd)
                os.replace(tmp, path)
            except OSError as e:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    out.append(False)          # disk full: refused, not a dead pool
                    continue
                raise StorageError(f"file storage {self.root}: cannot write {name}: {e}") from e
            written += nbytes
            out.append(True)
        if written:
            with self._lock:
                self._estimate += written
                over = self._estimate > self.capacity
            if over:
                self._evict()
        return out

    def delete(self, names: Sequence[str]) -> None:
        for n in names:
            try:
                os.unlink(self._path(n))
            except FileNotFoundError:
                pass

    def _touch_hits(self) -> None:
        paths, self._touch = self._touch, []
        now = time.time()
        for path in set(paths):
            try:
                if now - os.stat(path).st_mtime > _TOUCH_AFTER_S:
                    os.utime(path)
            except OSError:
                pass

    # ------------------------------------------------------------------ size bound
    def _files(self):  # type: ignore[no-untyped-def]
        for d1 in os.scandir(self.root):
            if not d1.is_dir() or len(d1.name) != 2:
                continue
            for d2 in os.scandir(d1.path):
                if not d2.is_dir():
                    continue
                for f in os.scandir(d2.path):
                    try:
                        st = f.stat()
                    except FileNotFoundError:
                        continue
                    yield f.path, f.name, st

    def _scan_size(self) -> int:
        return sum(st.st_size for _, name, st in self._files() if not name.startswith("."))

    def _evict(self) -> None:
        """Remove least recently used objects down to 90% of the capacity (one process at a time)."""
        self._touch_hits()
        lock_path = os.path.join(self.root, ".evict.lock")
        with open(lock_path, "a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                now = time.time()
                objects, total = [], 0
                for path, name, st in self._files():
                    if name.startswith("."):
                        if name.endswith(".tmp") and now - st.st_mtime > _STALE_TMP_S:
                            try:
                                os.unlink(path)
                            except OSError:
                                pass
                        continue
                    objects.append((st.st_mtime, st.st_size, path))
                    total += st.st_size
                target = int(self.capacity * 0.9)
                if total > self.capacity:
                    objects.sort()
                    for _mtime, size, path in objects:
                        if total <= target:
                            break
                        try:
                            os.unlink(path)
                            self.evictions += 1
                        except FileNotFoundError:
                            pass
                        total -= size
                with self._lock:
                    self._estimate = total
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)

    def close(self) -> None:
        self._touch_hits()

    def stats(self) -> dict:
        return {"nbytes_estimate": self._estimate, "capacity": self.capacity, "evictions": self.evictions,
                "round_trips": self.round_trips}

    def describe(self) -> str:
        return f"file://{self.root}?capacity={self.capacity}"


def _first_bytes(bufs: Sequence[memoryview], size: int) -> list[memoryview]:
    """The leading ``size`` bytes of the concatenation of ``bufs``, as views."""
    out = []
    for b in bufs:
        if size <= 0:
            break
        b = memoryview(b).cast("B")
        out.append(b[:size])
        size -= len(out[-1])
    return out


def _readv_all(fd: int, views: list[memoryview]) -> int:
    """readv until the views are full or the file ends; bytes read."""
    total = 0
    while views:
        n = os.readv(fd, views)
        if n == 0:
            break
        total += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        if views and n:
            views = [views[0][n:], *views[1:]]
    return total


def _writev_all(fd: int, views: list[memoryview]) -> None:
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        if views and n:
            views = [views[0][n:], *views[1:]]
