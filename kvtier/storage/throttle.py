"""A backend slowed to a byte rate (``?throttle=200MB`` on any storage URL): a slow pool on demand,
to show what the fetch-vs-recompute cost model does when fetching does not pay."""

from __future__ import annotations

import threading
import time
from typing import Sequence

from kvtier.storage.base import Backend


class ThrottledBackend(Backend):
    def __init__(self, inner: Backend, bytes_per_second: int) -> None:
        self.inner = inner
        self.rate = float(bytes_per_second)
        self.scheme = inner.scheme  # type: ignore[misc]  # per instance: the inner backend's
        self.supports_parts = inner.supports_parts  # type: ignore[misc]  # per instance: the inner backend's
        self._lock = threading.Lock()
        self._free_at = time.monotonic()  # one shared link: transfers queue behind each other

    def _pace(self, nbytes: int) -> None:
        with self._lock:
            start = max(self._free_at, time.monotonic())
            self._free_at = start + nbytes / self.rate
            until = self._free_at
        delay = until - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def exists(self, names: Sequence[str]) -> list[bool]:
        return self.inner.exists(names)

    def get_into(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[int]:
        sizes = self.inner.get_into(names, bufs)
        self._pace(sum(s for s in sizes if s > 0))
        return sizes

    def put_from(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[bool]:
        self._pace(sum(len(b) for b in bufs))
        return self.inner.put_from(names, bufs)

    def get_into_parts(self, names: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[int]:
        sizes = self.inner.get_into_parts(names, parts)
        self._pace(sum(s for s in sizes if s > 0))
        return sizes

    def put_from_parts(self, names: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        self._pace(sum(len(b) for p in parts for b in p))
        return self.inner.put_from_parts(names, parts)

    def delete(self, names: Sequence[str]) -> None:
        self.inner.delete(names)

    def register_buffer(self, buf: memoryview) -> None:
        self.inner.register_buffer(buf)

    def stats(self) -> dict:
        return {**self.inner.stats(), "throttle_bytes_per_s": self.rate}

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> str:
        return f"{self.inner.describe()} (throttled to {self.rate / 1e6:.0f} MB/s)"
