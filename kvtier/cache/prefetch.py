"""Storage -> host prefetch: the CacheManager's collaborator that brings storage hits up.

::

    prefetch(r)          decide (cost model) how many leading storage hits to fetch; reserve host
                         blocks; stage them as fetch ops of ``fetch_chunk`` blocks (``fetch_ops``)
    complete(items)      a chunk landed: parked until it can land in order, then ``_land`` hangs
                         its blocks below the block before the chunk
    pending(r)           blocks still on their way for r (its own and those it waits for),
                         preloads included
    _preload(pf, nodes)  early loads: host -> device copies of r's host hits (at once) and of each
                         chunk as it lands, into blocks the op holds; ``complete_preload`` makes
                         them the nodes' device copies (prefix-closed), so r starts with device hits

Its state is its own (which prefetch fetches which key, chunks parked, prefetches waiting for an
anchor's host copy, and its settings: the cost model, the chunk size, early loads); what it uses of
the cache is :class:`PrefetchHost`, which the manager (cache/manager.py) provides: the tree, the
pools, ``take_host`` / ``take_device``, ``backup`` of an anchor, ``stage`` and ``new_op`` of fetches
and preloads, and ``touch``. The mover (cache/mover.py) hands it the completions of its copies.

A prefetch holds the node its blocks hang from (the *anchor*: a lock while the anchor's own host
copy is in flight, then a host pin) until its last chunk completed. Blocks another prefetch is
already fetching are not fetched twice: the follower waits for them (``waits_for``) and hangs its
own chunks below them. Chunks land in order: one that completes early is parked
(``_parked``); if the block it hangs from is gone or failed, it is dropped (a miss, blocks freed).
"""

from __future__ import annotations

from typing import Protocol

from kvtier.cache.cost import FetchCostModel
from kvtier.cache.plan import CopyKind, TransferOp
from kvtier.cache.pool import BlockPool
from kvtier.cache.records import CacheRequest, Prefetch
from kvtier.cache.tree import Node, RadixTree


class PrefetchHost(Protocol):
    """What the prefetcher uses of the cache (the manager provides it)."""

    @property
    def block_size(self) -> int: ...
    @property
    def has_host(self) -> bool: ...
    @property
    def tree(self) -> RadixTree: ...
    @property
    def device_pool(self) -> BlockPool: ...
    @property
    def host_pool(self) -> BlockPool: ...
    def take_host(self, n: int) -> list[int] | None: ...
    def take_device(self, n: int) -> list[int] | None: ...
    def backup(self, node: Node) -> bool: ...
    def stage(self, kind: CopyKind, *items: tuple) -> None: ...
    def new_op(self, kind: CopyKind, items: list) -> int: ...
    def touch(self) -> int: ...


class Prefetcher:
    """The cache's storage->host prefetches (module docstring)."""

    def __init__(self, mgr: PrefetchHost, fetch_cost: FetchCostModel | None, fetch_chunk: int, early_loads: bool) -> None:
        self.m = mgr
        self.fetch_cost = fetch_cost  # None: fetch every storage hit (storage_fetch="always")
        if fetch_chunk < 1:
            raise ValueError(f"fetch_chunk_blocks must be >= 1, got {fetch_chunk}")
        self.fetch_chunk = fetch_chunk
        self.early_loads = early_loads  # prefetched blocks go on to the device as they land
        self.parked: list[list] = []  # chunks landed before they can hang
        self.anchored: dict[int, list[Prefetch]] = {}  # prefetches below a host copy in flight
        self.fetching: dict[bytes, Prefetch] = {}  # block key -> the prefetch fetching it
        self.preloading: dict[int, Node] = {}  # id(node) -> node, its preload in flight

    def prefetch(self, req: CacheRequest) -> int:
        """Plan storage->host fetches of ``req``'s storage hits (after ``match_prefix``); the
        number of blocks that will land for it. Leading blocks another request's prefetch is
        already fetching are not fetched twice: this one waits for them, and its own chunks hang
        below them (parked until they landed)."""
        mgr, m = self.m, req.match
        if m is None or not m.num_storage_blocks or not mgr.has_host or req.admitted or req.prefetch:
            return 0
        want = m.num_storage_blocks
        if self.fetch_cost is not None:
            want = self.fetch_cost.blocks_to_fetch(want)
            if not want:
                return 0
        covered = 0  # leading blocks someone else is fetching
        while covered < want and m.storage_keys[covered] in self.fetching:
            covered += 1
        others = list({id(pf): pf for pf in (self.fetching[k] for k in m.storage_keys[:covered])}.values())
        anchor = req.matched[-1] if req.matched else mgr.tree.root
        if covered == want:  # all of it is on its way already
            return self._wait_for(req, anchor, others, covered)
        if covered == 0 and not anchor.is_root and anchor.host_block is None and not mgr.backup(anchor):
            return 0  # fetched blocks hang below a host copy (host tier prefix-closed)
        # hold the anchor: its landed host copy with a host pin (so our own host evictions below
        # cannot take it), else its device copy with a lock (its host copy is still in flight)
        pf = Prefetch(anchor, not anchor.host_ready)
        self.hold(pf, +1)  # the node the fetched blocks will hang from stays
        blocks: list[int] = []
        for _ in m.storage_keys[covered:want]:
            got = mgr.take_host(1)
            if got is None:
                break
            blocks.append(got[0])
        if not blocks:
            self.hold(pf, -1)
            return self._wait_for(req, anchor, others, covered) if covered else 0
        keys = m.storage_keys[: covered + len(blocks)]
        first = len(req.matched)  # storage hits follow the device and host hits
        labels = [req.hasher.label(j) for j in range(first, first + len(keys))]
        pf.keys = keys
        pf.uniform = req.hasher.uniform
        pf.start = pf.next_index = covered  # chunk 0 hangs below keys[covered - 1] (or the anchor)
        pf.waits_for = others
        pf.num_blocks_pending = len(blocks)
        pf.num_chunks_pending = -(-len(blocks) // self.fetch_chunk)
        for i in range(covered, len(keys)):
            mgr.stage(CopyKind.FETCH, (pf, i, keys[i], blocks[i - covered], labels[i]))
            self.fetching[keys[i]] = pf
        req.prefetch = pf
        req.match = None  # the next match sees the fetched blocks as host hits
        if self.early_loads and -(-len(req.token_ids) // mgr.block_size) <= (
            mgr.device_pool.num_free + mgr.tree.num_device_unlocked
        ):
            pf.preload = True  # the whole request fits on the device: bring it up as it lands
            tick = mgr.touch()
            for node in req.matched:  # (LRU) the preloads' evictions take other blocks first
                node.last_access = tick
            self._preload(pf, req.matched[m.num_device_blocks :])  # its host hits, now
        return len(keys)

    def _wait_for(self, req: CacheRequest, anchor: Node, others: list[Prefetch], covered: int) -> int:
        """``req`` fetches nothing itself: it waits for the ``covered`` blocks others fetch."""
        pf = Prefetch(anchor, False)
        pf.host_pinned = False  # holds nothing: it has no chunk of its own
        pf.waits_for = others
        req.prefetch = pf
        req.match = None
        return covered

    @staticmethod
    def pending(req: CacheRequest) -> int:
        """Blocks of ``req``'s storage prefetch not landed (or failed) yet, its own and those
        of the prefetches it waits for."""
        pf = req.prefetch
        if pf is None:
            return 0
        return pf.num_blocks_pending + pf.num_preloading + sum(o.num_blocks_pending + o.num_preloading for o in pf.waits_for)

    def hold(self, pf: Prefetch, delta: int) -> None:
        node = pf.anchor
        if node.is_root:
            return
        if delta > 0:
            if pf.locked:
                self.m.tree.lock(node)
                self.anchored.setdefault(id(node), []).append(pf)
            else:
                node.host_reads += 1
            return
        if pf.locked:
            self.m.tree.unlock(node)
            waiting = self.anchored.get(id(node))
            if waiting is not None and pf in waiting:
                waiting.remove(pf)
                if not waiting:
                    del self.anchored[id(node)]
        if pf.host_pinned:
            node.host_reads -= 1
        self.m.tree.maybe_candidate(node)

    def anchor_landed(self, node: Node) -> None:
        """``node``'s host copy landed: prefetches whose blocks hang below it keep it with a host
        pin from now on (its device copy may go)."""
        for pf in self.anchored.pop(id(node), ()):
            pf.host_pinned = True
            node.host_reads += 1

    def fetch_ops(self, items: list) -> list[TransferOp]:
        """One op per chunk of ``fetch_chunk`` blocks of one prefetch (items are staged in order)."""
        ops: list[TransferOp] = []
        chunk: list = []
        for it in items:
            if chunk and (it[0] is not chunk[0][0] or (it[1] - it[0].start) % self.fetch_chunk == 0):
                ops.append(self._fetch_op(chunk))
                chunk = []
            chunk.append(it)
        if chunk:
            ops.append(self._fetch_op(chunk))
        return ops

    def _fetch_op(self, chunk: list) -> TransferOp:
        op_id = self.m.new_op(CopyKind.FETCH, chunk)
        return TransferOp(op_id, CopyKind.FETCH.label, (), tuple(it[3] for it in chunk), tuple(it[2] for it in chunk))

    def complete(self, items: list, failed: frozenset[int]) -> dict[object, int]:
        """A chunk of one prefetch landed: its blocks become host copies below the block before
        the chunk (the prefetch's anchor for the first chunk). Chunks land in order: one that
        completes before an earlier chunk of its prefetch, or while the anchor's own host copy is
        still in flight (its backup was planned with the prefetch), stays parked until then
        (the manager calls :meth:`unpark` after every completion). If the block it hangs from is
        gone or failed, the chunk is dropped (a miss)."""
        self.parked.append([items, failed])
        return {}

    def _fetch_parent(self, items: list) -> tuple[bool, Node | None]:
        """(ready to land, the node the chunk hangs from or None if gone)."""
        pf, first = items[0][0], items[0][1]
        if first != pf.next_index:
            return False, None  # an earlier chunk has not landed yet
        parent = pf.anchor if first == 0 else self.m.tree.nodes.get(pf.keys[first - 1])
        if parent is None and first > 0 and self.fetching.get(pf.keys[first - 1]) not in (None, pf):
            return False, None  # another request's prefetch is fetching it
        if (
            parent is not None
            and not parent.is_root
            and self.m.tree.alive(parent)
            and parent.host_block is not None
            and not parent.host_ready
            and parent.device_reads
        ):
            return False, parent  # its host copy is still being written
        return True, parent

    def unpark(self) -> None:
        progress = True
        while progress and self.parked:
            progress = False
            for entry in list(self.parked):
                ready, parent = self._fetch_parent(entry[0])
                if ready:
                    self.parked.remove(entry)
                    self._land(entry[0], entry[1], parent)
                    progress = True

    def _land(self, items: list, failed: frozenset[int], parent: Node | None) -> None:
        tree = self.m.tree
        pf = items[0][0]
        tick = self.m.touch()
        broken = False
        landed: list[Node] = []
        for idx, (_pf, _i, key, block, label) in enumerate(items):
            if self.fetching.get(key) is pf:
                del self.fetching[key]
            if broken or idx in failed or parent is None or not (parent.is_root or (tree.alive(parent) and parent.host_ready)):
                broken = True
                self.m.host_pool.free_one(block)
                continue
            node = tree.child(parent, label)
            if node is None:
                (node,) = tree.add_run(parent, (key,), label, (len(label),), pf.uniform)
            if node.host_block is None:
                node.last_access = tick
                tree.set_host(node, block, ready=True)
                node.from_storage = True  # its first host hit counts as a storage hit
            else:
                self.m.host_pool.free_one(block)
            tree.maybe_candidate(node)
            landed.append(node)
            parent = node
        if pf.preload and landed:
            self._preload(pf, landed)
        pf.next_index = items[-1][1] + 1
        pf.num_blocks_pending -= len(items)
        pf.num_chunks_pending -= 1
        if not pf.num_chunks_pending:
            self.hold(pf, -1)

    # ------------------------------------------------------------------ early loads
    def _preload(self, pf: Prefetch, nodes: list[Node]) -> None:
        """Plan host->device copies of ``nodes`` (a run along one path, in path order) into device
        blocks the op holds until it lands; then they become the nodes' device copies
        (:meth:`complete_preload`), so the waiting request is admitted with device hits instead of
        loading everything after the last chunk landed. Device copies are prefix-closed: the run
        stops at the first node whose parent has no device copy, landed or on its way. No room
        on the device: nothing more of ``pf`` is preloaded (it loads at admission, as before)."""
        tree, todo = self.m.tree, []
        for node in nodes:
            if node.device_block is not None or id(node) in self.preloading:
                continue  # on the device already, or on its way
            parent = node.parent
            assert parent is not None
            if not node.host_ready or not (parent.is_root or parent.device_block is not None or id(parent) in self.preloading):
                break
            todo.append(node)
            self.preloading[id(node)] = node
            node.host_reads += 1  # its host copy stays while the copy reads it
        if not todo:
            return
        blocks = self.m.take_device(len(todo))
        if blocks is None:
            pf.preload = False
            for node in todo:
                del self.preloading[id(node)]
                node.host_reads -= 1
                tree.maybe_candidate(node)
            return
        pf.num_preloading += len(todo)
        self.m.stage(CopyKind.PRELOAD, *zip([pf] * len(todo), todo, blocks))

    def complete_preload(self, items: list, failed: frozenset[int]) -> dict[object, int]:
        """Preloads landed: each becomes its node's device copy (unlocked, most recently used),
        unless it failed, the node got a device copy meanwhile (a load or a commit), or its
        parent has none (its own preload failed, or it was evicted): then the block goes back."""
        tree, pool = self.m.tree, self.m.device_pool
        tick = self.m.touch()
        for idx, (pf, node, block) in enumerate(items):
            del self.preloading[id(node)]
            node.host_reads -= 1
            pf.num_preloading -= 1
            parent = node.parent
            if (
                idx in failed
                or node.device_block is not None
                or not tree.alive(node)
                or not (parent.is_root or parent.device_block is not None)
            ):
                pool.free_one(block)
            else:
                node.last_access = tick
                tree.set_device(node, block)
                node.preloaded = pf  # a host hit of pf's request if it is admitted on it
            tree.maybe_candidate(node)
        return {}
