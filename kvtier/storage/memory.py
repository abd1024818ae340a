"""In-process storage backend (``memory://``): bytes by name, LRU-evicted at a byte capacity."""
from __future__ import annotations

import re
from collections import OrderedDict
from typing import Sequence

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "kb": 1000, "mib": 1 << 20, "mb": 1000**2,
          "gib": 1 << 30, "gb": 1000**3, "tib": 1 << 40, "tb": 1000**4}


def parse_size(text: str) -> int:
    """``1GiB``, ``512MB``, ``1048576`` -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"bad size {text!r}; use e.g. 1GiB, 512MB or a byte count")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


class MemoryBackend:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.nbytes = 0
        self.evictions = 0
        self._objects: OrderedDict[str, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._objects)

    def exists(self, names: Sequence[str]) -> list[bool]:
        return [n in self._objects for n in names]

    def put(self, name: str, data: bytes) -> bool:
        if len(data) > self.capacity:
            return False
        if name in self._objects:          # immutable, content-addressed: keep the first copy
            self._objects.move_to_end(name)
            return True
        self._objects[name] = bytes(data)
        self.nbytes += len(data)
        while self.nbytes > self.capacity:
            _, old = self._objects.popitem(last=False)
            self.nbytes -= len(old)
            self.evictions += 1
        return True

    def get(self, name: str) -> bytes | None:
        data = self._objects.get(name)
        if data is not None:
            self._objects.move_to_end(name)
        return data
