"""Directory backend (``file:///abs/dir?capacity=100GiB``): the embedded pool that persists.

Layout: one file per object, ``<dir>/<aa>/<bb>/<name>`` (two levels of 256 shards by a hash of
the name, so no directory grows past a few thousand entries). Safe with several processes (and
engines) of one user on one directory:

* a write goes to a temp file ``.<name>.<pid>.<thread>.tmp`` in the shard, created with
  ``O_EXCL|O_NOFOLLOW`` (a name that exists, e.g. a planted symlink, is never opened: another
  name is drawn), then ``os.replace`` — readers see a whole object or none, never a partial one;
* a read opens the file (``O_NOFOLLOW``: a symlink is a miss, never followed) and reads it whole;
  an eviction that unlinks it meanwhile does not affect the open file (POSIX), so a reader never
  sees a torn object;
* LRU order is by mtime: objects a process read are touched in batches on its write path, before
  an eviction scan and on close (never on the read path: a syscall per hit costs throughput);
* the size bound is kept by every process: each tracks the bytes it wrote since its last scan of
  the directory; when the estimate passes ``capacity``, it scans (under an ``flock`` on
  ``<dir>/.evict.lock``, so one process evicts at a time) and removes the least recently used
  files (by mtime; a hit touches its file) down to 90% of the capacity. Stray temp files older than
  ten minutes (a writer that died) go in the same scan;
* a full disk (ENOSPC, EDQUOT) runs the same scan down to 80% of what the pool holds, then the
  write is tried once more; only if that fails too is the object refused (a miss, not a dead pool).

Privacy: any object's layer-0 V reveals its prompt tokens, whatever the ``cache_salt``. The pool
is one user's: the root is created 0700 (an existing one of ours with group/other bits is
tightened, with a warning), shard folders 0700, objects and temp files 0600; a root owned by
another user (or a symlink to one, or a symlink owned by another user) is refused.

Mounted distributed file systems (3FS, NFS, Lustre) work the same way through their mount point.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import shutil
import stat
import threading
import time
from typing import Sequence
from urllib.parse import unquote, urlparse

import xxhash

from kvtier.storage.base import MISSING, TOO_LARGE, Backend, StorageError, redact_url
from kvtier.storage.memory import parse_size, query_params

log = logging.getLogger(__name__)
_STALE_TMP_S = 600.0
_TOUCH_AFTER_S = 60.0
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_EVICT_TO = 0.8  # a full disk: evict down to this fraction of what the pool holds
_FULL_EVICT_EVERY_S = 1.0  # ... at most once a second per process (threads failing together)
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class FileBackend(Backend):
    scheme = "file"

    def __init__(self, root: str, capacity_bytes: int | None = None) -> None:
        if not os.path.isabs(root):
            raise ValueError(f"file:// storage needs an absolute directory, got {root!r}")
        _make_private_root(root)
        if not os.access(root, os.W_OK | os.X_OK):
            raise ValueError(f"storage directory {root!r} is not writable")
        self.root = root
        self._prefix = root.rstrip("/") + "/"
        if capacity_bytes is None:  # default: half of the free space, at most 100 GiB
            capacity_bytes = max(1 << 20, min(100 << 30, shutil.disk_usage(root).free // 2))
        self.capacity = capacity_bytes
        self._lock = threading.Lock()
        self._written_since_scan = 0
        self._estimate = self._scan_size()
        self.evictions = 0
        self.round_trips = 0
        self.full_disk_evictions = 0  # scans run because a write hit ENOSPC/EDQUOT
        self.full_disk_refused = 0  # writes refused because the disk stayed full
        self._last_full_evict = -float("inf")
        self._touch: list[str] = []  # objects read since the last mtime refresh

    @classmethod
    def from_url(cls, url: str) -> "FileBackend":
        p = urlparse(url)
        if p.netloc not in ("", "localhost"):
            raise ValueError(f"file:// URL must be file:///absolute/dir (no host), got {redact_url(url)!r}")
        q = query_params(url, ("capacity",))
        path = unquote(p.path)
        if not path or path == "/":
            raise ValueError(f"file:// URL needs a directory, got {redact_url(url)!r}")
        return cls(path, parse_size(q["capacity"]) if "capacity" in q else None)

    # ------------------------------------------------------------------ paths
    def _path(self, name: str) -> str:
        if "/" in name or name.startswith(".") or not name:
            raise ValueError(f"bad object name {name!r}")
        h = xxhash.xxh64_hexdigest(name.encode())
        return f"{self._prefix}{h[:2]}/{h[2:4]}/{name}"  # (os.path.join: 2 us of the GIL)

    # ------------------------------------------------------------------ Backend
    def exists(self, names: Sequence[str]) -> list[bool]:
        self.round_trips += 1
        return [_is_object(self._path(n)) for n in names]

    def get_into(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[int]:
        return self.get_into_parts(names, [[b] for b in bufs])

    def put_from(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[bool]:
        return self.put_from_parts(names, [[b] for b in bufs])

    supports_parts = True  # readv/writev: objects go straight between files and host blocks

    def get_into_parts(self, names: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[int]:
        # Per object: open, one readv, close, and as little Python as possible between them: the
        # storage client's threads take turns on the GIL at every syscall, and on a 16-core host
        # each microsecond held here costs its share of all 16 threads' reads
        # (`git show f8a28f2:scripts/storage_probe.py`: 33 GB/s of bare readv calls vs 18 through
        # this method when it spent ~4 us more per object).
        self.round_trips += 1
        out = []
        for name, bufs in zip(names, parts):
            path = self._path(name)
            want = 0
            for b in bufs:
                want += b.nbytes if type(b) is memoryview else memoryview(b).nbytes
            try:
                fd = os.open(path, _READ)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.ELOOP):  # ELOOP: a symlink, not our object
                    out.append(MISSING)
                    continue
                raise StorageError(f"file storage {self.root}: cannot open {name}: {e}") from e
            try:
                # one readv with a 1-byte sentinel after the parts: a larger object fills it
                # (TOO_LARGE) without an fstat. A read cut short exactly at the parts' end
                # (possible on network file systems, not on local ones) leaves the rest of a
                # larger object unseen: its first ``want`` bytes are taken, and the blob check
                # still verifies every one of them (header, sizes, checksum).
                got = os.readv(fd, [*bufs, bytearray(1)])
                if 0 < got < want:  # a short read (rare on a local file system)
                    got += _readv_all(fd, _views_after([memoryview(b).cast("B") for b in bufs], got) + [memoryview(bytearray(1))])
            except OSError as e:
                raise StorageError(f"file storage {self.root}: cannot read {name}: {e}") from e
            finally:
                os.close(fd)
            out.append(TOO_LARGE if got > want else got)
            if len(self._touch) < 65536:
                self._touch.append(path)  # LRU: touched later, off the read path
        return out

    def put_from_parts(self, names: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        self.round_trips += 1
        out, written = [], 0
        if len(self._touch) >= 256:
            self._touch_hits()
        evicted_for_space = False
        for name, bufs in zip(names, parts):
            path = self._path(name)
            nbytes = sum(len(b) for b in bufs)
            if nbytes > self.capacity:
                out.append(False)
                continue
            if _is_object(path):  # immutable, content-addressed: already there
                out.append(True)
                continue
            try:
                try:
                    self._write(path, name, bufs)
                except OSError as e:
                    # a full disk: make room once per call (not once per object: a disk full of
                    # other data must not empty the pool object by object), then try again
                    if e.errno not in _FULL_ERRNOS or evicted_for_space:
                        raise
                    evicted_for_space = True
                    self._evict_for_space()
                    self._write(path, name, bufs)
            except OSError as e:
                if e.errno in _FULL_ERRNOS:
                    with self._lock:
                        self.full_disk_refused += 1
                    out.append(False)  # disk still full: refused, not a dead pool
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

    def _write(self, path: str, name: str, bufs: Sequence[memoryview]) -> None:
        """Write one object through a fresh temp file (0600, never an existing name), then rename
        it over ``path``. Raises OSError; leaves no temp file behind."""
        shard = os.path.dirname(path)
        fd, tmp = self._create_temp(shard, name)
        try:
            try:
                _writev_all(fd, [memoryview(b).cast("B") for b in bufs])
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _create_temp(self, shard: str, name: str) -> tuple[int, str]:
        """(fd, path) of a new temp file in ``shard``. The usual name is
        ``.<name>.<pid>.<thread>.tmp``; if something is there already (a planted file or
        symlink, or a dead writer's leftover the scan will remove), a random one is drawn: an
        existing name is never opened."""
        base = f".{name}.{os.getpid()}.{threading.get_ident()}"
        for attempt in range(4):
            tmp = os.path.join(shard, f"{base}.tmp" if attempt == 0 else f"{base}.{secrets.token_hex(8)}.tmp")
            try:
                return os.open(tmp, _CREATE, 0o600), tmp
            except FileExistsError:
                continue
            except FileNotFoundError:  # first object of this shard
                _make_private_dirs(self.root, shard)
                return os.open(tmp, _CREATE, 0o600), tmp
        raise OSError(errno.EEXIST, f"no free temp file name for {name} in {shard}")

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
    def _files(self):
        for d1 in os.scandir(self.root):
            if not d1.is_dir(follow_symlinks=False) or len(d1.name) != 2:
                continue
            for d2 in os.scandir(d1.path):
                if not d2.is_dir(follow_symlinks=False):
                    continue
                for f in os.scandir(d2.path):
                    try:
                        st = f.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    yield f.path, f.name, st

    def _scan_size(self) -> int:
        return sum(st.st_size for _, name, st in self._files() if not name.startswith("."))

    def _evict(self, keep_fraction: float | None = None) -> None:
        """Remove least recently used objects down to 90% of the capacity, or (``keep_fraction``,
        a full disk) down to that fraction of what the pool holds; one process at a time."""
        self._touch_hits()
        lock_fd = os.open(os.path.join(self.root, ".evict.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
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
            target = int(self.capacity * 0.9) if total > self.capacity else total
            if keep_fraction is not None:
                target = min(target, int(total * keep_fraction))
            if total > target:
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
            os.close(lock_fd)  # releases the flock

    def _evict_for_space(self) -> None:
        """A write hit a full disk: free a fifth of the pool, unless this process did so within
        the last second (threads that hit ENOSPC together free space once, then all retry)."""
        with self._lock:
            now = time.monotonic()
            if now - self._last_full_evict < _FULL_EVICT_EVERY_S:
                return
            self._last_full_evict = now
            self.full_disk_evictions += 1
        log.warning("file storage %s: disk full; evicting down to %d%% of the pool", self.root, int(_FULL_EVICT_TO * 100))
        self._evict(_FULL_EVICT_TO)

    def close(self) -> None:
        self._touch_hits()

    def stats(self) -> dict:
        return {
            "nbytes_estimate": self._estimate,
            "capacity": self.capacity,
            "evictions": self.evictions,
            "round_trips": self.round_trips,
            "full_disk_evictions": self.full_disk_evictions,
            "full_disk_refused": self.full_disk_refused,
        }

    def describe(self) -> str:
        return f"file://{self.root}?capacity={self.capacity}"


def _make_private_root(root: str) -> None:
    """Create ``root`` 0700, or check an existing one: a directory of this user (a symlink only if
    ours too), group/other bits removed. ValueError naming the path and the uids otherwise."""
    uid = os.geteuid()
    try:
        os.makedirs(os.path.dirname(root), exist_ok=True)
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ValueError(f"cannot create storage directory {root!r}: {e}") from None
    link = os.lstat(root)
    if stat.S_ISLNK(link.st_mode) and link.st_uid != uid:
        raise ValueError(
            f"storage directory {root!r} is a symlink owned by uid {link.st_uid}, "
            f"not by this process's uid {uid}: refusing to follow it"
        )
    st = os.stat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"storage directory {root!r} is not a directory")
    if st.st_uid != uid:
        raise ValueError(
            f"storage directory {root!r} is owned by uid {st.st_uid}, not by this "
            f"process's uid {uid}: a pool must be private (its objects reveal prompts)"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        log.warning(
            "storage directory %s had mode %o: tightened to 700 (its objects reveal prompts)", root, stat.S_IMODE(st.st_mode)
        )
        os.chmod(root, 0o700)


def _make_private_dirs(root: str, shard: str) -> None:
    """Create the shard folders between ``root`` and ``shard``, each 0700."""
    path = root
    for part in os.path.relpath(shard, root).split(os.sep):
        path = os.path.join(path, part)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass


def _is_object(path: str) -> bool:
    """A regular file is at ``path`` (a symlink, whatever it points to, is not an object)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _views_after(views: list[memoryview], n: int) -> list[memoryview]:
    """What is left of byte views ``views`` once ``n`` bytes were filled or sent."""
    while views and n >= len(views[0]):
        n -= len(views[0])
        views = views[1:]
    if views and n:
        views = [views[0][n:], *views[1:]]
    return views


def _readv_all(fd: int, views: list[memoryview]) -> int:
    """readv until the byte views are full or the file ends; bytes read."""
    total = 0
    while views:
        n = os.readv(fd, views)
        if n == 0:
            break
        total += n
        views = _views_after(views, n)
    return total


def _writev_all(fd: int, views: list[memoryview]) -> None:
    while views:
        views = _views_after(views, os.writev(fd, views))
