"""CacheManager: which block of which request lives on which tier, and what moves this step.

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

A request's block table, after admission and a few steps::

    block_table = [ d0 d1 d2 | l3 l4 | n5 n6 n7 ]
                   ^ tree-owned (r.nodes, locked)   device hits, then committed blocks
                              ^ request-owned, loading from host (become tree-owned on success)
                                      ^ request-owned, computed by r (committed once full)

Ownership (DESIGN §5.1): every device block is free, or held by exactly one tree node, or by
exactly one request (``block_table[len(nodes):]``); every host block is free, held by one node,
or by one in-flight fetch.
"""

from __future__ import annotations

import logging
import math
import operator
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Collection, Sequence

from kvtier.cache.cost import FetchCostModel
from kvtier.cache.events import KVEvents
from kvtier.cache.handoff import Export, Handoff, TailBlock
from kvtier.cache.keys import BlockHasher, MMItem, ModelFingerprint, namespace_seed
from kvtier.cache.plan import MatchResult, StepPlan, TransferOp
from kvtier.cache.policy import WritePolicy, get_eviction_key
from kvtier.cache.pool import BlockPool
from kvtier.cache.prefetch import Prefetch, Prefetcher
from kvtier.cache.storage_index import StorageIndex
from kvtier.cache.tree import Node, RadixTree

log = logging.getLogger(__name__)
_DEVICE_BLOCK = operator.attrgetter("device_block")
TIERS = ("device", "host", "storage")
FETCH_CHUNK = 32  # blocks per fetch op: a request may start with the chunks that landed
MAX_SEEDS = 1024  # namespace seeds kept (one per cache_salt, least recently used dropped)
PROBE_TTL_S = 2.0  # a request's storage lookup older than this is asked again when it is matched


def check_block_size(block_size: object) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a positive power of two, got {block_size!r}")
    return block_size


class CacheRequest:
    """The manager's record of one request. ``token_ids`` is the caller's list (it grows)."""

    __slots__ = (
        "rid",
        "token_ids",
        "hasher",
        "nodes",
        "block_table",
        "num_loading",
        "admitted",
        "freed",
        "_path",
        "_num_device_hits",
        "_num_host_hits",
        "_epoch",
        "match",
        "prefetch",
        "_storage_probe",
        "tail",
        "no_hits",
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
        self._path: list[Node] = []  # matched nodes (device hits then host hits)
        self._num_device_hits = 0
        self._num_host_hits = 0
        self._epoch = -1
        self.match: MatchResult | None = None
        self.prefetch: Prefetch | None = None  # its storage prefetch (one per admission)
        self._storage_probe: tuple | None = None  # last storage lookup: (first, end, hits or its future, when)
        self.tail: TailBlock | None = None  # PD: the prompt's partial block, from the pool
        self.no_hits = False  # match nothing (it must compute every token)

    @property
    def keys(self) -> list[bytes]:
        return self.hasher.keys

    @property
    def matched(self) -> list[Node]:
        """The nodes its last match found: device hits, then host hits (read only)."""
        return self._path


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


_BYTES_KEY = {
    "load": "host_to_device",
    "backup": "device_to_host",
    "preload": "host_to_device",
    "fetch": "storage_to_host",
    "put": "host_to_storage",
    "tailfetch": "storage_to_host",
}
_STAT_KIND = {"tailfetch": "fetch", "preload": "load"}


class CacheManager:
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
    ) -> None:
        self.block_size = check_block_size(block_size)
        self.device_pool = BlockPool(num_device_blocks, "device")
        self.host_pool = BlockPool(num_host_blocks, "host")
        self.storage = storage
        self.policy = WritePolicy(write_policy, write_through_threshold)
        self.tree = RadixTree(get_eviction_key(eviction))
        self.events = self.tree.events = KVEvents()  # off until a router asks (cache/events.py)
        self.hash_name = hash_name
        namespace_seed(None, None, hash_name)  # validates hash_name early
        self.fingerprint = fingerprint
        self.block_nbytes = block_nbytes
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = CacheStats()
        self.fetch_cost = fetch_cost  # None: fetch every storage hit (storage_fetch="always")
        if fetch_chunk_blocks < 1:
            raise ValueError(f"fetch_chunk_blocks must be >= 1, got {fetch_chunk_blocks}")
        self.fetch_chunk = fetch_chunk_blocks
        self.early_loads = early_loads  # prefetched blocks go on to the device as they land
        self._backup_backlog: dict[int, Node] = {}  # copy-on-land backups waiting for host room
        # namespace seed per cache_salt, most recent last: salts are chosen by clients, so it is
        # bounded (an evicted salt's seed is just computed again, to the same bytes)
        self._seeds: OrderedDict[str | None, bytes] = OrderedDict()
        self._tick = 0
        self._next_op = 0
        # device blocks of loads that landed twice (the tree had a copy by then): a step queued
        # already may still read them, so they go back to the pool only at the scheduler's next
        # allocate or free, never to a preload staged while that step's loads are queued
        self._landed_twice: list[int] = []
        self._staged: dict[str, list] = {"load": [], "backup": [], "fetch": [], "put": [], "preload": []}
        self._pending: dict[int, tuple[str, list]] = {}
        self.prefetcher = Prefetcher(self)  # storage -> host fetches of storage hits
        self.handoff = Handoff(self)  # PD: prompts to and from the pool
        self._completers = {
            "load": self._complete_load,
            "backup": self._complete_backup,
            "put": self._complete_put,
            "fetch": self.prefetcher.complete,
            "preload": self.prefetcher.complete_preload,
            "tailfetch": self.handoff.complete_tailfetch,
        }

    @property
    def has_host(self) -> bool:
        return self.host_pool.num_blocks > 0

    # ================================================================== requests
    def new_request(
        self,
        rid: object,
        token_ids: list[int],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_items: Sequence[MMItem] = (),
    ) -> CacheRequest:
        seed = self._seeds.get(cache_salt)
        if seed is None:
            seed = self._seeds[cache_salt] = namespace_seed(self.fingerprint, cache_salt, self.hash_name)
            if len(self._seeds) > MAX_SEEDS:
                self._seeds.popitem(last=False)
        else:
            self._seeds.move_to_end(cache_salt)
        hasher = BlockHasher(self.block_size, seed, self.hash_name, lora_name, mm_items)
        return CacheRequest(rid, token_ids, hasher)

    def _sync_labels(self, req: CacheRequest, num_tokens: int) -> None:
        """Label (not hash) every full block of ``req.token_ids[:num_tokens]`` (and any after it)."""
        h = req.hasher
        if num_tokens // self.block_size > h.num_blocks:
            # every token there is so far, not just ``num_tokens``: ids only ever get appended, and
            # the first call then packs the whole prompt without copying the list
            ids = req.token_ids
            h.add_tokens(ids[h.num_tokens :] if h.num_tokens else ids)

    def sync_keys(self, req: CacheRequest, num_tokens: int | None = None) -> list[bytes]:
        """Keys of every full block of ``req.token_ids[:num_tokens]`` (and any hashed before)."""
        end = len(req.token_ids) if num_tokens is None else num_tokens
        self._sync_labels(req, end)
        return req.hasher.ensure_keys(end // self.block_size)

    def _tree_prefix(self, req: CacheRequest, max_blocks: int) -> tuple[list[Node], int, int]:
        """(path, device hits, device + host hits) of ``req``'s first ``max_blocks`` blocks."""
        self._sync_labels(req, max_blocks * self.block_size)
        path = self.tree.match(req.hasher, max_blocks)  # adopts the hits' keys: never hashed
        # device copies are prefix-closed: the device hits end where the first node
        # without one is (binary search); past them every node must be readable on host
        lo, hi = 0, len(path)
        while lo < hi:
            mid = (lo + hi) // 2
            if path[mid].device_block is None:
                hi = mid
            else:
                lo = mid + 1
        nh = lo
        while nh < len(path) and path[nh].host_ready:
            nh += 1
        return path, lo, nh

    def start_lookup(self, req: CacheRequest) -> None:
        """At arrival: ask the pool, on the storage client's lookup thread, for the blocks past
        what device and host hold now, so that :meth:`match_prefix` finds the answer ready when
        the request is scheduled: the engine thread does not wait for the pool (a round trip to
        a server) while other requests' steps could run."""
        lookup = getattr(self.storage, "lookup_prefix_async", None)
        max_blocks = (len(req.token_ids) - 1) // self.block_size if req.token_ids else 0
        if lookup is None or not self.enable_prefix_caching or req.no_hits or max_blocks <= 0:
            return
        _, _, nh = self._tree_prefix(req, max_blocks)
        if nh < max_blocks:
            keys = req.hasher.ensure_keys(max_blocks)
            req._storage_probe = (nh, max_blocks, lookup(keys[nh:max_blocks]), time.monotonic())

    def _storage_hits(self, req: CacheRequest, nh: int, max_blocks: int) -> int:
        """How many blocks from ``nh`` on the pool holds: from the lookup started at arrival (or
        an earlier step) when it covers ``nh`` and is fresh, else asked now."""
        probe = req._storage_probe  # one lookup per range, not one per step
        if probe is not None and probe[1] == max_blocks and time.monotonic() - probe[3] < PROBE_TTL_S:
            first, _, hits, at = probe
            if not isinstance(hits, int):  # started at arrival: usually answered by now
                try:
                    hits = int(hits.result())
                except Exception:  # noqa: BLE001 - a failed or cancelled lookup is a miss
                    hits = 0
                req._storage_probe = (first, max_blocks, hits, at)
            if first <= nh <= first + hits:  # the block after the hits is absent (or the end)
                return first + hits - nh
        keys = req.hasher.ensure_keys(max_blocks)
        assert self.storage is not None  # asked only with a storage tier
        ns = self.storage.lookup_prefix(keys[nh:max_blocks])
        req._storage_probe = (nh, max_blocks, ns, time.monotonic())
        return ns

    def match_prefix(self, req: CacheRequest) -> MatchResult:
        """Longest cached prefix of full blocks, leaving at least one token to compute."""
        bs = self.block_size
        max_blocks = (len(req.token_ids) - 1) // bs if req.token_ids else 0
        path: list[Node] = []
        nd = nh = ns = 0
        storage_keys: tuple[bytes, ...] = ()
        if self.enable_prefix_caching and max_blocks > 0 and not req.no_hits:
            path, nd, nh = self._tree_prefix(req, max_blocks)
            del path[nh:]
            if self.storage is not None and nh < max_blocks and req.prefetch is None:
                ns = self._storage_hits(req, nh, max_blocks)
                storage_keys = tuple(req.hasher.ensure_keys(max_blocks)[nh : nh + ns]) if ns else ()
        req._path, req._num_device_hits, req._num_host_hits = path, nd, nh - nd
        req._epoch = self.tree.epoch
        req.match = MatchResult(bs, nd, nh - nd, ns, storage_keys)
        return req.match

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

    # ---------------------------------------------------------- the collaborators' interface
    # What the prefetcher (prefetch.py) and the hand-off (handoff.py) use of the manager: they
    # stage copies into this step's plan, take blocks of a tier, tick the LRU clock, key a
    # request's blocks and copy a node down a tier or out to the pool. Nothing else of it.

    def stage(self, kind: str, *items: tuple) -> None:
        """Items of this step's ``kind`` op (load, backup, fetch, put, preload), as ``take_plan``
        reads them: one op per kind per step."""
        self._staged[kind].extend(items)

    def new_op(self, kind: str, items: list) -> int:
        """A new op id, its items pending until ``complete``."""
        op_id, self._next_op = self._next_op, self._next_op + 1
        self._pending[op_id] = (kind, items)
        return op_id

    def touch(self) -> int:
        """The next access tick (LRU order of the blocks used now)."""
        self._tick += 1
        return self._tick

    # ------------------------------------------------------------------ allocation
    def can_allocate(self, req: CacheRequest, num_tokens: int) -> bool:
        """Could ``allocate(req, num_tokens)`` succeed now? (an estimate; allocate decides)."""
        return self._blocks_needed(req, num_tokens) <= self._device_blocks_reclaimable()

    def wait_would_fit(self, req: CacheRequest, num_tokens: int) -> bool:
        """Would the device blocks that copies in flight free (:attr:`num_device_blocks_freeing`)
        let ``allocate(req, num_tokens)`` succeed once they land? (an upper bound). The scheduler
        waits for them only then; otherwise waiting cannot help, and it preempts at once."""
        freeing = self.num_device_blocks_freeing
        return freeing > 0 and self._blocks_needed(req, num_tokens) <= self._device_blocks_reclaimable() + freeing

    def _blocks_needed(self, req: CacheRequest, num_tokens: int) -> int:
        need = -(-num_tokens // self.block_size)
        if req.admitted:
            return need - len(req.block_table)
        need = max(need, len(req._path)) - req._num_device_hits
        return need + sum(1 for n in req._path[: req._num_device_hits] if n.lock_ref == 0)

    def _device_blocks_reclaimable(self) -> int:
        return self.device_pool.num_free + len(self._landed_twice) + self.tree.num_device_unlocked

    def allocate(self, req: CacheRequest, num_tokens: int) -> bool:
        """Grow ``req.block_table`` to cover ``num_tokens`` positions, evicting if needed.

        The first call admits the request with its last match: device hits are locked, host
        hits get request-owned device blocks and a planned load. False (and nothing changed)
        if the device tier cannot make room.
        """
        if req.freed:
            raise ValueError(f"request {req.rid!r} was freed")
        if self._landed_twice:
            self._return_landed_twice()
        need_total = -(-num_tokens // self.block_size)
        tree = self.tree
        if req.admitted:
            n_new = need_total - len(req.block_table)
            if n_new <= 0:
                return True
            blocks = self.take_device(n_new)
            if blocks is None:
                return False
            req.block_table.extend(blocks)
            return True

        if req.match is None or req._epoch != tree.epoch:  # no match yet, or a copy went away since
            self.match_prefix(req)
        nd, path = req._num_device_hits, req._path
        device_hits, host_hits = path[:nd], path[nd:]
        newly_locked = 0
        for n in device_hits:  # pin first, so our own eviction cannot take them
            if not n.lock_ref:
                newly_locked += 1
            n.lock_ref += 1
        tree.num_device_unlocked -= newly_locked
        for n in host_hits:
            n.host_reads += 1
        blocks = self.take_device(max(need_total, len(path)) - nd)
        if blocks is None:
            for n in device_hits:
                tree.unlock(n)
            for n in host_hits:
                n.host_reads -= 1
                tree.maybe_candidate(n)
            return False
        req.admitted = True
        req.nodes = device_hits  # a fresh slice of the path: ours
        req.block_table = [*map(_DEVICE_BLOCK, device_hits), *blocks]
        for j, n in enumerate(host_hits):
            self._staged["load"].append((req, nd + j, n, blocks[j]))
        req.num_loading = len(host_hits)
        if req.tail is not None:
            self.handoff.load_tail(req, blocks, nd)
        tick = self.touch()
        for n in path:
            n.last_access = tick
            n.hit_count += 1
        bs = self.block_size
        from_storage = preloaded = 0
        for n in host_hits:
            if n.from_storage:  # fetched for this request: a storage hit, counted once
                n.from_storage = False
                from_storage += 1
        pf = req.prefetch
        if pf is not None:
            pf.preload = False  # admitted: chunks still landing stay on host
            for n in device_hits:  # preloaded for it while it waited: host (or storage) hits
                if n.preloaded is not None:  # (another prefetch's: a device hit, the flag spent)
                    mine = n.preloaded is pf
                    n.preloaded = None
                    if not mine:
                        continue
                    preloaded += 1
                    if n.from_storage:
                        n.from_storage = False
                        from_storage += 1
        self.stats.hit_tokens["device"] += (nd - preloaded) * bs
        self.stats.hit_tokens["host"] += (len(host_hits) + preloaded - from_storage) * bs
        self.stats.hit_tokens["storage"] += from_storage * bs
        self.stats.query_tokens += len(req.token_ids)
        if self.has_host:
            for n in device_hits:
                if n.host_block is None and self.policy.copy_on_land(n.hit_count):
                    self.copy_down(n)
        return True

    def _return_landed_twice(self) -> None:
        self.device_pool.free(self._landed_twice)
        self._landed_twice = []

    def take_device(self, n: int) -> list[int] | None:
        pool = self.device_pool
        if n > pool.num_free:
            self._evict_device(n - pool.num_free)
            if n > pool.num_free:
                return None
        return pool.allocate(n)

    def take_host(self, n: int) -> list[int] | None:
        pool = self.host_pool
        if n > pool.num_free:
            self._evict_host(n - pool.num_free)
            if n > pool.num_free:
                return None
        return pool.allocate(n)

    # ------------------------------------------------------------------ eviction
    def reset_prefix_cache(self) -> dict[str, int]:
        """Drop every cached block that no request holds and no copy uses from the device and
        host tiers, as eviction does but without copying any down (vLLM's reset_prefix_cache,
        SGLang's flush_cache; the storage pool is untouched). Safe between any two steps: the
        blocks of running and waiting requests stay. Returns the blocks dropped per tier."""
        before = dict(self.stats.evictions)
        self._evict_device(self.device_pool.num_blocks, drop=True)
        if self.has_host:
            self._evict_host(self.host_pool.num_blocks, drop=True)
        return {tier: self.stats.evictions[tier] - before.get(tier, 0) for tier in ("device", "host")}

    def _evict_device(self, num_blocks: int, drop: bool = False) -> None:
        """Free ``num_blocks`` device blocks, least valuable first (``drop``: no copy down first,
        whatever the write policy)."""
        tree, pool, freed, deferred = self.tree, self.device_pool, 0, 0
        write_back = self.policy.copy_on_evict and self.has_host and not drop
        v = tree.pop_device_victim() if num_blocks > 0 else None
        while v is not None:
            if v.host_block is None:
                if write_back and self.backup(v):  # write_back: freed once the copy landed
                    v.evict_device_after_copy = True
                    deferred += 1  # counts toward the target: no over-eviction
                    v = tree.pop_device_victim() if freed + deferred < num_blocks else None
                    continue
                # the last copies: the nodes go too (write_back tries a backup of each first)
                v, blocks = tree.evict_device_run(v, 1 if write_back else num_blocks - freed - deferred)
                pool.free(blocks)
                freed += len(blocks)
                if freed + deferred < num_blocks:
                    v = tree.next_device_victim(v)
                else:
                    assert v.parent is not None  # an evicted node is never the root
                    tree.maybe_candidate(v.parent)
                    v = None
            else:
                pool.free_one(tree.drop_device(v))
                freed += 1
                v = tree.pop_device_victim() if freed + deferred < num_blocks else None
        self.stats.evictions["device"] += freed

    def _evict_host(self, num_blocks: int, drop: bool = False) -> None:
        tree, freed, deferred = self.tree, 0, 0
        while freed + deferred < num_blocks:
            v = tree.pop_host_victim()
            if v is None:
                return
            if (
                not drop
                and v.device_block is None
                and self.policy.copy_on_evict
                and self.storage is not None
                and not self.storage.contains(v.key)
            ):
                deferred += 1
                self.put_to_storage(v)  # write_back: freed once stored
                v.evict_host_after_copy = True
                continue
            self.host_pool.free_one(tree.drop_host(v))
            self.stats.evictions["host"] += 1
            freed += 1
            if v.device_block is None:
                tree.remove(v)

    # ------------------------------------------------------------------ copies down
    def backup(self, node: Node) -> bool:
        """Plan device->host copies of ``node`` and of its ancestors that lack a host copy
        (ancestors first, so the host tier stays a matchable prefix)."""
        chain = []
        n = node
        while not n.is_root and n.host_block is None:
            chain.append(n)
            assert n.parent is not None  # not the root
            n = n.parent
        top = n  # root, or the nearest ancestor with a host copy
        if not top.is_root:
            top.host_reads += 1  # our own host evictions must not take the copy we hang from
        try:
            for n in reversed(chain):
                got = self.take_host(1)
                if got is None:
                    return False
                self.tree.set_host(n, got[0], ready=False)
                n.device_reads += 1
                self._staged["backup"].append((n, n.device_block, got[0]))
            return True
        finally:
            if not top.is_root:
                top.host_reads -= 1
                self.tree.maybe_candidate(top)

    def copy_down(self, node: Node) -> None:
        """Copy-on-land backup of ``node``. If the host tier is full of blocks that copies in
        flight hold (puts to a slow pool), it is backed up when a copy completes, instead of never
        (write-through must not lose blocks to a burst); ancestors come along (``backup``)."""
        if not self.backup(node) and len(self._backup_backlog) < 65536:
            self._backup_backlog[id(node)] = node

    def _retry_backups(self) -> None:
        pending = list(self._backup_backlog.values())
        self._backup_backlog = {}
        for i, node in enumerate(pending):
            if node.host_block is not None or node.device_block is None or not self.tree.alive(node):
                continue  # copied meanwhile, or its device copy is gone
            if not self.backup(node):  # still full: keep it and the rest, in order
                self._backup_backlog = {id(n): n for n in pending[i:]}
                return

    def put_to_storage(self, node: Node) -> None:
        if self.storage is None or node.putting or self.storage.contains(node.key):
            return
        node.putting = True
        node.host_reads += 1
        self._staged["put"].append((node, node.host_block))

    # ------------------------------------------------------------------ commit / free
    def commit(self, req: CacheRequest, num_tokens: int) -> None:
        """Positions < ``num_tokens`` of ``req`` hold KV written by a finished forward: their
        full blocks become matchable device copies (duplicates of existing nodes are freed)."""
        if not self.enable_prefix_caching or req.num_loading or not req.admitted:
            return
        bs, tree = self.block_size, self.tree
        n_full = min(num_tokens // bs, len(req.block_table))
        i = len(req.nodes)
        if i >= n_full:
            return
        self._sync_labels(req, n_full * bs)
        h = req.hasher
        keys = h.ensure_keys(n_full)
        parent = req.nodes[-1] if req.nodes else tree.root
        tick = self.touch()
        copy_down = self.has_host
        table = req.block_table
        while i < n_full:  # blocks the tree has already (computed twice)
            node = tree.child(parent, h.label(i))
            if node is None:
                break
            tree.lock(node)
            if node.device_block is None:
                tree.set_device(node, table[i])
            elif node.device_block != table[i]:  # keep the tree's copy
                self.device_pool.free_one(table[i])
                table[i] = node.device_block
            node.last_access = tick
            req.nodes.append(node)
            if copy_down and node.host_block is None and self.policy.copy_on_land(node.hit_count):
                self.copy_down(node)
            parent = node
            i += 1
        if i == n_full:
            return
        # the rest is new: one run of nodes holding our device blocks, locked by us
        start = h.end(i - 1)
        ends = h.label_ends(i, n_full)
        new = tree.add_run(parent, keys[i:n_full], h.stream[start : start + ends[-1]], ends, h.uniform, table[i:n_full], tick)
        req.nodes.extend(new)
        if copy_down and self.policy.copy_on_land(1):
            for node in new:
                self.copy_down(node)

    def free(self, req: CacheRequest) -> None:
        """Finish, abort or preempt: unlock the request's nodes, return its own blocks.
        Blocks with a load still in flight are returned when that load completes."""
        if req.freed:
            raise ValueError(f"request {req.rid!r} freed twice")
        req.freed = True
        if self._landed_twice:
            self._return_landed_twice()
        if req.tail is not None:
            self.handoff.drop_tail(req)
        if not req.admitted:
            if req.prefetch is not None:
                req.prefetch.preload = False  # nobody waits for its chunks on the device now
            return
        tree, unlocked = self.tree, 0
        for node in reversed(req.nodes):  # tail first: it is the one that may become a leaf
            node.lock_ref -= 1
            if not node.lock_ref:
                unlocked += 1
                if not node.num_device_children and not node.in_device_heap:
                    tree.maybe_candidate(node)
        tree.num_device_unlocked += unlocked
        own = req.block_table[len(req.nodes) + req.num_loading :]
        if own:
            self.device_pool.free(own)
        del req.block_table[len(req.nodes) + req.num_loading :]
        req.nodes = []

    def swap_out(self, req: CacheRequest) -> int:
        """Preemption by swap: plan device->host copies of every block ``req`` committed that has
        no host copy (whatever the write policy), then :meth:`free` it. Returns the blocks planned.

        The blocks stay in the tree: when the request comes back, its prefix matches on device
        (if not evicted meanwhile) or on host, and is loaded instead of recomputed. Only the last,
        partial block is recomputed. A host tier too full to take them costs a recompute."""
        planned = 0
        if self.has_host and req.admitted and not req.freed:
            before = len(self._staged["backup"])
            for node in req.nodes:  # every one: an ancestor's earlier copy may have failed
                if node.host_block is None and not self.backup(node):
                    break  # host tier full: the rest is recomputed
            planned = len(self._staged["backup"]) - before
            self.stats.swapped_out_blocks += planned
        self.free(req)
        return planned

    @property
    def num_device_blocks_freeing(self) -> int:
        """Device blocks no request holds that become free or evictable once copies in flight
        land: backups of unlocked nodes (a swap out, write_back), and early loads (a preload's
        block becomes its node's unlocked device copy, or goes back to the pool). The scheduler
        waits for them instead of preempting a running request."""

        def unlocked_below(node: Node) -> bool:  # evictable leaf-first once its copy lands
            return node.lock_ref == 0 and all(
                unlocked_below(c) for c in self.tree.children_of(node) if c.device_block is not None
            )

        ops = (*self._pending.values(), ("backup", self._staged["backup"]), ("preload", self._staged["preload"]))
        return sum(
            len(items) if kind == "preload" else sum(1 for n, _d, _h in items if type(n) is not TailBlock and unlocked_below(n))
            for kind, items in ops
            if kind in ("backup", "preload")
        )

    # ================================================================== plans
    def take_plan(self) -> StepPlan:
        """This step's transfers, merged across requests (one op per direction)."""
        ops: dict[str, TransferOp] = {}
        fetches: list[TransferOp] = []
        for kind, items in self._staged.items():
            if not items:
                continue
            if kind == "fetch":
                fetches.extend(self.prefetcher.fetch_ops(items))
                self._staged[kind] = []
                continue
            op_id = self.new_op(kind, items)
            if kind == "load":
                src = tuple(n.host_block for _, _, n, _ in items)
                dst = tuple(b for _, _, _, b in items)
                keys = tuple(n.key for _, _, n, _ in items)
            elif kind == "preload":
                src = tuple(n.host_block for _, n, _ in items)
                dst = tuple(b for _, _, b in items)
                keys = tuple(n.key for _, n, _ in items)
            elif kind == "backup":
                src = tuple(d for _, d, _ in items)
                dst = tuple(h for _, _, h in items)
                keys = tuple(n.key for n, _, _ in items)
            else:
                src, dst = tuple(h for _, h in items), ()
                keys = tuple(n.key for n, _ in items)
            ops[kind] = TransferOp(op_id, kind, src, dst, keys)
            self._staged[kind] = []
        if self.handoff.tail_ops:
            fetches.extend(self.handoff.tail_ops)
            self.handoff.tail_ops = []
        return StepPlan(ops.get("load"), ops.get("backup"), tuple(fetches), ops.get("put"), ops.get("preload"))

    @property
    def num_pending_ops(self) -> int:
        return len(self._pending) + len(self.prefetcher.parked)

    def complete(self, op_id: int, failed: Collection[int] = ()) -> dict[object, int]:
        """Op ``op_id`` finished; items at indices in ``failed`` did not land.

        Returns ``{rid: num_valid_tokens}`` for requests whose loads failed: the scheduler must
        discard their step output and recompute from that many tokens.
        """
        entry = self._pending.get(op_id)
        if entry is None:
            raise ValueError(f"unknown or already completed op id {op_id!r}")
        kind, items = entry
        if kind == "backup":
            # Device->host copies land in plan order (one offload stream): a block's parent has
            # landed or failed before the block itself, which keeps host copies prefix-closed.
            oldest = next(i for i, (k, _) in self._pending.items() if k == "backup")
            if oldest != op_id:
                raise ValueError(f"backup op {op_id} completed before older backup op {oldest}")
        del self._pending[op_id]
        failed = frozenset(failed)
        bad = [i for i in failed if not (isinstance(i, int) and 0 <= i < len(items))]
        if bad:
            self._pending[op_id] = (kind, items)
            raise ValueError(f"failed item indices {bad} out of range for op {op_id} ({len(items)} items)")
        if failed:
            self.stats.failures[_STAT_KIND.get(kind, kind)] += len(failed)
            log.warning("%s op %d: %d of %d blocks failed; degrading to recompute", kind, op_id, len(failed), len(items))
        ok_blocks = len(items) - len(failed)
        self.stats.bytes_moved[_BYTES_KEY[kind]] += ok_blocks * self.block_nbytes
        rewinds = self._completers[kind](items, failed)
        # what any completion may unblock: fetched chunks waiting for a host copy or an earlier
        # chunk to land; backups waiting for host blocks that copies in flight held
        if self.prefetcher.parked:
            self.prefetcher.unpark()
        if self._backup_backlog:
            self._retry_backups()
        return rewinds

    def complete_plan(self, plan: StepPlan, failed: dict[str, Collection[int]] | None = None) -> dict[object, int]:
        """Complete every op of ``plan`` (``failed`` by kind); merged rewinds."""
        rewinds: dict[object, int] = {}
        for op in plan:
            rewinds.update(self.complete(op.op_id, (failed or {}).get(op.kind, ())))
        return rewinds

    def _complete_load(self, items: list, failed: frozenset[int]) -> dict[object, int]:
        tree = self.tree
        rewinds: dict[object, int] = {}
        for idx, (req, i, node, block) in enumerate(items):
            if type(node) is TailBlock:
                self.handoff.tail_loaded(req, node, block, idx not in failed, rewinds)
                continue
            node.host_reads -= 1
            tree.maybe_candidate(node)
            req.num_loading -= 1
            if req.freed:
                self.device_pool.free_one(block)
                continue
            if req.rid in rewinds or idx in failed:
                rewinds.setdefault(req.rid, i * self.block_size)
                self.stats.hit_tokens["host"] -= self.block_size  # recomputed: not a hit after all
                continue  # stays request-owned; recomputed
            assert i == len(req.nodes), "loads complete in path order"
            tree.lock(node)
            if node.device_block is None:
                tree.set_device(node, block)
            elif node.device_block != block:  # loaded twice: keep the tree's copy
                self._landed_twice.append(block)
                req.block_table[i] = node.device_block
            req.nodes.append(node)
        return rewinds

    def _complete_backup(self, items: list, failed: frozenset[int]) -> dict[object, int]:
        tree = self.tree
        for idx, (node, _dev, host) in enumerate(items):
            if type(node) is TailBlock:
                self.handoff.tail_backed_up(node, idx not in failed)
                continue
            node.device_reads -= 1
            parent = node.parent
            if idx in failed or not (parent.is_root or parent.host_ready):  # parent's copy failed
                if idx not in failed:
                    self.stats.failures["backup"] += 1
                self.host_pool.free_one(tree.drop_host(node))
                if id(node) in self.handoff.exporting:
                    self.handoff.node_done(node, False)
            else:
                tree.host_landed(node)
                self.prefetcher.anchor_landed(node)  # fetched blocks hang below: it stays
                if self.storage is not None and (self.policy.copy_on_land(node.hit_count) or id(node) in self.handoff.exporting):
                    self.put_to_storage(node)
            if node.evict_device_after_copy:
                node.evict_device_after_copy = False
                if node.host_ready and node.device_evictable():
                    self.device_pool.free_one(tree.drop_device(node))
                    self.stats.evictions["device"] += 1
            tree.maybe_candidate(node)
        return {}

    def _complete_put(self, items: list, failed: frozenset[int]) -> dict[object, int]:
        tree = self.tree
        for idx, (node, _host) in enumerate(items):
            if type(node) is TailBlock:
                self.handoff.tail_put(node, idx not in failed)
                continue
            node.putting = False
            node.host_reads -= 1
            if idx not in failed:
                assert self.storage is not None  # puts run only with a storage tier
                self.storage.add(node.key)
            if id(node) in self.handoff.exporting:
                self.handoff.node_done(node, idx not in failed)
            if node.evict_host_after_copy:
                # write_back: evicted once stored; if the put failed the host copy goes anyway
                # (the pool is only a cache; a dead pool must not freeze the host tier)
                node.evict_host_after_copy = False
                if node.host_evictable():
                    self.host_pool.free_one(tree.drop_host(node))
                    self.stats.evictions["host"] += 1
                    if node.device_block is None:
                        tree.remove(node)
                        continue
            tree.maybe_candidate(node)
        return {}

    # ================================================================== checks
    def assert_invariants(self, requests: Sequence[CacheRequest] = ()) -> None:
        """DESIGN §5 (1, 2, 3, 4, 6) on the whole state (cache/invariants.py). ``requests``:
        every live request."""
        from kvtier.cache.invariants import check

        check(self, requests)

    # ---------------------------------------------------------- read-only views (the checker's)
    def copies_in_flight(self) -> list[tuple[str, list]]:
        """Every copy planned and not completed, as ``(kind, items)``: the ops in flight, this
        step's staged items, and the fetched chunks parked until their turn."""
        return [*self._pending.values(), *self._staged.items(), *(("fetch", items) for items, _failed in self.prefetcher.parked)]

    @property
    def landed_twice(self) -> tuple[int, ...]:
        """Device blocks of loads that landed twice, held out of the pool until the next allocate."""
        return tuple(self._landed_twice)


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
