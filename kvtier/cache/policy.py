"""Write and eviction policies, chosen by name.

Write policies decide when a block is copied one tier down (device → host, host → storage):

=========================  ==========================================  =========================
name                       copy down when                              on eviction of a lone copy
=========================  ==========================================  =========================
``write_through``          the block lands on the upper tier           dropped (already copied)
``write_through_selective`` its hit count reaches the threshold (2)    dropped
``write_back``             it is evicted from the upper tier           copied first, then freed
=========================  ==========================================  =========================

Eviction policies order the evictable leaves of a tier: ``lru`` (least recently used first,
deeper blocks first among equals) and ``lfu`` (fewest hits first, then LRU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


@dataclass(frozen=True, slots=True)
class WritePolicy:
    name: str
    threshold: int = 2

    def __post_init__(self) -> None:
        if self.name not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {self.name!r}; choose from {list(WRITE_POLICIES)}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int) or self.threshold < 1:
            raise ValueError(f"write_through_threshold must be an int >= 1, got {self.threshold!r}")

    def copy_on_land(self, hit_count: int) -> bool:
        """Copy a block down as soon as it lands on a tier (or is hit) with this hit count?"""
        if self.name == "write_through":
            return True
        if self.name == "write_through_selective":
            return hit_count >= self.threshold
        return False

    @property
    def copy_on_evict(self) -> bool:
        return self.name == "write_back"


def default_write_policy(has_host_tier: bool, has_storage: bool) -> str:
    """The write policy when none is chosen: ``write_through`` with a host tier or a storage pool
    (every computed block is copied down, so a history evicted from the device comes back from the
    host tier and the pool serves the next engine), else ``write_through_selective``. The engine
    and ``kvtier sim`` both resolve ``write_policy=None`` here."""
    return "write_through" if has_host_tier or has_storage else "write_through_selective"


# An eviction key orders candidates: the smallest key is evicted first.
EvictionKey = Callable[[object], tuple]


def _lru(node) -> tuple:
    return (node.last_access, -node.depth)


def _lfu(node) -> tuple:
    return (node.hit_count, node.last_access, -node.depth)


EVICTION_POLICIES: dict[str, EvictionKey] = {"lru": _lru, "lfu": _lfu}


def get_eviction_key(name: str) -> EvictionKey:
    try:
        return EVICTION_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {sorted(EVICTION_POLICIES)}") from None
