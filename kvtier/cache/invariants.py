"""The cache manager's invariants (DESIGN §5: 1, 2, 3, 4, 6), checked on its whole state.

Cheap enough to run after every step in tests (``CacheManager.assert_invariants``, which the
state machine of tests/cache/test_state_machine.py calls after every operation of its random
programs): every block of each tier has exactly one owner (a node, a request, a copy in flight,
a prefetch, a hand-off) or is free; device and landed host copies are prefix-closed; lock and
pin counts equal their holders; every eviction candidate is queued. It reads the manager through
its public views (:class:`Checked`: ``tree``, the pools, ``copies_in_flight()``, ``landed_twice``,
the prefetcher's and the hand-off's own state) and changes nothing.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from kvtier.cache.handoff import Handoff
from kvtier.cache.plan import CopyKind
from kvtier.cache.pool import BlockPool
from kvtier.cache.prefetch import Prefetcher
from kvtier.cache.records import CacheRequest, TailBlock
from kvtier.cache.sliding import SlidingGroup
from kvtier.cache.tree import RadixTree


class Checked(Protocol):
    """What the checker reads of the cache (the manager provides it)."""

    @property
    def tree(self) -> RadixTree: ...
    @property
    def device_pool(self) -> BlockPool: ...
    @property
    def host_pool(self) -> BlockPool: ...
    @property
    def prefetcher(self) -> Prefetcher: ...
    @property
    def handoff(self) -> Handoff: ...
    @property
    def landed_twice(self) -> tuple[int, ...]: ...
    @property
    def sliding_groups(self) -> Sequence[SlidingGroup]: ...
    def copies_in_flight(self) -> list[tuple[CopyKind, list]]: ...


def check(m: Checked, requests: Sequence[CacheRequest] = ()) -> None:
    """AssertionError naming the first broken invariant. ``requests``: every live request."""
    tree = m.tree
    dev_owner: dict[int, object] = {}
    host_owner: dict[int, object] = {}
    locks: dict[int, int] = {}
    tree.check()
    for node in tree.nodes.values():
        assert tree.nodes[node.key] is node and node.parent is not None
        assert tree.child(node.parent, tree.label(node)) is node, "child link"
        assert node.parent.is_root or tree.alive(node.parent), "orphan node"
        assert node.device_block is not None or node.host_block is not None, f"empty {node}"
        if node.host_ready:
            assert node.parent.is_root or node.parent.host_ready, f"host copies not prefix-closed at {node}"
        if node.device_block is not None:
            assert node.parent.is_root or node.parent.device_block is not None, f"device copies not prefix-closed at {node}"
            assert node.device_block not in dev_owner, f"device block {node.device_block} owned twice"
            dev_owner[node.device_block] = node
        if node.host_block is not None:
            assert node.host_block not in host_owner, f"host block {node.host_block} owned twice"
            host_owner[node.host_block] = node
        children = tree.children_of(node)
        assert node.num_device_children == sum(c.device_block is not None for c in children), f"device children {node}"
        assert node.num_host_children == sum(c.host_block is not None for c in children), f"host children {node}"
        assert node.lock_ref >= 0 and node.device_reads >= 0 and node.host_reads >= 0
        # every candidate is queued (else it would never be evicted)
        assert node.in_device_heap or not node.device_evictable(), f"{node} missing from the device heap"
        assert node.in_host_heap or not node.host_evictable(), f"{node} missing from the host heap"
    assert tree.root.num_device_children == sum(c.device_block is not None for c in tree.children_of(tree.root))
    live = [r for r in requests if not r.freed]
    for r in live:
        if not r.admitted:
            continue
        for i, n in enumerate(r.nodes):
            assert tree.alive(n), f"request {r.rid!r} holds a dead node"
            assert r.block_table[i] == n.device_block, f"request {r.rid!r} table/node mismatch at {i}"
            locks[id(n)] = locks.get(id(n), 0) + 1
        for b in r.block_table[len(r.nodes) :]:
            assert b not in dev_owner, f"device block {b} owned by a node and request {r.rid!r}"
            dev_owner[b] = r
    # in-flight reads and writes
    dev_reads: dict[int, int] = {}
    host_reads: dict[int, int] = {}
    in_flight = m.copies_in_flight()

    def tail_owns(t: TailBlock) -> None:
        assert t.host_block is not None, f"tail {t.key} in flight without a host block"
        assert t.host_block not in host_owner, f"host block {t.host_block} owned twice"
        host_owner[t.host_block] = t

    for kind, items in in_flight:
        if kind is CopyKind.TAILFETCH:
            tail_owns(items[0])
            continue
        at = 2 if kind is CopyKind.LOAD else 0  # where an item holds its node (or TailBlock)
        if kind in (CopyKind.LOAD, CopyKind.BACKUP, CopyKind.PUT) and items and any(type(it[at]) is TailBlock for it in items):
            tails = [it for it in items if type(it[at]) is TailBlock]
            items = [it for it in items if type(it[at]) is not TailBlock]
            for it in tails:
                t = it[at]
                tail_owns(t)
                if kind is CopyKind.BACKUP:
                    assert t.device_block not in dev_owner
                    dev_owner[t.device_block] = t
                if kind is CopyKind.LOAD and it[0].freed:
                    assert it[3] not in dev_owner
                    dev_owner[it[3]] = it[0]
        if kind is CopyKind.LOAD:
            for req, _i, n, b in items:
                host_reads[id(n)] = host_reads.get(id(n), 0) + 1
                assert n.host_ready, "load from a host copy that has not landed"
                if req.freed:
                    assert b not in dev_owner
                    dev_owner[b] = req
        elif kind is CopyKind.PRELOAD:
            for _pf, n, b in items:
                host_reads[id(n)] = host_reads.get(id(n), 0) + 1
                assert n.host_ready, "preload from a host copy that has not landed"
                assert m.prefetcher.preloading.get(id(n)) is n, f"preload of {n} not tracked"
                assert b not in dev_owner, f"preload target {b} owned twice"
                dev_owner[b] = _pf
        elif kind is CopyKind.BACKUP:
            for n, d, h in items:
                dev_reads[id(n)] = dev_reads.get(id(n), 0) + 1
                assert n.device_block == d and n.host_block == h and not n.host_ready
        elif kind is CopyKind.PUT:
            for n, h in items:
                host_reads[id(n)] = host_reads.get(id(n), 0) + 1
                assert n.putting and n.host_block == h and n.host_ready
        else:
            for _pf, _i, _k, b, _label in items:
                assert b not in host_owner, f"fetch target {b} owned twice"
                host_owner[b] = _pf
    assert len(m.prefetcher.preloading) == sum(len(items) for kind, items in in_flight if kind is CopyKind.PRELOAD), (
        "a preload tracked with no copy in flight"
    )
    prefetches = {id(x[0]): x[0] for kind, items in in_flight if kind is CopyKind.FETCH for x in items}
    for pf in prefetches.values():  # each holds its anchor until its last chunk is done
        assert pf.num_chunks_pending > 0 and pf.num_blocks_pending > 0
        if pf.locked:
            locks[id(pf.anchor)] = locks.get(id(pf.anchor), 0) + 1
        if pf.host_pinned:
            host_reads[id(pf.anchor)] = host_reads.get(id(pf.anchor), 0) + 1
    for r in live:
        if r.tail is not None and r.tail.state == "ready":
            tail_owns(r.tail)
    for node, exports in m.handoff.exporting.values():  # hand-offs hold their blocks' device copies
        locks[id(node)] = locks.get(id(node), 0) + len(exports)
    for node in tree.nodes.values():
        assert node.lock_ref == locks.get(id(node), 0), f"lock_ref {node.lock_ref} != holders of {node}"
        assert node.host_reads == host_reads.get(id(node), 0), f"host pins of {node}"
        assert node.device_reads == dev_reads.get(id(node), 0), f"device pins of {node}"
        if node.host_block is not None and not node.host_ready:
            assert dev_reads.get(id(node)), f"host copy of {node} not landed and no copy in flight"
    for b in m.landed_twice:
        assert b not in dev_owner, f"device block {b} landed twice and owned"
        dev_owner[b] = "landed twice"
    for b in range(m.device_pool.num_blocks):
        assert m.device_pool.is_free(b) != (b in dev_owner), f"device block {b} leaked or double-owned"
    for b in range(m.host_pool.num_blocks):
        assert m.host_pool.is_free(b) != (b in host_owner), f"host block {b} leaked or double-owned"
    unlocked = sum(1 for n in tree.nodes.values() if n.device_block is not None and n.lock_ref == 0)
    assert tree.num_device_unlocked == unlocked, (tree.num_device_unlocked, unlocked)
    for gi, g in enumerate(m.sliding_groups):  # each slot: one device block's, held by the requests that read it
        g.assert_invariants()
        held: dict[int, int] = {}
        for r in live:
            if r.admitted:
                for b in r.block_table[r.sliding_first[gi] :]:
                    held[b] = held.get(b, 0) + 1
        for b, slot in enumerate(g.slot_of):
            assert slot < 0 or not m.device_pool.is_free(b), f"free device block {b} keeps sliding slot {slot}"
            assert g.holders[b] == held.get(b, 0), f"device block {b}: {g.holders[b]} sliding holders, {held.get(b, 0)} requests"
