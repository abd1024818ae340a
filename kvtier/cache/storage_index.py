"""What the manager knows of the storage tier: which block keys it holds.

The manager asks ``lookup_prefix(keys)`` (how many leading keys are stored) when a match runs
past the tree, and tells ``add(key)`` once a put is acknowledged. A real pool client (Redis,
Mooncake, a directory) answers from the pool itself; :class:`SimulatedStorage` keeps the keys
in process with an LRU capacity, for ``kvtier sim`` and the ``memory://`` pool.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Protocol, Sequence


class StorageIndex(Protocol):
    def lookup_prefix(self, keys: Sequence[bytes]) -> int: ...
    def add(self, key: bytes) -> None: ...
    def contains(self, key: bytes) -> bool: ...


class SimulatedStorage:
    """Key set with LRU eviction at ``capacity_blocks`` (``None`` or ``inf``: unbounded)."""

    def __init__(self, capacity_blocks: int | float | None = None) -> None:
        if capacity_blocks is not None and capacity_blocks != math.inf:
            if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks < 1:
                raise ValueError(f"storage capacity must be a positive int or inf, got {capacity_blocks!r}")
        self.capacity = None if capacity_blocks in (None, math.inf) else int(capacity_blocks)
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._keys)

    def contains(self, key: bytes) -> bool:
        return key in self._keys

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        stored = self._keys
        n = 0
        for k in keys:
            if k not in stored:
                break
            stored.move_to_end(k)
            n += 1
        return n

    def add(self, key: bytes) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        if self.capacity is not None:
            while len(self._keys) > self.capacity:
                self._keys.popitem(last=False)
                self.evictions += 1
