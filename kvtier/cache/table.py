"""BlockTable: which block of which request lives on which tier (match, allocate, commit, free, evict).

The scheduler's vocabulary, as far as blocks go (one request ``r``, a :class:`CacheRequest` from
:meth:`BlockTable.new_request`)::

    start_lookup(r)            at arrival: the pool's lookup of r's blocks, on a storage thread
    match_prefix(r)            longest cached prefix: device hits, then host hits, then storage hits
    can_allocate(r, n) / allocate(r, n)
                               block table covers n tokens; the first call admits r: pins its
                               device hits and has the mover load its host hits
    commit(r, n)               the forward wrote KV of positions < n: full blocks join the tree
    free(r)                    finish / abort / preempt: unpin, return r's own blocks
    take_device(n) / take_host(n)  free blocks of a tier, evicting the least valuable first

A request's block table, after admission and a few steps::

    block_table = [ d0 d1 d2 | l3 l4 | n5 n6 n7 ]
                   ^ tree-owned (r.nodes, locked)   device hits, then committed blocks
                              ^ request-owned, loading from host (become tree-owned on success)
                                      ^ request-owned, computed by r (committed once full)

Ownership (DESIGN §5.1): every device block is free, or held by exactly one tree node, or by
exactly one request (``block_table[len(nodes):]``); every host block is free, held by one node,
or by one in-flight fetch. Copies between tiers are the mover's (cache/mover.py): see :class:`Copies`.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from typing import Protocol, Sequence

from kvtier.cache.events import KVEvents
from kvtier.cache.keys import BlockHasher, MMItem, ModelFingerprint, namespace_seed
from kvtier.cache.plan import MatchResult
from kvtier.cache.policy import WritePolicy, get_eviction_key
from kvtier.cache.pool import BlockPool
from kvtier.cache.probe import lookup_async, storage_hits
from kvtier.cache.records import CacheRequest, CacheStats, check_block_size
from kvtier.cache.sliding import DevicePool, SlidingGroup
from kvtier.cache.storage_index import StorageIndex
from kvtier.cache.tree import Node, RadixTree

_DEVICE_BLOCK = operator.attrgetter("device_block")
MAX_SEEDS = 1024  # namespace seeds kept (one per cache_salt, least recently used dropped)


class Copies(Protocol):
    """What the block table asks of the mover (cache/mover.py)."""

    def backup(self, node: Node) -> bool: ...  # device -> host copies of node (and ancestors)
    def copy_down(self, node: Node) -> None: ...  # a copy-on-land backup (retried when full)
    def put_to_storage(self, node: Node) -> None: ...  # host -> storage
    def load(self, req: CacheRequest, first: int, nodes: list[Node], blocks: list[int]) -> None: ...
    def drop_tail(self, req: CacheRequest) -> None: ...  # a hand-off's partial block, at free


class BlockTable:
    """The tiers' blocks, the radix tree over them and each request's block table (module
    docstring). ``copies`` is the mover, set once both exist (cache/manager.py)."""

    copies: Copies

    def __init__(
        self,
        block_size: int,
        num_device_blocks: int,
        num_host_blocks: int,
        storage: StorageIndex | None,
        write_policy: str,
        write_through_threshold: int,
        eviction: str,
        hash_name: str,
        fingerprint: ModelFingerprint | None,
        enable_prefix_caching: bool,
        sliding: Sequence[tuple[int, int]] = (),
    ) -> None:
        self.block_size = check_block_size(block_size)
        # per sliding group (window, slots): its blocks of its own (cache/sliding.py); device tier only
        self.sliding = [SlidingGroup(w, block_size, n, num_device_blocks) for w, n in sliding]
        if self.sliding and (num_host_blocks or storage is not None):
            raise ValueError(
                f"sliding-window groups with blocks of their own are kept on the device tier only "
                f"(num_host_blocks={num_host_blocks}, storage={storage!r}): keep every block instead"
            )
        self.device_pool = DevicePool(num_device_blocks, self.sliding) if self.sliding else BlockPool(num_device_blocks, "device")
        self.host_pool = BlockPool(num_host_blocks, "host")
        self.storage = storage
        self.policy = WritePolicy(write_policy, write_through_threshold)
        self.tree = RadixTree(get_eviction_key(eviction))
        self.events = self.tree.events = KVEvents()  # off until a router asks (cache/events.py)
        self.hash_name = hash_name
        namespace_seed(None, None, hash_name)  # validates hash_name early
        self.fingerprint = fingerprint
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = CacheStats()
        # namespace seed per cache_salt, most recent last: salts are chosen by clients, so it is
        # bounded (an evicted salt's seed is just computed again, to the same bytes)
        self.seeds: OrderedDict[str | None, bytes] = OrderedDict()
        self._tick = 0
        # device blocks of loads that landed twice (the tree had a copy by then): a step queued may still read
        # them, so they go back to the pool only at the next allocate or free, never to a preload staged meanwhile
        self._landed_twice: list[int] = []

    @property
    def has_host(self) -> bool:
        return self.host_pool.num_blocks > 0

    @property
    def landed_twice(self) -> tuple[int, ...]:
        """Device blocks of loads that landed twice, held out of the pool until the next allocate."""
        return tuple(self._landed_twice)

    def free_later(self, block: int) -> None:
        """A device block a queued step may still read (a load landed twice): freed at the next allocate or free."""
        self._landed_twice.append(block)

    def touch(self) -> int:
        """The next access tick (LRU order of the blocks used now)."""
        self._tick += 1
        return self._tick

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
        seed = self.seeds.get(cache_salt)
        if seed is None:
            seed = self.seeds[cache_salt] = namespace_seed(self.fingerprint, cache_salt, self.hash_name)
            if len(self.seeds) > MAX_SEEDS:
                self.seeds.popitem(last=False)
        else:
            self.seeds.move_to_end(cache_salt)
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

    def _longest_sliding_hit(self, device_blocks: list[int]) -> int:
        """The longest prefix of ``device_blocks`` every sliding group has its window for."""
        k = len(device_blocks)
        while True:
            shortest = min(g.longest_hit(device_blocks, k) for g in self.sliding)
            if shortest == k:
                return k
            k = shortest

    def start_lookup(self, req: CacheRequest) -> None:
        """At arrival: ask the pool, on the storage client's lookup thread, for the blocks past
        what device and host hold now, so that :meth:`match_prefix` finds the answer ready when
        the request is scheduled (cache/probe.py)."""
        max_blocks = (len(req.token_ids) - 1) // self.block_size if req.token_ids else 0
        if not hasattr(self.storage, "lookup_prefix_async") or not self.enable_prefix_caching or req.no_hits or max_blocks <= 0:
            return
        lookup_async(self.storage, req, self._tree_prefix(req, max_blocks)[2], max_blocks)

    def match_prefix(self, req: CacheRequest) -> MatchResult:
        """Longest cached prefix of full blocks, leaving at least one token to compute."""
        bs = self.block_size
        max_blocks = (len(req.token_ids) - 1) // bs if req.token_ids else 0
        path: list[Node] = []
        nd = nh = ns = 0
        storage_keys: tuple[bytes, ...] = ()
        if self.enable_prefix_caching and max_blocks > 0 and not req.no_hits:
            path, nd, nh = self._tree_prefix(req, max_blocks)
            if self.sliding:  # (no host tier here) the longest hit every group has its window for
                nd = nh = self._longest_sliding_hit([n.device_block for n in path[:nd]])  # type: ignore[misc]  # device hits have device blocks
            del path[nh:]
            if self.storage is not None and nh < max_blocks and req.prefetch is None:
                ns = storage_hits(self.storage, req, nh, max_blocks)
                storage_keys = tuple(req.hasher.ensure_keys(max_blocks)[nh : nh + ns]) if ns else ()
        req.match_path, req.num_device_hits, req.num_host_hits = path, nd, nh - nd
        req.match_epoch = self.tree.epoch
        req.match = MatchResult(bs, nd, nh - nd, ns, storage_keys)
        return req.match

    # ------------------------------------------------------------------ allocation
    def can_allocate(self, req: CacheRequest, num_tokens: int) -> bool:
        """Could ``allocate(req, num_tokens)`` succeed now? (an estimate; allocate decides)."""
        return self._blocks_needed(req, num_tokens) <= self._device_blocks_reclaimable()

    def would_fit(self, req: CacheRequest, num_tokens: int, freeing: int) -> bool:
        """Would ``allocate(req, num_tokens)`` succeed once ``freeing`` more device blocks were
        reclaimable? (an upper bound; the manager's ``wait_would_fit``)"""
        return freeing > 0 and self._blocks_needed(req, num_tokens) <= self._device_blocks_reclaimable() + freeing

    def _blocks_needed(self, req: CacheRequest, num_tokens: int) -> int:
        need = -(-num_tokens // self.block_size)
        if req.admitted:
            return need - len(req.block_table)
        need = max(need, len(req.match_path)) - req.num_device_hits
        return need + sum(1 for n in req.match_path[: req.num_device_hits] if n.lock_ref == 0)

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
            if self.sliding and not self._hold_all([blocks] * len(self.sliding)):
                self.device_pool.free(blocks)
                return False
            req.block_table.extend(blocks)
            return True

        if req.match is None or req.match_epoch != tree.epoch:  # no match yet, or a copy went away since
            self.match_prefix(req)
        nd, path = req.num_device_hits, req.match_path
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
        if blocks is not None and self.sliding and not self._hold_sliding(req, [*map(_DEVICE_BLOCK, device_hits), *blocks], nd):
            self.device_pool.free(blocks)
            blocks = None
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
        req.num_loading = len(host_hits)
        self.copies.load(req, nd, host_hits, blocks)  # and a hand-off's partial block
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
                    self.copies.copy_down(n)
        return True

    def _hold_sliding(self, req: CacheRequest, table: list[int], num_hits: int) -> bool:
        """At admission: ``req`` holds, in every sliding group, the slots of ``table`` (its device
        hits then its new blocks) from the first block its first query reads."""
        firsts = [g.first_needed(num_hits * self.block_size) for g in self.sliding]
        if not self._hold_all([table[f:] for f in firsts]):
            return False
        req.sliding_first = firsts
        return True

    def _hold_all(self, parts: list[list[int]]) -> bool:
        """Sliding group i holds the slots of ``parts[i]``; False, with nothing held, if a group
        has too few slots."""
        for i, (g, blocks) in enumerate(zip(self.sliding, parts)):
            if not g.hold(blocks):
                for done, held in zip(self.sliding[:i], parts):
                    done.release(held)
                return False
        return True

    def _return_landed_twice(self) -> None:
        self.device_pool.free(self._landed_twice)
        self._landed_twice = []

    def take_device(self, n: int) -> list[int] | None:
        pool = self.device_pool
        if n > pool.num_free:
            self.evict_device(n - pool.num_free)
            if n > pool.num_free:
                return None
        return pool.allocate(n)

    def take_host(self, n: int) -> list[int] | None:
        pool = self.host_pool
        if n > pool.num_free:
            self.evict_host(n - pool.num_free)
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
        self.evict_device(self.device_pool.num_blocks, drop=True)
        if self.has_host:
            self.evict_host(self.host_pool.num_blocks, drop=True)
        return {tier: self.stats.evictions[tier] - before.get(tier, 0) for tier in ("device", "host")}

    def evict_device(self, num_blocks: int, drop: bool = False) -> None:
        """Free ``num_blocks`` device blocks, least valuable first (``drop``: no copy down first,
        whatever the write policy)."""
        tree, pool, freed, deferred = self.tree, self.device_pool, 0, 0
        write_back = self.policy.copy_on_evict and self.has_host and not drop
        v = tree.pop_device_victim() if num_blocks > 0 else None
        while v is not None:
            if v.host_block is None:
                if write_back and self.copies.backup(v):  # write_back: freed once the copy landed
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

    def evict_host(self, num_blocks: int, drop: bool = False) -> None:
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
                self.copies.put_to_storage(v)  # write_back: freed once stored
                v.evict_host_after_copy = True
                continue
            self.host_pool.free_one(tree.drop_host(v))
            self.stats.evictions["host"] += 1
            freed += 1
            if v.device_block is None:
                tree.remove(v)

    # ------------------------------------------------------------------ commit / free
    def commit(self, req: CacheRequest, num_tokens: int) -> None:
        """Positions < ``num_tokens`` of ``req`` hold KV written by a finished forward: their
        full blocks become matchable device copies (duplicates of existing nodes are freed).
        Sliding groups then let go of the blocks no later query of ``req`` reads."""
        self._commit_nodes(req, num_tokens)
        if self.sliding and req.admitted and not req.freed:
            self._advance_sliding(req, num_tokens)

    def _commit_nodes(self, req: CacheRequest, num_tokens: int) -> None:
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
                for g, first in zip(self.sliding, req.sliding_first):
                    if i >= first:
                        g.replace(table[i], node.device_block)
                self.device_pool.free_one(table[i])
                table[i] = node.device_block
            node.last_access = tick
            req.nodes.append(node)
            if copy_down and node.host_block is None and self.policy.copy_on_land(node.hit_count):
                self.copies.copy_down(node)
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
                self.copies.copy_down(node)

    def _advance_sliding(self, req: CacheRequest, num_tokens: int) -> None:
        """Positions < ``num_tokens`` are computed: release the blocks before each group's window."""
        table = req.block_table
        for i, g in enumerate(self.sliding):
            first, new = req.sliding_first[i], min(g.first_needed(num_tokens), len(table))
            if new > first:  # committed blocks keep their slots until the group needs them (retained)
                g.release(table[first:new], keep=table[first : min(new, len(req.nodes))])
                req.sliding_first[i] = new

    def free(self, req: CacheRequest) -> None:
        """Finish, abort or preempt: unlock the request's nodes, return its own blocks.
        Blocks with a load still in flight are returned when that load completes."""
        if req.freed:
            raise ValueError(f"request {req.rid!r} freed twice")
        req.freed = True
        if self._landed_twice:
            self._return_landed_twice()
        if req.tail is not None:
            self.copies.drop_tail(req)
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
        if self.sliding:  # the last window's committed blocks keep their slots for later hits
            table, n_nodes = req.block_table, len(req.nodes)
            for g, first in zip(self.sliding, req.sliding_first):
                g.release(table[first:], keep=table[first:n_nodes])
            req.sliding_first = []
        own = req.block_table[len(req.nodes) + req.num_loading :]
        if own:
            self.device_pool.free(own)
        del req.block_table[len(req.nodes) + req.num_loading :]
        req.nodes = []
