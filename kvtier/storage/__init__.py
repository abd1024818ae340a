"""Storage tier: a pool of immutable, content-addressed block objects shared by engines.

Backends (one small interface, :mod:`kvtier.storage.base`) are chosen by URL (DESIGN §6)::

    memory://?capacity=1GiB                     in process (tests, demos)
    file:///abs/dir?capacity=100GiB             a directory: the embedded pool that persists
    redis://[:password@]host:port/db            Redis / Valkey  (rediss:// for TLS)
    redis+cluster://host:port,host:port         Redis / Valkey cluster
    mooncake://master:port?protocol=tcp         Mooncake Store (&segment=4GiB to contribute memory)

Any URL also takes ``throttle=RATE`` (e.g. ``throttle=200MB``): every read and write is slowed to
that many bytes per second, to see how the engine behaves against a slow pool (benchmarks).

:class:`~kvtier.storage.client.StorageClient` runs the I/O on worker threads with self-checking
blobs (:mod:`kvtier.storage.blob`), retries and a circuit breaker; any failure is a miss. Its
``health()`` is the pool's state for ``/health``. A URL is shown (errors, logs, ``describe()``) only
through :func:`~kvtier.storage.base.redact_url`: passwords never reach a log.
"""

from __future__ import annotations

import importlib
from urllib.parse import parse_qsl, urlencode, urlparse, urlunparse

from kvtier.redact import redact_url
from kvtier.storage.base import MISSING, TOO_LARGE, Backend, StorageError
from kvtier.storage.blob import BlobLayout, namespace_digest
from kvtier.storage.client import StorageClient
from kvtier.storage.memory import MemoryBackend, parse_size
from kvtier.storage.throttle import ThrottledBackend

__all__ = [
    "MISSING",
    "TOO_LARGE",
    "Backend",
    "BlobLayout",
    "MemoryBackend",
    "StorageClient",
    "StorageError",
    "namespace_digest",
    "open_backend",
    "open_storage",
    "parse_size",
    "redact_url",
]

# scheme -> "module:class" (imported on use: redis/mooncake clients are optional extras)
BACKENDS = {
    "memory": "kvtier.storage.memory:MemoryBackend",
    "file": "kvtier.storage.file:FileBackend",
    "redis": "kvtier.storage.redis:RedisBackend",
    "rediss": "kvtier.storage.redis:RedisBackend",
    "redis+cluster": "kvtier.storage.redis:RedisBackend",
    "mooncake": "kvtier.storage.mooncake:MooncakeBackend",
}


def open_backend(url: str) -> Backend:
    """The backend a storage URL names (``throttle=`` honoured). Bad URLs raise ValueError (which,
    like every message and log line of this package that shows a URL, shows it redacted: a
    password never reaches a log)."""
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"storage must be a URL like file:///dir or redis://host:port, got {redact_url(url)!r}")
    parsed = urlparse(url)
    target = BACKENDS.get(parsed.scheme)
    if target is None:
        raise ValueError(
            f"unknown storage URL scheme {parsed.scheme!r} in {redact_url(url)!r}; expected one of "
            f"{', '.join(s + '://' for s in BACKENDS)}"
        )
    query = parse_qsl(parsed.query, keep_blank_values=True)
    throttle = [v for k, v in query if k == "throttle"]
    if throttle:
        url = urlunparse(parsed._replace(query=urlencode([(k, v) for k, v in query if k != "throttle"])))
    module, cls = target.split(":")
    backend = getattr(importlib.import_module(module), cls).from_url(url)
    if throttle:
        backend = ThrottledBackend(backend, parse_size(throttle[-1]))
    return backend


def open_storage(url: str | None, namespace: str = "default", **client_options) -> StorageClient | None:
    if url is None:
        return None
    return StorageClient(open_backend(url), namespace, **client_options)
