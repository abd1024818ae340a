"""The user's cache of weight-file digests, so that a restart does not re-hash a 100 GB checkpoint.

One small JSON file, ``weights_digests.json``, in ``$KVTIER_CACHE_DIR`` if set, else
``$XDG_CACHE_HOME/kvtier`` or ``~/.cache/kvtier``::

    {"version": 1, "files": {"/real/path/model-00001.safetensors":
        {"size": …, "mtime_ns": …, "ctime_ns": …, "ino": …, "dev": …, "xxh3_128": "…", "at": …}}}

An entry answers only while every field of the file's stat still matches (a rewrite, a copy over
it, a ``touch``, a new file under the old name: all re-hash). ctime is in the stamp because, unlike
mtime, no tool can set it back (``rsync -t`` or ``cp -p`` onto a same-sized file would otherwise
reuse a stale digest, and the fine-tune would read the base model's KV).

The cache decides which KV a model may read, so it is private: the folder is created 0700, the
file written 0600 (atomically: a temp file, then ``os.replace``), and a file that is not ours or
that others may write is ignored, as is a corrupt or unreadable one. Failing to write it only
costs a re-hash next time.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "KVTIER_CACHE_DIR"
FILE_NAME = "weights_digests.json"
VERSION = 1
MAX_ENTRIES = 4096  # least recently used entries go beyond this
_STAMP_FIELDS = ("size", "mtime_ns", "ctime_ns", "ino", "dev")


def cache_dir() -> Path:
    """Where kvtier keeps per-user state: ``$KVTIER_CACHE_DIR``, else the XDG cache folder."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"  # XDG: relative = unset
    return base / "kvtier"


def file_stamp(file: Path) -> tuple[str, dict[str, int]]:
    """(real path, the stat fields an entry must match)."""
    real = os.path.realpath(file)
    st = os.stat(real)
    return real, {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino, "dev": st.st_dev}


class DigestCache:
    def __init__(self, path: Path, files: dict[str, dict]) -> None:
        self.path = path
        self.files = files
        self._new: dict[str, dict] = {}

    @classmethod
    @contextmanager
    def open(cls) -> Iterator["DigestCache"]:
        """The cache as stored now; new entries are saved on exit."""
        path = cache_dir() / FILE_NAME
        cache = cls(path, _read(path))
        yield cache
        if cache._new:
            cache._save()

    def get(self, file: Path) -> str | None:
        """The cached digest of ``file``, or None if it is not cached or changed since."""
        real, stamp = file_stamp(file)
        entry = self._new.get(real) or self.files.get(real)
        if entry is None or any(entry.get(k) != v for k, v in stamp.items()):
            return None
        digest = entry.get("xxh3_128")
        return digest if isinstance(digest, str) and len(digest) == 32 else None

    def put(self, file: Path, digest: str, stamp: tuple[str, dict[str, int]]) -> str:
        """Remember ``digest`` for ``file`` if it still has the ``stamp`` taken before hashing
        (a file written meanwhile is not cached: its digest may mix two versions). Returns it."""
        if file_stamp(file) == stamp:
            real, fields = stamp
            self._new[real] = {**fields, "xxh3_128": digest, "at": time.time()}
        return digest

    def _save(self) -> None:
        try:
            folder = self.path.parent
            folder.parent.mkdir(parents=True, exist_ok=True)
            folder.mkdir(mode=0o700, exist_ok=True)
            files = {**_read(self.path), **self._new}  # merge what another process wrote
            if len(files) > MAX_ENTRIES:
                keep = sorted(files, key=lambda k: files[k].get("at", 0))[-MAX_ENTRIES:]
                files = {k: files[k] for k in keep}
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{FILE_NAME}.", suffix=".tmp")  # 0600, O_EXCL
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"version": VERSION, "files": files}, f)
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            log.debug("weights digest cache %s not written: %s", self.path, e)


def _read(path: Path) -> dict[str, dict]:
    """The entries of the cache file; {} if it is missing, corrupt, not ours or writable by others."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return {}
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022 or not stat.S_ISREG(st.st_mode):
            log.warning("ignoring weights digest cache %s: not owned by us or writable by others", path)
            return {}
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = json.loads(f.read())
        files = data["files"] if data.get("version") == VERSION else {}
        return {
            k: v
            for k, v in files.items()
            if isinstance(k, str) and isinstance(v, dict) and all(isinstance(v.get(f), int) for f in _STAMP_FIELDS)
        }
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return {}
    finally:
        os.close(fd)
