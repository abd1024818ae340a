"""Mover: the copies between tiers, from staged to completed (staging, ops in flight, completions).

::

    stage(kind, *items)        items of this step's op of ``kind`` (a :class:`CopyKind`)
    backup(node) / copy_down(node) / put_to_storage(node)
                               a node down a tier (device -> host, ancestors first) or out to the pool
    load(r, first, nodes, blocks)
                               at admission: host hits -> r's own device blocks
    take_plan()                this step's merged transfers (StepPlan); staged items become ops
    complete(op_id, failed)    an op finished; only now do its bytes count as landed, and its
                               items become copies on their new tier (or misses)

The block table (cache/table.py) owns the blocks and the tree; the mover changes them only as a
copy lands or fails, through the table's public interface (``tree``, the pools, ``take_host``,
``free_later``). Fetches and preloads complete in the prefetcher (cache/prefetch.py), a hand-off's
partial block in the hand-off (cache/handoff.py): the mover routes each completion by its kind.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Collection

from kvtier.cache.plan import CopyKind, StepPlan, TransferOp
from kvtier.cache.records import CacheRequest, TailBlock
from kvtier.cache.table import BlockTable
from kvtier.cache.tree import Node

if TYPE_CHECKING:
    from kvtier.cache.handoff import Handoff
    from kvtier.cache.prefetch import Prefetcher

log = logging.getLogger(__name__)
_PLANNED = (CopyKind.LOAD, CopyKind.BACKUP, CopyKind.FETCH, CopyKind.PUT, CopyKind.PRELOAD)  # staged, in plan order


class Mover:
    """Copies staged this step, ops in flight and their completions (module docstring).
    ``prefetcher`` and ``handoff`` complete their own copies; set once they exist (cache/manager.py)."""

    prefetcher: Prefetcher
    handoff: Handoff

    def __init__(self, table: BlockTable, block_nbytes: int) -> None:
        self.table = table
        self.block_nbytes = block_nbytes
        self._backup_backlog: dict[int, Node] = {}  # copy-on-land backups waiting for host room
        self._next_op = 0
        self._staged: dict[CopyKind, list] = {kind: [] for kind in _PLANNED}
        self._pending: dict[int, tuple[CopyKind, list]] = {}

    # ------------------------------------------------------------------ staging
    def stage(self, kind: CopyKind, *items: tuple) -> None:
        """Items of this step's ``kind`` op (load, backup, fetch, put, preload), as ``take_plan``
        reads them: one op per kind per step."""
        self._staged[kind].extend(items)

    def new_op(self, kind: CopyKind, items: list) -> int:
        """A new op id, its items pending until ``complete``."""
        op_id, self._next_op = self._next_op, self._next_op + 1
        self._pending[op_id] = (kind, items)
        return op_id

    def load(self, req: CacheRequest, first: int, nodes: list[Node], blocks: list[int]) -> None:
        """At admission: load ``req``'s host hits ``nodes`` (block table index ``first`` on) into
        its own device ``blocks``, and a hand-off's fetched partial block after them."""
        staged = self._staged[CopyKind.LOAD]
        for j, n in enumerate(nodes):
            staged.append((req, first + j, n, blocks[j]))
        if req.tail is not None:
            self.handoff.load_tail(req, blocks, first)

    def drop_tail(self, req: CacheRequest) -> None:
        self.handoff.drop_tail(req)

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
                got = self.table.take_host(1)
                if got is None:
                    return False
                self.table.tree.set_host(n, got[0], ready=False)
                n.device_reads += 1
                self._staged[CopyKind.BACKUP].append((n, n.device_block, got[0]))
            return True
        finally:
            if not top.is_root:
                top.host_reads -= 1
                self.table.tree.maybe_candidate(top)

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
            if node.host_block is not None or node.device_block is None or not self.table.tree.alive(node):
                continue  # copied meanwhile, or its device copy is gone
            if not self.backup(node):  # still full: keep it and the rest, in order
                self._backup_backlog = {id(n): n for n in pending[i:]}
                return

    def put_to_storage(self, node: Node) -> None:
        storage = self.table.storage
        if storage is None or node.putting or storage.contains(node.key):
            return
        node.putting = True
        node.host_reads += 1
        self._staged[CopyKind.PUT].append((node, node.host_block))

    def swap_out(self, req: CacheRequest) -> int:
        """Preemption by swap: plan device->host copies of every block ``req`` committed that has
        no host copy (whatever the write policy); the blocks planned (the caller frees ``req``)."""
        before = len(self._staged[CopyKind.BACKUP])
        for node in req.nodes:  # every one: an ancestor's earlier copy may have failed
            if node.host_block is None and not self.backup(node):
                break  # host tier full: the rest is recomputed
        planned = len(self._staged[CopyKind.BACKUP]) - before
        self.table.stats.swapped_out_blocks += planned
        return planned

    @property
    def num_device_blocks_freeing(self) -> int:
        """Device blocks no request holds that become free or evictable once copies in flight
        land: backups of unlocked nodes (a swap out, write_back), and early loads (a preload's
        block becomes its node's unlocked device copy, or goes back to the pool). The scheduler
        waits for them instead of preempting a running request."""

        def unlocked_below(node: Node) -> bool:  # evictable leaf-first once its copy lands
            return node.lock_ref == 0 and all(
                unlocked_below(c) for c in self.table.tree.children_of(node) if c.device_block is not None
            )

        backup, preload = CopyKind.BACKUP, CopyKind.PRELOAD
        ops = (*self._pending.values(), (backup, self._staged[backup]), (preload, self._staged[preload]))
        return sum(
            len(items) if kind is preload else sum(1 for n, _d, _h in items if type(n) is not TailBlock and unlocked_below(n))
            for kind, items in ops
            if kind is backup or kind is preload
        )

    # ================================================================== plans
    def take_plan(self) -> StepPlan:
        """This step's transfers, merged across requests (one op per direction)."""
        ops: dict[CopyKind, TransferOp] = {}
        fetches: list[TransferOp] = []
        for kind, items in self._staged.items():
            if not items:
                continue
            if kind is CopyKind.FETCH:
                fetches.extend(self.prefetcher.fetch_ops(items))
                self._staged[kind] = []
                continue
            op_id = self.new_op(kind, items)
            if kind is CopyKind.LOAD:
                src = tuple(n.host_block for _, _, n, _ in items)
                dst = tuple(b for _, _, _, b in items)
                keys = tuple(n.key for _, _, n, _ in items)
            elif kind is CopyKind.PRELOAD:
                src = tuple(n.host_block for _, n, _ in items)
                dst = tuple(b for _, _, b in items)
                keys = tuple(n.key for _, n, _ in items)
            elif kind is CopyKind.BACKUP:
                src = tuple(d for _, d, _ in items)
                dst = tuple(h for _, _, h in items)
                keys = tuple(n.key for n, _, _ in items)
            else:
                src, dst = tuple(h for _, h in items), ()
                keys = tuple(n.key for n, _ in items)
            ops[kind] = TransferOp(op_id, kind.label, src, dst, keys)
            self._staged[kind] = []
        if self.handoff.tail_ops:
            fetches.extend(self.handoff.tail_ops)
            self.handoff.tail_ops = []
        get = ops.get
        return StepPlan(get(CopyKind.LOAD), get(CopyKind.BACKUP), tuple(fetches), get(CopyKind.PUT), get(CopyKind.PRELOAD))

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
        if kind is CopyKind.BACKUP:
            # Device->host copies land in plan order (one offload stream): a block's parent has
            # landed or failed before the block itself, which keeps host copies prefix-closed.
            oldest = next(i for i, (k, _) in self._pending.items() if k is CopyKind.BACKUP)
            if oldest != op_id:
                raise ValueError(f"backup op {op_id} completed before older backup op {oldest}")
        del self._pending[op_id]
        failed = frozenset(failed)
        bad = [i for i in failed if not (isinstance(i, int) and 0 <= i < len(items))]
        if bad:
            self._pending[op_id] = (kind, items)
            raise ValueError(f"failed item indices {bad} out of range for op {op_id} ({len(items)} items)")
        if failed:
            self.table.stats.failures[kind.failure] += len(failed)
            log.warning("%s op %d: %d of %d blocks failed; degrading to recompute", kind.label, op_id, len(failed), len(items))
        ok_blocks = len(items) - len(failed)
        self.table.stats.bytes_moved[kind.direction] += ok_blocks * self.block_nbytes
        rewinds = self._complete(kind, items, failed)
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

    def _complete(self, kind: CopyKind, items: list, failed: frozenset[int]) -> dict[object, int]:
        """Route a completion by its kind: the mover's own, the prefetcher's, the hand-off's."""
        if kind is CopyKind.LOAD:
            return self._complete_load(items, failed)
        if kind is CopyKind.BACKUP:
            return self._complete_backup(items, failed)
        if kind is CopyKind.PUT:
            return self._complete_put(items, failed)
        if kind is CopyKind.FETCH:
            return self.prefetcher.complete(items, failed)
        if kind is CopyKind.PRELOAD:
            return self.prefetcher.complete_preload(items, failed)
        return self.handoff.complete_tailfetch(items, failed)

    def _complete_load(self, items: list, failed: frozenset[int]) -> dict[object, int]:
        table, tree = self.table, self.table.tree
        rewinds: dict[object, int] = {}
        for idx, (req, i, node, block) in enumerate(items):
            if type(node) is TailBlock:
                self.handoff.tail_loaded(req, node, block, idx not in failed, rewinds)
                continue
            node.host_reads -= 1
            tree.maybe_candidate(node)
            req.num_loading -= 1
            if req.freed:
                table.device_pool.free_one(block)
                continue
            if req.rid in rewinds or idx in failed:
                rewinds.setdefault(req.rid, i * table.block_size)
                table.stats.hit_tokens["host"] -= table.block_size  # recomputed: not a hit after all
                continue  # stays request-owned; recomputed
            assert i == len(req.nodes), "loads complete in path order"
            tree.lock(node)
            if node.device_block is None:
                tree.set_device(node, block)
            elif node.device_block != block:  # loaded twice: keep the tree's copy
                table.free_later(block)
                req.block_table[i] = node.device_block
            req.nodes.append(node)
        return rewinds

    def _complete_backup(self, items: list, failed: frozenset[int]) -> dict[object, int]:
        table, tree = self.table, self.table.tree
        for idx, (node, _dev, host) in enumerate(items):
            if type(node) is TailBlock:
                self.handoff.tail_backed_up(node, idx not in failed)
                continue
            node.device_reads -= 1
            parent = node.parent
            if idx in failed or not (parent.is_root or parent.host_ready):  # parent's copy failed
                if idx not in failed:
                    table.stats.failures["backup"] += 1
                table.host_pool.free_one(tree.drop_host(node))
                if id(node) in self.handoff.exporting:
                    self.handoff.node_done(node, False)
            else:
                tree.host_landed(node)
                self.prefetcher.anchor_landed(node)  # fetched blocks hang below: it stays
                if table.storage is not None and (
                    table.policy.copy_on_land(node.hit_count) or id(node) in self.handoff.exporting
                ):
                    self.put_to_storage(node)
            if node.evict_device_after_copy:
                node.evict_device_after_copy = False
                if node.host_ready and node.device_evictable():
                    table.device_pool.free_one(tree.drop_device(node))
                    table.stats.evictions["device"] += 1
            tree.maybe_candidate(node)
        return {}

    def _complete_put(self, items: list, failed: frozenset[int]) -> dict[object, int]:
        table, tree = self.table, self.table.tree
        for idx, (node, _host) in enumerate(items):
            if type(node) is TailBlock:
                self.handoff.tail_put(node, idx not in failed)
                continue
            node.putting = False
            node.host_reads -= 1
            if idx not in failed:
                assert table.storage is not None  # puts run only with a storage tier
                table.storage.add(node.key)
            if id(node) in self.handoff.exporting:
                self.handoff.node_done(node, idx not in failed)
            if node.evict_host_after_copy:
                # write_back: evicted once stored; if the put failed the host copy goes anyway
                # (the pool is only a cache; a dead pool must not freeze the host tier)
                node.evict_host_after_copy = False
                if node.host_evictable():
                    table.host_pool.free_one(tree.drop_host(node))
                    table.stats.evictions["host"] += 1
                    if node.device_block is None:
                        tree.remove(node)
                        continue
            tree.maybe_candidate(node)
        return {}

    # ------------------------------------------------------------------ read-only views
    def copies_in_flight(self) -> list[tuple[CopyKind, list]]:
        """Every copy planned and not completed, as ``(kind, items)``: the ops in flight, this
        step's staged items, and the fetched chunks parked until their turn."""
        parked = ((CopyKind.FETCH, items) for items, _failed in self.prefetcher.parked)
        return [*self._pending.values(), *self._staged.items(), *parked]
