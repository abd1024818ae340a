"""Directory backend (``file:///abs/dir?capacity=100GiB``): the embedded pool that persists.

Over 600 lines: one backend that shares its directory with other processes and trusts nothing
found in it (every shard folder checked before use, the eviction scan and its lock, the retry on
a full disk, vectored reads and writes); these rules read each other's state, so they stay in
one class.

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
  files (by mtime; a hit touches its file) down to 90% of the capacity, and the shard folders
  that leaves empty. Stray temp files older than ten minutes (a writer that died) go in the same
  scan;
* the capacity bounds what the pool takes on disk: an object counts for its allocated blocks (at
  least its size; a write counts it rounded up to 4 KiB until the next scan), each shard folder
  and the directory itself for their blocks, at least 4 KiB each (tmpfs reports none). A pool of
  small objects spread over many shards holds fewer objects than ``capacity / object size``;
* a full disk (ENOSPC, EDQUOT) runs the same scan down to 80% of the bytes of the pool's objects,
  then the write is tried once more; only if that fails too is the object refused (a miss, not a
  dead pool).

Privacy: any object's layer-0 V reveals its prompt tokens, whatever the ``cache_salt``. The pool
is one user's: the root is created 0700 (an existing one of ours with group/other bits is
tightened, with a warning), shard folders 0700, objects and temp files 0600; a root owned by
another user (or a symlink to one, or a symlink owned by another user) is refused.

Nothing found under the root is trusted:

* each shard folder on an object's path is opened with ``O_DIRECTORY|O_NOFOLLOW`` and checked
  (a real folder, not a symlink, owned by this process's uid) before the pool reads, writes or
  deletes anything in it. A folder that fails is never used: its objects are misses, writes to
  it are refused (``put`` returns False), the eviction scan neither enters nor counts it; a
  warning names it once. A folder of ours with group/other bits is tightened to 0700 (a warning
  says so); in a second-level one, entries another user planted while it was open are removed;
* an ``.evict.lock`` that is a symlink, not a regular file or not ours is never opened or
  followed: an error names it once, and this process evicts without the cross-process lock
  (``unlocked_evictions`` in ``stats()``). The bound still holds; two processes evicting at once
  may remove more than needed. Remove the file to restore the lock.

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

from kvtier.redact import redact_url
from kvtier.storage.base import MISSING, TOO_LARGE, Backend, StorageError
from kvtier.storage.memory import parse_size, query_params

log = logging.getLogger(__name__)
_STALE_TMP_S = 600.0
_TOUCH_AFTER_S = 60.0
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_EVICT_TO = 0.8  # a full disk: evict down to this fraction of the bytes of the pool's objects
_FULL_EVICT_EVERY_S = 1.0  # ... at most once a second per process (threads failing together)
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted where a folder or the lock belongs fails or opens at once, never blocks
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_LOCK = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_BLOCK = 4096  # the least a folder counts for, and what a new object is rounded up to until a scan
_OK, _ABSENT, _REFUSED = "ok", "absent", "refused"  # what checking a shard folder found


class _Refused(Exception):
    """A write's shard folder cannot be trusted: the object is not stored."""


class _Scan:
    """What a walk of the pool's own folders found: ``folders`` maps a shard folder (``aa`` or
    ``aa/bb``) to [bytes it takes, entries in it]; ``files`` are (path, name, lstat, folder) of the
    entries of the second-level folders; ``folder_bytes`` counts the root and every folder."""

    def __init__(self, root_bytes: int) -> None:
        self.folder_bytes = root_bytes
        self.folders: dict[str, list[int]] = {}
        self.files: list[tuple[str, str, os.stat_result, str]] = []


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
        self._uid = os.geteuid()
        self._lock = threading.Lock()
        self._evict_mutex = threading.Lock()  # one eviction at a time in this process
        # Shard folders (``aa`` and ``aabb``) that passed the check: not checked again, so the
        # read path pays a set lookup, not an lstat per object. Safe against other users: a
        # folder that passed is a real folder (not a symlink), ours and 0700, in the root or a
        # first-level folder that passed too, and the root is ours and 0700: no other user can
        # rename, replace or add anything there. Left to processes of this same uid: they could
        # swap a checked folder for a symlink and this process would follow it until its next
        # eviction scan (which checks every folder again) or a restart; such a process can read
        # the objects anyway. Folders that failed are checked again each time they are met (one
        # put right is used again), and named in the log once.
        self._trusted: set[str] = set()
        self._distrusted: set[str] = set()  # folders refused, each named once in the log
        self._lock_refused = False  # the lock file was refused, named once in the log
        self._written_since_scan = 0
        self.evictions = 0
        self.round_trips = 0
        self.full_disk_evictions = 0  # scans run because a write hit ENOSPC/EDQUOT
        self.full_disk_refused = 0  # writes refused because the disk stayed full
        self.untrusted_refused = 0  # writes refused because their shard folder is not the pool's
        self.unlocked_evictions = 0  # scans run without the cross-process lock (its file refused)
        self._last_full_evict = -float("inf")
        self._touch: list[str] = []  # objects read since the last mtime refresh
        self._estimate = self.scan_nbytes()

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
    def _locate(self, name: str) -> tuple[str, str]:
        """(shard ``aabb``, path) of object ``name``."""
        if "/" in name or name.startswith(".") or not name:
            raise ValueError(f"bad object name {name!r}")
        h = xxhash.xxh64_hexdigest(name.encode())
        return h[:4], f"{self._prefix}{h[:2]}/{h[2:4]}/{name}"  # (os.path.join: 2 us of the GIL)

    def path_of(self, name: str) -> str:
        """The file that holds (or would hold) object ``name``."""
        return self._locate(name)[1]

    # ------------------------------------------------------------------ trust
    def _trust(self, shard: str) -> bool:
        """Whether both folders of ``shard`` (``aabb``) exist and passed the check."""
        for rel in (shard[:2], f"{shard[:2]}/{shard[2:]}"):
            if rel.replace("/", "") not in self._trusted and self._check_dir(rel) != _OK:
                return False
        return True

    def _check_dir(self, rel: str) -> str:
        state, fd, _ = self._open_dir(rel)
        if fd >= 0:
            os.close(fd)
        return state

    def _open_dir(self, rel: str, dir_fd: int | None = None) -> tuple[str, int, int]:
        """Open and check shard folder ``rel`` (``aa`` or ``aa/bb``; with ``dir_fd``, its last
        part is opened in that folder): (_OK, an fd to close, the bytes it takes) for a folder of
        ours, now 0700 and marked trusted; (_ABSENT, -1, 0) if nothing is there; (_REFUSED, -1, 0)
        if what is there is not the pool's (named once in the log)."""
        path, key = self._prefix + rel, rel.replace("/", "")
        self._trusted.discard(key)  # (trusted again below if it passes)
        try:
            fd = os.open(rel.rpartition("/")[2] if dir_fd is not None else path, _DIR, dir_fd=dir_fd)
        except FileNotFoundError:
            return _ABSENT, -1, 0
        except OSError as e:
            self._distrust(path, _what_is(path, e))
            return _REFUSED, -1, 0
        try:
            st = os.fstat(fd)
            if st.st_uid != self._uid:
                self._distrust(path, f"owned by uid {st.st_uid}, not by this process's uid {self._uid}")
                os.close(fd)
                return _REFUSED, -1, 0
            if stat.S_IMODE(st.st_mode) & 0o077:
                self._tighten(fd, path, stat.S_IMODE(st.st_mode), second_level="/" in rel)
        except OSError as e:
            self._distrust(path, f"not usable ({e.strerror})")
            os.close(fd)
            return _REFUSED, -1, 0
        self._trusted.add(key)
        return _OK, fd, _dir_bytes(st)

    def _tighten(self, fd: int, path: str, mode: int, second_level: bool) -> None:
        """A shard folder of ours with group/other bits: 0700 it (through ``fd``, never by path),
        then, in a second-level one, remove what another user planted while it was open."""
        os.fchmod(fd, 0o700)
        log.warning("file storage %s: folder %s had mode %o: tightened to 700 (objects reveal prompts)", self.root, path, mode)
        if not second_level:
            return  # its entries are folders, each checked before use
        for e in os.scandir(fd):
            try:
                owner = e.stat(follow_symlinks=False).st_uid
                if owner != self._uid:
                    if e.is_dir(follow_symlinks=False):
                        os.rmdir(e.name, dir_fd=fd)
                    else:
                        os.unlink(e.name, dir_fd=fd)
                    log.warning("file storage %s: removed %s/%s, planted by uid %d", self.root, path, e.name, owner)
            except OSError:
                pass

    def _distrust(self, path: str, what: str) -> None:
        with self._lock:
            if path in self._distrusted:
                return
            self._distrusted.add(path)
        log.warning(
            "file storage %s: folder %s is %s: not used (its objects are misses, writes to it are refused)", self.root, path, what
        )

    def _make_shard(self, shard: str) -> int:
        """Create the folders of ``shard`` (0700) where missing, and check them: the bytes of the
        folders created. Raises _Refused if one cannot be trusted; a first-level folder is checked
        before anything is created in it."""
        created = 0
        for _ in range(4):  # an eviction in another process may remove an empty folder meanwhile
            for rel in (shard[:2], f"{shard[:2]}/{shard[2:]}"):
                if rel.replace("/", "") in self._trusted:
                    continue
                try:
                    os.mkdir(self._prefix + rel, 0o700)
                    created += _BLOCK
                except FileExistsError:
                    pass
                except FileNotFoundError:  # the first-level folder went
                    self._trusted.discard(shard[:2])
                    break
                state = self._check_dir(rel)
                if state == _REFUSED:
                    raise _Refused(rel)
                if state == _ABSENT:
                    break
            else:
                return created
        raise OSError(errno.ENOENT, f"shard folder {shard[:2]}/{shard[2:]} keeps disappearing")

    # ------------------------------------------------------------------ Backend
    def exists(self, names: Sequence[str]) -> list[bool]:
        self.round_trips += 1
        out = []
        for n in names:
            shard, path = self._locate(n)
            out.append((shard in self._trusted or self._trust(shard)) and _is_object(path))
        return out

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
        trusted = self._trusted
        out = []
        for name, bufs in zip(names, parts):
            shard, path = self._locate(name)
            if shard not in trusted and not self._trust(shard):
                out.append(MISSING)  # no folder, or not the pool's: never read through it
                continue
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
                if e.errno != errno.EISDIR:
                    raise StorageError(f"file storage {self.root}: cannot read {name}: {e}") from e
                out.append(MISSING)  # a folder where the object belongs: not an object
                continue
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
            shard, path = self._locate(name)
            nbytes = sum(len(b) for b in bufs)
            if nbytes > self.capacity:
                out.append(False)
                continue
            try:
                if shard not in self._trusted:
                    written += self._make_shard(shard)
                if _is_object(path):  # immutable, content-addressed: already there
                    out.append(True)
                    continue
                try:
                    written += self._write(path, name, bufs)
                except OSError as e:
                    # a full disk: make room once per call (not once per object: a disk full of
                    # other data must not empty the pool object by object), then try again
                    if e.errno not in _FULL_ERRNOS or evicted_for_space:
                        raise
                    evicted_for_space = True
                    self._evict_for_space()
                    written += self._write(path, name, bufs)
            except _Refused:
                with self._lock:
                    self.untrusted_refused += 1
                out.append(False)  # a folder that is not the pool's: not stored, not an error
                continue
            except OSError as e:
                if e.errno in _FULL_ERRNOS:
                    with self._lock:
                        self.full_disk_refused += 1
                    out.append(False)  # disk still full: refused, not a dead pool
                    continue
                raise StorageError(f"file storage {self.root}: cannot write {name}: {e}") from e
            written += -(-nbytes // _BLOCK) * _BLOCK
            out.append(True)
        if written:
            with self._lock:
                self._estimate += written
                over = self._estimate > self.capacity
            if over:
                self.evict()
        return out

    def _write(self, path: str, name: str, bufs: Sequence[memoryview]) -> int:
        """Write one object through a fresh temp file (0600, never an existing name), then rename
        it over ``path``: the bytes of the shard folders it had to create. Raises OSError (or
        _Refused); leaves no temp file behind."""
        shard = path[len(self._prefix) :][:5].replace("/", "")  # "aa/bb/<name>" -> "aabb"
        fd, tmp, created = self._create_temp(shard, os.path.dirname(path), name)
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
        return created

    def _create_temp(self, shard: str, folder: str, name: str) -> tuple[int, str, int]:
        """(fd, path, bytes of folders created) of a new temp file in ``folder``. The usual name
        is ``.<name>.<pid>.<thread>.tmp``; if something is there already (a planted file or
        symlink, or a dead writer's leftover the scan will remove), a random one is drawn: an
        existing name is never opened. A folder an eviction removed meanwhile is made again."""
        base = f".{name}.{os.getpid()}.{threading.get_ident()}"
        created = 0
        for attempt in range(6):
            tmp = os.path.join(folder, f"{base}.tmp" if attempt == 0 else f"{base}.{secrets.token_hex(8)}.tmp")
            try:
                return os.open(tmp, _CREATE, 0o600), tmp, created
            except FileExistsError:
                continue
            except FileNotFoundError:  # removed (it was empty) by an eviction since it was checked
                self._trusted.discard(shard)
                self._trusted.discard(shard[:2])
                created += self._make_shard(shard)
        raise OSError(errno.EEXIST, f"no free temp file name for {name} in {folder}")

    def delete(self, names: Sequence[str]) -> None:
        for n in names:
            shard, path = self._locate(n)
            if shard not in self._trusted and not self._trust(shard):
                continue  # never removes anything through a folder that is not the pool's
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def _touch_hits(self) -> None:
        paths, self._touch = self._touch, []
        now = time.time()
        for path in set(paths):
            try:
                if now - os.stat(path, follow_symlinks=False).st_mtime > _TOUCH_AFTER_S:
                    os.utime(path, follow_symlinks=False)
            except OSError:
                pass

    # ------------------------------------------------------------------ size bound
    def _scan(self) -> _Scan:
        """Walk the root's shard folders, each opened and checked (a folder that fails is neither
        entered nor counted) and listed through its descriptor."""
        scan = _Scan(_dir_bytes(os.stat(self.root)))
        with os.scandir(self.root) as top:
            first = [e.name for e in top if len(e.name) == 2]
        for d1 in first:
            state, fd1, nbytes = self._open_dir(d1)
            if state != _OK:
                continue
            try:
                scan.folder_bytes += nbytes
                entries = [e.name for e in os.scandir(fd1)]
                scan.folders[d1] = [nbytes, len(entries)]
                for d2 in entries:
                    rel = f"{d1}/{d2}"
                    state, fd2, nbytes = self._open_dir(rel, dir_fd=fd1) if len(d2) == 2 else (_REFUSED, -1, 0)
                    if state != _OK:
                        continue
                    try:
                        scan.folder_bytes += nbytes
                        n = 0
                        for f in os.scandir(fd2):
                            n += 1
                            try:
                                st = f.stat(follow_symlinks=False)
                            except FileNotFoundError:
                                continue
                            scan.files.append((f"{self._prefix}{rel}/{f.name}", f.name, st, rel))
                        scan.folders[rel] = [nbytes, n]
                    finally:
                        os.close(fd2)
            finally:
                os.close(fd1)
        return scan

    def scan_nbytes(self) -> int:
        """The bytes the pool takes on disk now, by a scan of its folders: what ``capacity``
        bounds (objects by their allocated blocks, folders at least 4 KiB each; temp files not)."""
        scan = self._scan()
        return scan.folder_bytes + sum(_file_bytes(st) for _, name, st, _ in scan.files if not name.startswith("."))

    def evict(self, keep_fraction: float | None = None) -> None:
        """Run an eviction scan now (a write that passes the capacity runs one): remove least
        recently used objects (and the folders they leave empty) down to 90% of the capacity, or
        (``keep_fraction``, a full disk) until the pool's objects are down to that fraction of
        their bytes; one process at a time. Stray temp files of dead writers go too."""
        self._touch_hits()
        with self._evict_mutex:
            lock_fd = self._open_evict_lock()
            try:
                if lock_fd >= 0:
                    fcntl.flock(lock_fd, fcntl.LOCK_EX)
                else:
                    self.unlocked_evictions += 1
                self._evict_scanned(keep_fraction)
            finally:
                if lock_fd >= 0:
                    os.close(lock_fd)  # releases the flock

    def _open_evict_lock(self) -> int:
        """An fd of ``<root>/.evict.lock`` (created 0600), or -1 if what is there is not the
        pool's: a symlink (never followed), not a regular file, or another user's. Then the
        eviction runs without the cross-process lock: the size bound must hold whatever lies in
        the root, and an unlocked eviction only risks two processes removing more than needed. A
        lock file of another name would not help: it can be planted the same way, and replacing
        the planted one races with the pool's other processes doing the same."""
        path = self._prefix + ".evict.lock"
        try:
            fd = os.open(path, _LOCK, 0o600)
        except OSError as e:
            self._refuse_lock(path, _what_is(path, e))
            return -1
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == self._uid:
            return fd
        os.close(fd)
        self._refuse_lock(path, "not a regular file" if not stat.S_ISREG(st.st_mode) else f"owned by uid {st.st_uid}")
        return -1

    def _refuse_lock(self, path: str, what: str) -> None:
        with self._lock:
            if self._lock_refused:
                return
            self._lock_refused = True
        log.error(
            "file storage %s: eviction lock %s is %s, not the pool's: this process evicts without it "
            "(the size bound holds; processes evicting at once may remove more than needed). Remove %s to restore it",
            self.root,
            path,
            what,
            path,
        )

    def _evict_scanned(self, keep_fraction: float | None) -> None:
        scan = self._scan()
        now = time.time()
        objects, objects_total = [], 0
        for path, name, st, rel in scan.files:
            if name.startswith("."):
                if name.endswith(".tmp") and now - st.st_mtime > _STALE_TMP_S:
                    try:
                        os.unlink(path)
                        scan.folders[rel][1] -= 1
                    except OSError:
                        pass
                continue
            if stat.S_ISDIR(st.st_mode):
                continue  # a folder where an object belongs: not the pool's, not counted
            objects.append((st.st_mtime, _file_bytes(st), path, rel))
            objects_total += _file_bytes(st)
        total = scan.folder_bytes + objects_total
        target = int(self.capacity * 0.9) if total > self.capacity else total
        objects_target = int(objects_total * keep_fraction) if keep_fraction is not None else objects_total
        if total > target or objects_total > objects_target:
            for rel in sorted((r for r, (_, n) in scan.folders.items() if n == 0), key=len, reverse=True):
                if rel in scan.folders:  # empty folders hold nothing: they go first
                    total -= self._remove_folder(rel, scan)
            objects.sort()
            for _mtime, size, path, rel in objects:
                if total <= target and objects_total <= objects_target:
                    break
                try:
                    os.unlink(path)
                    self.evictions += 1
                except FileNotFoundError:
                    pass  # another process evicted it
                except OSError:
                    continue
                total -= size
                objects_total -= size
                scan.folders[rel][1] -= 1
                if scan.folders[rel][1] == 0:
                    total -= self._remove_folder(rel, scan)
        with self._lock:
            self._estimate = total

    def _remove_folder(self, rel: str, scan: _Scan) -> int:
        """Remove empty shard folder ``rel``, and its first-level folder if that leaves it empty:
        the bytes freed (none if a write landed in it meanwhile)."""
        freed = 0
        while True:
            try:
                os.rmdir(self._prefix + rel)
            except OSError:
                return freed
            self._trusted.discard(rel.replace("/", ""))
            freed += scan.folders.pop(rel)[0]
            if "/" not in rel:
                return freed
            rel = rel[:2]
            scan.folders[rel][1] -= 1
            if scan.folders[rel][1] > 0:
                return freed

    def _evict_for_space(self) -> None:
        """A write hit a full disk: free a fifth of the pool's objects, unless this process did so
        within the last second (threads that hit ENOSPC together free space once, then all retry)."""
        with self._lock:
            now = time.monotonic()
            if now - self._last_full_evict < _FULL_EVICT_EVERY_S:
                return
            self._last_full_evict = now
            self.full_disk_evictions += 1
        log.warning("file storage %s: disk full; evicting down to %d%% of the pool", self.root, int(_FULL_EVICT_TO * 100))
        self.evict(_FULL_EVICT_TO)

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
            "untrusted_folders": len(self._distrusted),
            "untrusted_refused": self.untrusted_refused,
            "unlocked_evictions": self.unlocked_evictions,
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


def _dir_bytes(st: os.stat_result) -> int:
    """What a folder counts for: its blocks, at least one (tmpfs reports none)."""
    return max(st.st_blocks * 512, _BLOCK)


def _file_bytes(st: os.stat_result) -> int:
    """What a file counts for: its blocks, at least its size (a sparse or compressed file)."""
    return max(st.st_blocks * 512, st.st_size)


def _what_is(path: str, err: OSError) -> str:
    """Words for what lies at ``path``, which could not be opened as the pool's (``err``)."""
    try:
        st = os.lstat(path)
    except OSError:
        return f"not usable ({err.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "a symlink"
    if err.errno in (errno.ENOTDIR, errno.EISDIR):
        return "a folder" if stat.S_ISDIR(st.st_mode) else "not a folder"
    return f"not usable ({err.strerror})"


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
