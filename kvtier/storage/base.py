"""The one interface every storage backend implements (DESIGN §6/§7).

A backend stores opaque, immutable objects (self-checking blobs, see :mod:`kvtier.storage.blob`)
under object names (``kvt:<ns>:<hex>``). It is called from the storage client's worker threads,
never from the scheduler thread's hot path, always in batches::

    exists(names)               -> [bool]   which objects are present (one round trip)
    get_into(names, bufs)       -> [int]    read object i into bufs[i]; its size, or MISSING
    put_from(names, bufs)       -> [bool]   store bufs[i] under names[i]; False: refused (pool full)
    delete(names)                           remove (best effort; a missing name is fine)
    register_buffer(buf)                    the client's staging memory (zero-copy backends pin it)
    get_into_parts / put_from_parts         optional (``supports_parts``): an object as several
                                            buffers (header, KV, routing): read/written straight
                                            from/into host blocks, no staging copy
    stats()                     -> dict     backend counters (objects, bytes, evictions, ...)
    close()

Contract:

* A *missing* object (never written, evicted, leased away, being written) is not an error: it is
  ``MISSING`` in ``get_into`` and ``False`` in ``exists``.
* An object larger than its buffer is ``TOO_LARGE`` (the client treats it as corrupt).
* A backend that cannot answer at all (connection refused, timeout, server error) **raises**
  :class:`StorageError` (or any exception): the client retries a bounded number of times, then
  reports the whole batch failed and may open its circuit breaker. Items are never half-reported.
* ``put_from`` of a name that exists may keep the old value (objects are content-addressed).
* Every call is bounded in time by the backend's own timeouts (socket timeouts, server leases):
  the client never reports an op before its worker returned, so a late write can never land in a
  host block that was handed to someone else.
* Backends are used by several worker threads at once: they must be thread-safe (one connection
  pool, or one connection per thread).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Sequence

MISSING = -1
TOO_LARGE = -2


class StorageError(RuntimeError):
    """The backend could not answer (connection, timeout, server error)."""


class Backend(ABC):
    scheme: ClassVar[str] = "?"
    supports_parts: ClassVar[bool] = False

    @abstractmethod
    def exists(self, names: Sequence[str]) -> list[bool]: ...

    @abstractmethod
    def get_into(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[int]: ...

    @abstractmethod
    def put_from(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[bool]: ...

    @abstractmethod
    def delete(self, names: Sequence[str]) -> None: ...

    def get_into_parts(self, names: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[int]:
        """Read object i scattered over ``parts[i]`` (filled in order); its size, MISSING, or
        TOO_LARGE (larger than the parts together). Only if ``supports_parts``."""
        raise NotImplementedError

    def put_from_parts(self, names: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        """Store the concatenation of ``parts[i]`` under names[i]. Only if ``supports_parts``."""
        raise NotImplementedError

    def register_buffer(self, buf: memoryview) -> None:
        """Staging memory the client will pass slices of to get_into/put_from (zero-copy clients
        register it with their transport once). Default: nothing to do."""

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass

    def describe(self) -> str:
        """The URL without secrets (see :func:`redact_url`), for logs and stats."""
        return f"{self.scheme}://"
