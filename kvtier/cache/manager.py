"""CacheManager: the cache's one front, composing the block table and the mover.

The scheduler's vocabulary (one request ``r``, a :class:`CacheRequest` from :meth:`new_request`)::

    start_lookup(r)            at arrival: the pool's lookup of r's blocks, on a storage thread
    match_prefix(r)            longest cached prefix: device hits, then host hits, then storage hits
    prefetch(r)                storage hits -> host blocks, as many as the cost model says pay
                               (chunks complete later; then match again)   -- cache/prefetch.py;
                               with early loads, r's host hits and each chunk as it lands go on
                               to the device too (``preload`` ops), so r is admitted with them
                               as device hits
    prefetch_pending(r)        blocks of r's prefetch still in flight
    can_allocate(r, n) / allocate(r, n)
                               block table covers n tokens; the first call admits r: pins its
                               device hits and plans host->device loads for its host hits
    commit(r, n)               the forward wrote KV of positions < n: full blocks join the tree
    free(r)                    finish / abort / preempt: unpin, return r's own blocks
    swap_out(r)                preempt by swap: copy r's committed blocks to host, then free(r)
    take_plan()                this step's merged transfers (StepPlan)
    complete(op_id, failed)    an op finished; only now do its bytes count as landed

Each of them is one part's (the block table's, cache/table.py: which block of which request lives
on which tier; the mover's, cache/mover.py: the copies between tiers, staged to completed) or one
collaborator's (the prefetcher's, cache/prefetch.py; the hand-off's, cache/handoff.py). The
manager holds the four, wires them together, and is what the prefetcher and the hand-off use of
the cache (:class:`~kvtier.cache.prefetch.PrefetchHost`, :class:`~kvtier.cache.handoff.HandoffHost`).
"""

from __future__ import annotations

import math
from typing import Collection, Sequence

from kvtier.cache.cost import FetchCostModel
from kvtier.cache.events import KVEvents
from kvtier.cache.handoff import Export, Handoff
from kvtier.cache.keys import MMItem, ModelFingerprint
from kvtier.cache.mover import Mover
from kvtier.cache.plan import CopyKind, MatchResult, StepPlan
from kvtier.cache.policy import WritePolicy
from kvtier.cache.pool import BlockPool
from kvtier.cache.prefetch import Prefetcher
from kvtier.cache.records import TIERS, CacheRequest, CacheStats, check_block_size
from kvtier.cache.sliding import SlidingGroup
from kvtier.cache.storage_index import StorageIndex
from kvtier.cache.table import MAX_SEEDS, BlockTable
from kvtier.cache.tree import Node, RadixTree

__all__ = [
    "FETCH_CHUNK",
    "MAX_SEEDS",
    "TIERS",
    "CacheManager",
    "CacheRequest",
    "CacheStats",
    "check_block_size",
    "parse_capacity",
]

FETCH_CHUNK = 32  # blocks per fetch op: a request may start with the chunks that landed


class CacheManager:
    """The block table, the mover, the prefetcher and the hand-off, behind one set of methods."""

    def __init__(
        self,
        block_size: int = 16,
        num_device_blocks: int = 1024,
        num_host_blocks: int = 0,
        storage: StorageIndex | None = None,
        write_policy: str = "write_through_selective",
        write_through_threshold: int = 2,
        eviction: str = "lru",
        hash_name: str = "sha256",
        fingerprint: ModelFingerprint | None = None,
        block_nbytes: int = 0,
        enable_prefix_caching: bool = True,
        fetch_cost: FetchCostModel | None = None,
        fetch_chunk_blocks: int = FETCH_CHUNK,
        early_loads: bool = True,
        sliding: Sequence[tuple[int, int]] = (),
    ) -> None:
        """``sliding``: (window, slots) of each sliding-window group whose blocks are its own,
        freed as its window moves on (cache/sliding.py; device tier only); empty: every layer
        keeps every block."""
        self.table = table = BlockTable(
            block_size,
            num_device_blocks,
            num_host_blocks,
            storage,
            write_policy,
            write_through_threshold,
            eviction,
            hash_name,
            fingerprint,
            enable_prefix_caching,
            sliding,
        )
        self.mover = mover = Mover(table, block_nbytes)
        self.prefetcher = Prefetcher(self, fetch_cost, fetch_chunk_blocks, early_loads)  # storage -> host fetches
        self.handoff = Handoff(self)  # PD: prompts to and from the pool
        table.copies, mover.prefetcher, mover.handoff = mover, self.prefetcher, self.handoff

    # ------------------------------------------------------------------ the parts' state
    @property
    def block_size(self) -> int:
        return self.table.block_size

    @property
    def device_pool(self) -> BlockPool:
        return self.table.device_pool

    @property
    def host_pool(self) -> BlockPool:
        return self.table.host_pool

    @property
    def sliding_groups(self) -> Sequence[SlidingGroup]:
        """The sliding-window groups whose blocks are their own (cache/sliding.py), in model order."""
        return self.table.sliding

    def sliding_tables(self, req: CacheRequest, num_blocks: int) -> list[list[int]]:
        """Per sliding group, ``req``'s block table over its first ``num_blocks`` device blocks
        (slots from the first block its next query reads)."""
        table = req.block_table[:num_blocks]
        return [g.table(table, min(first, len(table))) for g, first in zip(self.table.sliding, req.sliding_first)]

    @property
    def has_host(self) -> bool:
        return self.table.has_host

    @property
    def tree(self) -> RadixTree:
        return self.table.tree

    @property
    def events(self) -> KVEvents:
        return self.table.events

    @property
    def stats(self) -> CacheStats:
        return self.table.stats

    @property
    def policy(self) -> WritePolicy:
        return self.table.policy

    @property
    def hash_name(self) -> str:
        return self.table.hash_name

    @property
    def fingerprint(self) -> ModelFingerprint | None:
        return self.table.fingerprint

    @property
    def enable_prefix_caching(self) -> bool:
        return self.table.enable_prefix_caching

    @property
    def storage(self) -> StorageIndex | None:
        return self.table.storage

    @storage.setter
    def storage(self, storage: StorageIndex | None) -> None:
        self.table.storage = storage

    @property
    def block_nbytes(self) -> int:
        return self.mover.block_nbytes

    @property
    def fetch_cost(self) -> FetchCostModel | None:
        return self.prefetcher.fetch_cost

    @property
    def fetch_chunk(self) -> int:
        return self.prefetcher.fetch_chunk

    @property
    def early_loads(self) -> bool:
        return self.prefetcher.early_loads

    @early_loads.setter
    def early_loads(self, on: bool) -> None:
        self.prefetcher.early_loads = on

    # ------------------------------------------------------------------ the block table
    def new_request(
        self,
        rid: object,
        token_ids: list[int],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_items: Sequence[MMItem] = (),
    ) -> CacheRequest:
        return self.table.new_request(rid, token_ids, cache_salt=cache_salt, lora_name=lora_name, mm_items=mm_items)

    def sync_keys(self, req: CacheRequest, num_tokens: int | None = None) -> list[bytes]:
        """Keys of every full block of ``req.token_ids[:num_tokens]`` (and any hashed before)."""
        return self.table.sync_keys(req, num_tokens)

    def start_lookup(self, req: CacheRequest) -> None:
        """At arrival: the pool's lookup of ``req``'s blocks past device and host, on its thread."""
        self.table.start_lookup(req)

    def match_prefix(self, req: CacheRequest) -> MatchResult:
        """Longest cached prefix of full blocks, leaving at least one token to compute."""
        return self.table.match_prefix(req)

    def can_allocate(self, req: CacheRequest, num_tokens: int) -> bool:
        """Could ``allocate(req, num_tokens)`` succeed now? (an estimate; allocate decides)."""
        return self.table.can_allocate(req, num_tokens)

    def wait_would_fit(self, req: CacheRequest, num_tokens: int) -> bool:
        """Would the device blocks that copies in flight free (:attr:`num_device_blocks_freeing`)
        let ``allocate(req, num_tokens)`` succeed once they land? (an upper bound). The scheduler
        waits for them only then; otherwise waiting cannot help, and it preempts at once."""
        return self.table.would_fit(req, num_tokens, self.mover.num_device_blocks_freeing)

    def allocate(self, req: CacheRequest, num_tokens: int) -> bool:
        """Grow ``req.block_table`` to cover ``num_tokens`` positions (``BlockTable.allocate``)."""
        return self.table.allocate(req, num_tokens)

    def take_device(self, n: int) -> list[int] | None:
        return self.table.take_device(n)

    def take_host(self, n: int) -> list[int] | None:
        return self.table.take_host(n)

    def touch(self) -> int:
        """The next access tick (LRU order of the blocks used now)."""
        return self.table.touch()

    def reset_prefix_cache(self) -> dict[str, int]:
        """Drop every cached block no request holds and no copy uses (``BlockTable.reset_prefix_cache``)."""
        return self.table.reset_prefix_cache()

    def commit(self, req: CacheRequest, num_tokens: int) -> None:
        """Positions < ``num_tokens`` of ``req`` hold KV written by a finished forward."""
        self.table.commit(req, num_tokens)

    def free(self, req: CacheRequest) -> None:
        """Finish, abort or preempt: unlock the request's nodes, return its own blocks."""
        self.table.free(req)

    def swap_out(self, req: CacheRequest) -> int:
        """Preemption by swap: plan device->host copies of every block ``req`` committed that has
        no host copy (whatever the write policy), then :meth:`free` it. Returns the blocks planned.

        The blocks stay in the tree: when the request comes back, its prefix matches on device
        (if not evicted meanwhile) or on host, and is loaded instead of recomputed. Only the last,
        partial block is recomputed. A host tier too full to take them costs a recompute."""
        planned = self.mover.swap_out(req) if self.has_host and req.admitted and not req.freed else 0
        self.free(req)
        return planned

    # ------------------------------------------------------------------ the mover
    def stage(self, kind: CopyKind, *items: tuple) -> None:
        """Items of this step's ``kind`` op, as ``take_plan`` reads them."""
        self.mover.stage(kind, *items)

    def new_op(self, kind: CopyKind, items: list) -> int:
        """A new op id, its items pending until ``complete``."""
        return self.mover.new_op(kind, items)

    def backup(self, node: Node) -> bool:
        """Plan device->host copies of ``node`` and of its ancestors that lack a host copy."""
        return self.mover.backup(node)

    def copy_down(self, node: Node) -> None:
        """Copy-on-land backup of ``node`` (retried when a copy completes if the host is full)."""
        self.mover.copy_down(node)

    def put_to_storage(self, node: Node) -> None:
        self.mover.put_to_storage(node)

    @property
    def num_device_blocks_freeing(self) -> int:
        """Device blocks no request holds that become free or evictable once copies in flight land."""
        return self.mover.num_device_blocks_freeing

    def take_plan(self) -> StepPlan:
        """This step's transfers, merged across requests (one op per direction)."""
        return self.mover.take_plan()

    @property
    def num_pending_ops(self) -> int:
        return self.mover.num_pending_ops

    def complete(self, op_id: int, failed: Collection[int] = ()) -> dict[object, int]:
        """Op ``op_id`` finished; items at indices in ``failed`` did not land. Returns
        ``{rid: num_valid_tokens}`` for requests whose loads failed (recompute from there)."""
        return self.mover.complete(op_id, failed)

    def complete_plan(self, plan: StepPlan, failed: dict[str, Collection[int]] | None = None) -> dict[object, int]:
        """Complete every op of ``plan`` (``failed`` by kind); merged rewinds."""
        return self.mover.complete_plan(plan, failed)

    # ------------------------------------------------------------------ collaborators
    def prefetch(self, req: CacheRequest) -> int:
        """Plan storage->host fetches of ``req``'s storage hits (after ``match_prefix``): the
        blocks that will land for it (they become host hits), a hand-off's partial last block
        (``expect_tail``) included. See :class:`~kvtier.cache.prefetch.Prefetcher`."""
        tail = self.handoff.fetch_tail(req) if req.tail is not None and not req.admitted else 0
        return tail + self.prefetcher.prefetch(req)

    def prefetch_pending(self, req: CacheRequest) -> int:
        """Blocks of ``req``'s prefetch (and the prefetches it waits for) not landed yet."""
        tail = 1 if req.tail is not None and req.tail.state == "fetching" else 0
        return tail + self.prefetcher.pending(req)

    # PD hand-off (DESIGN §7): see :class:`~kvtier.cache.handoff.Handoff` for each one
    def handoff_keys(self, req: CacheRequest, num_tokens: int) -> tuple[list[bytes], str | None]:
        """Keys of ``req``'s first ``num_tokens`` tokens: the full blocks', the partial block's name."""
        return self.handoff.keys(req, num_tokens)

    def manifest_names(self, full: list[bytes], tail: str | None) -> list[str]:
        """Storage object names of :meth:`handoff_keys`' blocks."""
        return self.handoff.manifest_names(full, tail)

    def export(self, req: CacheRequest, num_tokens: int) -> Export:
        """P: write every block of ``req``'s first ``num_tokens`` tokens to the pool."""
        return self.handoff.export(req, num_tokens)

    def expect_tail(self, req: CacheRequest, num_tokens: int) -> str | None:
        """D: ``req``'s prompt ends in a partial block P wrote: :meth:`prefetch` fetches it."""
        return self.handoff.expect_tail(req, num_tokens)

    def tail_hit(self, req: CacheRequest) -> int:
        """D: tokens of ``req``'s fetched partial block that count as cached."""
        return self.handoff.tail_hit(req)

    # ------------------------------------------------------------------ checks
    def assert_invariants(self, requests: Sequence[CacheRequest] = ()) -> None:
        """DESIGN §5 (1, 2, 3, 4, 6) on the whole state (cache/invariants.py). ``requests``:
        every live request."""
        from kvtier.cache.invariants import check

        check(self, requests)

    def copies_in_flight(self) -> list[tuple[CopyKind, list]]:
        """Every copy planned and not completed, as ``(kind, items)``: the ops in flight, this
        step's staged items, and the fetched chunks parked until their turn."""
        return self.mover.copies_in_flight()

    @property
    def landed_twice(self) -> tuple[int, ...]:
        """Device blocks of loads that landed twice, held out of the pool until the next allocate."""
        return self.table.landed_twice


def parse_capacity(value: str | int | float) -> int | float:
    """``0`` (none), a block count, or ``inf`` (unbounded)."""
    if isinstance(value, str):
        if value.strip().lower() in ("inf", "infinite", "unbounded"):
            return math.inf
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"capacity must be a block count or 'inf', got {value!r}") from None
    if value != math.inf and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"capacity must be a non-negative block count or 'inf', got {value!r}")
    return value
