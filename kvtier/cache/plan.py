"""What the manager asks the transfer engine to move in one step.

A :class:`StepPlan` merges the transfers of all the step's requests: at most one
:class:`TransferOp` per direction, except fetches: one op per chunk of a prefetch (so that a
request can be admitted with the chunks that landed while later ones are still in flight). Items of
an op are parallel tuples (item ``i`` moves ``src_blocks[i]`` to ``dst_blocks[i]``, block key
``keys[i]``). No destination appears twice in a plan and no block is written by one op while
another reads it: every destination is a freshly allocated block, every source is pinned until its
op completes.

The executor reports back with :meth:`CacheManager.complete` (``op_id`` plus the indices of the
items that failed); only then do the bytes count as landed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterator

# kind -> (source tier, destination tier)
OP_KINDS = {
    "load": ("host", "device"),  # host -> device, before the step's forward reads it
    "preload": ("host", "device"),  # host -> device into tree nodes, ahead of a waiting request's
    # admission (no forward waits on it: it lands as device copies)
    "backup": ("device", "host"),  # device -> host, after the forward that wrote it
    "fetch": ("storage", "host"),  # storage -> host (prefetch)
    "put": ("host", "storage"),  # host -> storage
}


class CopyKind(enum.Enum):
    """The kinds of copy the mover (cache/mover.py) stages and tracks until they complete: the
    name of their ops (``TransferOp.kind``), the ``CacheStats.bytes_moved`` direction their
    bytes count in, and the ``CacheStats.failures`` entry their failed items count in."""

    LOAD = ("load", "host_to_device", "load")
    PRELOAD = ("preload", "host_to_device", "load")
    BACKUP = ("backup", "device_to_host", "backup")
    FETCH = ("fetch", "storage_to_host", "fetch")
    PUT = ("put", "host_to_storage", "put")
    TAILFETCH = ("tailfetch", "storage_to_host", "fetch")  # a hand-off's partial block (a fetch op)

    def __init__(self, label: str, direction: str, failure: str) -> None:
        self.label = label
        self.direction = direction
        self.failure = failure


@dataclass(frozen=True, slots=True)
class TransferOp:
    op_id: int
    kind: str
    src_blocks: tuple[int, ...]  # device or host block ids; () for fetch
    dst_blocks: tuple[int, ...]  # device or host block ids; () for put
    keys: tuple[bytes | str, ...]  # block keys of the items (storage object names derive from them)

    @property
    def num_blocks(self) -> int:
        return len(self.keys)

    @property
    def src_tier(self) -> str:
        return OP_KINDS[self.kind][0]

    @property
    def dst_tier(self) -> str:
        return OP_KINDS[self.kind][1]


@dataclass(frozen=True, slots=True)
class StepPlan:
    loads: TransferOp | None = None
    backups: TransferOp | None = None
    fetches: tuple[TransferOp, ...] = ()
    puts: TransferOp | None = None
    preloads: TransferOp | None = None

    def __iter__(self) -> Iterator[TransferOp]:
        return (op for op in (self.loads, self.backups, self.preloads, *self.fetches, self.puts) if op is not None)

    def __bool__(self) -> bool:
        return any(True for _ in self)


@dataclass(frozen=True, slots=True)
class MatchResult:
    """Longest cached prefix of a request, in full blocks, split by tier in path order."""

    block_size: int
    num_device_blocks: int
    num_host_blocks: int
    num_storage_blocks: int
    storage_keys: tuple[bytes, ...] = field(default=(), repr=False)

    @property
    def num_blocks(self) -> int:
        return self.num_device_blocks + self.num_host_blocks + self.num_storage_blocks

    @property
    def num_cached_tokens(self) -> int:
        """Tokens that need no recompute once host/storage hits are brought up."""
        return self.num_blocks * self.block_size

    def tokens_by_tier(self) -> dict[str, int]:
        bs = self.block_size
        return {"device": self.num_device_blocks * bs, "host": self.num_host_blocks * bs, "storage": self.num_storage_blocks * bs}
