"""The cache's records: one request's (:class:`CacheRequest`, and what hangs off it while copies
are in flight: its storage :class:`Prefetch`, a hand-off's :class:`TailBlock` and
:class:`Export`) and the counters (:class:`CacheStats`). Plain data, read and written by the block
table (cache/table.py), the mover (cache/mover.py) and their collaborators (cache/prefetch.py,
cache/handoff.py); no behaviour of their own beyond a few views.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.cache.keys import BlockHasher
from kvtier.cache.plan import MatchResult
from kvtier.cache.tree import Node

TIERS = ("device", "host", "storage")


def check_block_size(block_size: object) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a positive power of two, got {block_size!r}")
    return block_size


class Prefetch:
    """One request's storage->host fetch, in chunks: it holds the node its blocks hang from
    until its last chunk completed. Chunk ``c`` hangs below the block before it (``keys``)."""

    __slots__ = (
        "anchor",
        "locked",
        "host_pinned",
        "keys",
        "start",
        "next_index",
        "waits_for",
        "num_blocks_pending",
        "num_chunks_pending",
        "uniform",
        "preload",
        "num_preloading",
    )

    def __init__(self, anchor: Node, locked: bool) -> None:
        self.anchor = anchor
        self.locked = locked  # held by a lock (its host copy is still in flight) ...
        self.host_pinned = not locked  # ... and by a host pin once that copy has landed
        self.keys: tuple[bytes, ...] = ()
        self.start = 0  # keys[:start] are fetched by other prefetches (waits_for)
        self.next_index = 0  # chunks land in order: the first item index of the next one
        self.waits_for: list[Prefetch] = []
        self.num_blocks_pending = 0
        self.num_chunks_pending = 0
        self.uniform = True  # its labels have no extras (BlockHasher.uniform)
        self.preload = False  # early loads: its blocks go on to the device as they land
        self.num_preloading = 0  # its preloads in flight


class TailBlock:
    """The last, partial block of a prompt on its way to (P) or from (D) the pool."""

    __slots__ = ("key", "index", "num_tokens", "host_block", "device_block", "state", "export")

    def __init__(self, key: str, index: int, num_tokens: int) -> None:
        self.key = key  # "<hex>:partial:<num_tokens>" (storage object name)
        self.index = index  # block index in the request (= full blocks before it)
        self.num_tokens = num_tokens
        self.host_block: int | None = None
        self.device_block: int | None = None
        # D: wanted -> fetching -> ready -> loading -> done | failed | dropped
        # P: backing_up -> putting -> done | failed
        self.state = "wanted"
        self.export: Export | None = None


class Export:
    """One request's prompt on its way to the pool (P): ``done`` once every block was acked."""

    __slots__ = ("rid", "num_tokens", "keys", "num_waiting", "failed", "skipped")

    def __init__(self, rid: object, num_tokens: int, keys: list[str]) -> None:
        self.rid = rid
        self.num_tokens = num_tokens
        self.keys = keys  # storage names of the blocks, in order (manifest)
        self.num_waiting = 0  # blocks not acked yet
        self.failed = 0  # blocks that did not reach the pool
        self.skipped = 0  # full blocks the pool already held

    @property
    def done(self) -> bool:
        return self.num_waiting == 0


class CacheRequest:
    """The cache's record of one request. ``token_ids`` is the caller's list (it grows)."""

    __slots__ = (
        "rid",
        "token_ids",
        "hasher",
        "nodes",
        "block_table",
        "num_loading",
        "admitted",
        "freed",
        "match_path",
        "num_device_hits",
        "num_host_hits",
        "match_epoch",
        "match",
        "prefetch",
        "storage_probe",
        "tail",
        "no_hits",
        "sliding_first",
    )

    def __init__(self, rid: object, token_ids: list[int], hasher: BlockHasher) -> None:
        self.rid = rid
        self.token_ids = token_ids
        self.hasher = hasher
        self.nodes: list[Node] = []  # locked; block_table[i] == nodes[i].device_block
        self.block_table: list[int] = []
        self.num_loading = 0  # host->device loads in flight into block_table
        self.admitted = False
        self.freed = False
        # the block table's last match: nodes (device hits then host hits), the tree's epoch then
        self.match_path: list[Node] = []
        self.num_device_hits = 0
        self.num_host_hits = 0
        self.match_epoch = -1
        self.match: MatchResult | None = None
        self.prefetch: Prefetch | None = None  # its storage prefetch (one per admission)
        self.storage_probe: tuple | None = None  # last storage lookup: (first, end, hits or its future, when)
        self.tail: TailBlock | None = None  # PD: the prompt's partial block, from the pool
        self.no_hits = False  # match nothing (it must compute every token)
        self.sliding_first: list[int] = []  # per sliding group: the first block whose slot it holds (cache/sliding.py)

    @property
    def keys(self) -> list[bytes]:
        return self.hasher.keys

    @property
    def matched(self) -> list[Node]:
        """The nodes its last match found: device hits, then host hits (read only)."""
        return self.match_path


@dataclass(slots=True)
class CacheStats:
    hit_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    evictions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    bytes_moved: dict[str, int] = field(
        default_factory=lambda: {"host_to_device": 0, "device_to_host": 0, "storage_to_host": 0, "host_to_storage": 0}
    )
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("load", "backup", "fetch", "put"), 0))
    query_tokens: int = 0
    swapped_out_blocks: int = 0

    def as_dict(self) -> dict:
        return {
            "hit_tokens": dict(self.hit_tokens),
            "evictions": dict(self.evictions),
            "bytes_moved": dict(self.bytes_moved),
            "failures": dict(self.failures),
            "query_tokens": self.query_tokens,
            "swapped_out_blocks": self.swapped_out_blocks,
        }
