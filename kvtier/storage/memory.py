"""In-process storage backend (``memory://?capacity=1GiB``): bytes by name, LRU-evicted at a byte
capacity. Not shared between processes; for tests, demos and single-process use."""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Sequence
from urllib.parse import parse_qs, urlparse

from kvtier.redact import redact_url
from kvtier.storage.base import MISSING, TOO_LARGE, Backend

_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "kb": 1000,
    "mib": 1 << 20,
    "mb": 1000**2,
    "gib": 1 << 30,
    "gb": 1000**3,
    "tib": 1 << 40,
    "tb": 1000**4,
}


def parse_size(text: str) -> int:
    """``1GiB``, ``512MB``, ``1048576`` -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"bad size {text!r}; use e.g. 1GiB, 512MB or a byte count")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def query_params(url: str, allowed: Sequence[str]) -> dict[str, str]:
    """The URL's query as a dict of single values; an unknown or repeated name is an error."""
    q = parse_qs(urlparse(url).query, keep_blank_values=True)
    for name, values in q.items():
        if name not in allowed:
            raise ValueError(f"unknown parameter {name!r} in storage URL {redact_url(url)!r}; allowed: {', '.join(allowed)}")
        if len(values) != 1:
            raise ValueError(f"parameter {name!r} given {len(values)} times in {redact_url(url)!r}")
    return {k: v[0] for k, v in q.items()}


class MemoryBackend(Backend):
    scheme = "memory"

    def __init__(self, capacity_bytes: int = 1 << 30) -> None:
        self.capacity = capacity_bytes
        self.nbytes = 0
        self.evictions = 0
        self._objects: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str) -> "MemoryBackend":
        q = query_params(url, ("capacity",))
        return cls(parse_size(q["capacity"]) if "capacity" in q else 1 << 30)

    def __len__(self) -> int:
        return len(self._objects)

    def exists(self, names: Sequence[str]) -> list[bool]:
        with self._lock:
            return [n in self._objects for n in names]

    def get_into(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[int]:
        out = []
        for name, buf in zip(names, bufs):
            with self._lock:
                data = self._objects.get(name)
                if data is not None:
                    self._objects.move_to_end(name)
            if data is None:
                out.append(MISSING)
            elif len(data) > len(buf):
                out.append(TOO_LARGE)
            else:
                buf[: len(data)] = data
                out.append(len(data))
        return out

    def put_from(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[bool]:
        out = []
        for name, buf in zip(names, bufs):
            if len(buf) > self.capacity:
                out.append(False)
                continue
            data = bytes(buf)
            with self._lock:
                if name in self._objects:  # immutable, content-addressed: keep the first copy
                    self._objects.move_to_end(name)
                else:
                    self._objects[name] = data
                    self.nbytes += len(data)
                    while self.nbytes > self.capacity:
                        _, old = self._objects.popitem(last=False)
                        self.nbytes -= len(old)
                        self.evictions += 1
            out.append(True)
        return out

    def delete(self, names: Sequence[str]) -> None:
        with self._lock:
            for n in names:
                data = self._objects.pop(n, None)
                if data is not None:
                    self.nbytes -= len(data)

    # test helpers: reach into the stored bytes (corruption tests)
    def names(self) -> list[str]:
        """The names of the objects held, least recently used first."""
        with self._lock:
            return list(self._objects)

    def raw(self, name: str) -> bytes | None:
        return self._objects.get(name)

    def set_raw(self, name: str, data: bytes) -> None:
        with self._lock:
            old = self._objects.pop(name, None)
            self.nbytes += len(data) - (len(old) if old is not None else 0)
            self._objects[name] = bytes(data)

    def stats(self) -> dict:
        return {"objects": len(self._objects), "nbytes": self.nbytes, "capacity": self.capacity, "evictions": self.evictions}

    def describe(self) -> str:
        return f"memory://?capacity={self.capacity}"
