"""Storage tier: a pool of immutable, content-addressed block objects.

A backend stores bytes under object names (``kvt:<ns>:<hex>``, DESIGN §3) and answers
``exists``; :class:`StorageClient` adapts it to what the cache manager asks (``lookup_prefix``,
``contains``, ``add`` by block key) and to what the transfer executor does (``put``/``get`` of one
host block's bytes). Any failure of a backend is reported as a failed item, never raised into the
engine: the manager turns it into a miss (DESIGN §5.6).

URLs: ``memory://?capacity=1GiB`` (in process). ``file://``, ``redis://``, ``mooncake://`` are
not in this build yet: asking for them is an error that says so.
"""
from __future__ import annotations

import logging
from typing import Sequence
from urllib.parse import parse_qs, urlparse

from kvtier.cache.keys import object_name
from kvtier.storage.memory import MemoryBackend, parse_size

log = logging.getLogger(__name__)

__all__ = ["MemoryBackend", "StorageClient", "open_storage", "parse_size"]


class StorageClient:
    def __init__(self, backend: MemoryBackend, namespace: str = "default") -> None:
        self.backend = backend
        self.namespace = namespace
        self.failures = 0

    def name(self, key: bytes) -> str:
        return object_name(key, self.namespace)

    # ---- StorageIndex (what the manager asks)
    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        try:
            present = self.backend.exists([self.name(k) for k in keys])
        except Exception as e:  # a dead pool is a miss
            self.failures += 1
            log.warning("storage lookup failed (%s); treating as miss", e)
            return 0
        n = 0
        for p in present:
            if not p:
                break
            n += 1
        return n

    def contains(self, key: bytes) -> bool:
        return self.lookup_prefix([key]) == 1

    def add(self, key: bytes) -> None:
        """The manager learns of an acknowledged put; the backend already has it."""

    # ---- data path (what the executor does)
    def put(self, key: bytes, data: bytes) -> bool:
        try:
            return self.backend.put(self.name(key), data)
        except Exception as e:
            self.failures += 1
            log.warning("storage put failed (%s)", e)
            return False

    def get(self, key: bytes) -> bytes | None:
        try:
            return self.backend.get(self.name(key))
        except Exception as e:
            self.failures += 1
            log.warning("storage get failed (%s)", e)
            return None


def open_storage(url: str | None, namespace: str = "default") -> StorageClient | None:
    if url is None:
        return None
    parsed = urlparse(url)
    if parsed.scheme == "memory":
        q = parse_qs(parsed.query)
        capacity = parse_size(q["capacity"][0]) if "capacity" in q else 1 << 30
        return StorageClient(MemoryBackend(capacity), namespace)
    if parsed.scheme in ("file", "redis", "rediss", "redis+cluster", "mooncake"):
        raise ValueError(f"storage URL scheme {parsed.scheme!r} is not available in this build yet "
                         f"(only memory://); got {url!r}")
    raise ValueError(f"unknown storage URL {url!r}; expected memory://, file://, redis://, rediss://, "
                     f"redis+cluster:// or mooncake://")
