"""Prefill/decode hand-off through the storage pool (DESIGN §7): the CacheManager's collaborator
that writes a prompt's blocks for another engine (P) and reads them back (D).

::

    P  export(r, n)        every block of r's first n tokens to the pool: full blocks through the
                           tree (host copy, then a put; blocks the pool holds are skipped), the last
                           partial block through a scratch host block under ``<hex>:partial:<k>``
       export.done         all of them acked (``export.failed`` counts the ones that did not land)
    D  expect_tail(r, ..)  r's prompt ends in a partial block P wrote: ``prefetch(r)`` fetches it
                           into a scratch host block beside r's storage hits; once r's full blocks
                           are hits (device, host or storage), ``allocate`` loads it into r's own
                           device block, and ``tail_hit(r)`` counts its tokens as cached

A partial block is not a tree node (the radix tree holds full blocks only): a :class:`TailBlock`
owns its scratch host block (and, on P, the request's last device block) until its copies
completed, then frees them. The full blocks an export waits for stay locked (their device copies
cannot be evicted before their host copy and put landed).

Its state is its own (the exports waiting for each node's put, the tail fetches to plan); what it
uses of the cache is :class:`HandoffHost`, which the manager (cache/manager.py) provides: the tree
(locks), the pools, ``take_host``, ``put_to_storage`` / ``copy_down`` of a node, ``stage`` and
``new_op`` of copies, the storage index and the request's keys (``sync_keys``). The mover
(cache/mover.py) hands it the completions of its copies. The records it keeps (:class:`TailBlock`,
:class:`Export`) live in cache/records.py.
"""

from __future__ import annotations

from typing import Protocol

from kvtier.cache.keys import object_name
from kvtier.cache.plan import CopyKind, TransferOp
from kvtier.cache.pool import BlockPool
from kvtier.cache.records import CacheRequest, Export, TailBlock
from kvtier.cache.storage_index import StorageIndex
from kvtier.cache.tree import Node, RadixTree

__all__ = ["Export", "Handoff", "HandoffHost", "TailBlock"]


class HandoffHost(Protocol):
    """What the hand-off uses of the cache (the manager provides it)."""

    @property
    def block_size(self) -> int: ...
    @property
    def has_host(self) -> bool: ...
    @property
    def storage(self) -> StorageIndex | None: ...
    @property
    def tree(self) -> RadixTree: ...
    @property
    def device_pool(self) -> BlockPool: ...
    @property
    def host_pool(self) -> BlockPool: ...
    def sync_keys(self, req: CacheRequest, num_tokens: int | None = None) -> list[bytes]: ...
    def take_host(self, n: int) -> list[int] | None: ...
    def put_to_storage(self, node: Node) -> None: ...
    def copy_down(self, node: Node) -> None: ...
    def stage(self, kind: CopyKind, *items: tuple) -> None: ...
    def new_op(self, kind: CopyKind, items: list) -> int: ...


class Handoff:
    """The cache's PD hand-offs (module docstring)."""

    def __init__(self, mgr: HandoffHost) -> None:
        self.m = mgr
        self.exporting: dict[int, tuple[Node, list[Export]]] = {}  # node -> exports awaiting its put
        self.tail_ops: list[TransferOp] = []  # tail fetches not planned yet

    # ------------------------------------------------------------------ keys
    def keys(self, req: CacheRequest, num_tokens: int) -> tuple[list[bytes], str | None]:
        """Block keys of ``req``'s first ``num_tokens`` tokens: the full blocks', and the partial
        block's name (None when ``num_tokens`` is a multiple of the block size)."""
        if not 0 < num_tokens <= len(req.token_ids):
            raise ValueError(f"num_tokens must be in 1..{len(req.token_ids)}, got {num_tokens}")
        n_full = num_tokens // self.m.block_size  # the request's own keys (matching reuses them)
        full = self.m.sync_keys(req, n_full * self.m.block_size)[:n_full]
        return list(full), req.hasher.partial_key(num_tokens, req.token_ids)

    def manifest_names(self, full: list[bytes], tail: str | None) -> list[str]:
        """Storage object names of :meth:`keys`' blocks (a hand-off manifest's keys)."""
        storage = self.m.storage  # a pool client (StorageClient) where hand-offs run
        ns = storage.namespace if storage is not None else "default"  # type: ignore[attr-defined]  # not in StorageIndex
        return [object_name(k, ns) for k in full] + ([object_name(tail, ns)] if tail else [])

    # ------------------------------------------------------------------ P: export
    def export(self, req: CacheRequest, num_tokens: int) -> Export:
        """Write every block of ``req``'s first ``num_tokens`` tokens (committed KV) to the pool.

        Call it before ``free(req)``: the partial block's device block passes from the request to
        the export (freed once copied). Poll ``export.done``; a block that could not be written
        counts in ``export.failed`` (D recomputes it).
        """
        if self.m.storage is None or not self.m.has_host:
            raise ValueError("a hand-off export needs a host tier and a storage pool")
        if not req.admitted or req.freed:
            raise ValueError(f"request {req.rid!r} is not running")
        bs = self.m.block_size
        n_full, n_tail = divmod(num_tokens, bs)
        if len(req.nodes) < n_full or len(req.block_table) < n_full + (1 if n_tail else 0):
            raise ValueError(f"request {req.rid!r} has not computed {num_tokens} tokens yet")
        full, tail_name = self.keys(req, num_tokens)
        exp = Export(req.rid, num_tokens, self.manifest_names(full, tail_name))
        for node in req.nodes[:n_full]:
            if self.m.storage.contains(node.key):
                exp.skipped += 1
                continue
            exp.num_waiting += 1
            self.m.tree.lock(node)  # its device copy stays until its put landed
            self.exporting.setdefault(id(node), (node, []))[1].append(exp)
            if node.host_ready:
                self.m.put_to_storage(node)  # (or a put already in flight: we wait for it)
            elif node.host_block is None:
                self.m.copy_down(node)  # then put when it lands (_complete_backup)
        if n_tail:
            assert tail_name is not None  # a partial block has a name
            tail = TailBlock(tail_name, n_full, n_tail)
            tail.export = exp
            exp.num_waiting += 1
            got = self.m.take_host(1)
            if got is None:  # host tier full of pinned blocks: D recomputes it
                self._export_ack(exp, ok=False)
            else:
                tail.host_block = got[0]
                tail.device_block = req.block_table.pop(n_full)  # ours now (freed once copied)
                tail.state = "backing_up"
                self.m.stage(CopyKind.BACKUP, (tail, tail.device_block, tail.host_block))
        return exp

    def _export_ack(self, exp: Export, ok: bool) -> None:
        exp.num_waiting -= 1
        if not ok:
            exp.failed += 1

    def node_done(self, node: Node, ok: bool) -> None:
        """A full block an export waits for was stored (or failed to be)."""
        entry = self.exporting.pop(id(node), None)
        if entry is None:
            return
        for exp in entry[1]:
            self._export_ack(exp, ok)
            self.m.tree.unlock(node)
        self.m.tree.maybe_candidate(node)

    def tail_backed_up(self, tail: TailBlock, ok: bool) -> None:
        assert tail.device_block is not None and tail.host_block is not None and tail.export is not None, tail
        self.m.device_pool.free_one(tail.device_block)
        tail.device_block = None
        if not ok:
            self.m.host_pool.free_one(tail.host_block)
            tail.host_block, tail.state = None, "failed"
            self._export_ack(tail.export, ok=False)
            return
        tail.state = "putting"
        self.m.stage(CopyKind.PUT, (tail, tail.host_block))

    def tail_put(self, tail: TailBlock, ok: bool) -> None:
        assert tail.host_block is not None and tail.export is not None, tail
        self.m.host_pool.free_one(tail.host_block)
        tail.host_block, tail.state = None, ("done" if ok else "failed")
        self._export_ack(tail.export, ok)

    # ------------------------------------------------------------------ D: import
    def expect_tail(self, req: CacheRequest, num_tokens: int) -> str | None:
        """``req``'s first ``num_tokens`` tokens were written to the pool by a prefill engine:
        fetch their last partial block too (``prefetch``). Returns its name (None if the prompt
        ends on a block boundary)."""
        if req.admitted or req.tail is not None:
            raise ValueError(f"request {req.rid!r} is already admitted or expects a tail")
        if num_tokens >= len(req.token_ids):
            raise ValueError("a handed-off request must hold at least one token past the prompt")
        name = self.keys(req, num_tokens)[1]
        if name is not None and self.m.storage is not None and self.m.has_host:
            req.tail = TailBlock(name, num_tokens // self.m.block_size, num_tokens % self.m.block_size)
        return name

    def fetch_tail(self, req: CacheRequest) -> int:
        tail = req.tail
        if tail is None or tail.state != "wanted":
            return 0
        got = self.m.take_host(1)
        if got is None:
            tail.state = "failed"
            return 0
        block = tail.host_block = got[0]
        tail.state = "fetching"
        op_id = self.m.new_op(CopyKind.TAILFETCH, [tail])
        self.tail_ops.append(TransferOp(op_id, CopyKind.FETCH.label, (), (block,), (tail.key,)))
        return 1

    def complete_tailfetch(self, items: list, failed: frozenset[int]) -> dict[object, int]:
        tail: TailBlock = items[0]
        if failed or tail.state == "dropped":
            assert tail.host_block is not None, tail
            self.m.host_pool.free_one(tail.host_block)
            tail.host_block = None
            if tail.state != "dropped":
                tail.state = "failed"
        else:
            tail.state = "ready"
        return {}

    def tail_hit(self, req: CacheRequest) -> int:
        """Tokens of ``req``'s fetched partial block that count as cached with its last match:
        only when every full block before it is a device or host hit."""
        tail = req.tail
        if tail is None or tail.state not in ("ready", "loading") or req.match is None:
            return 0
        m = req.match
        return tail.num_tokens if m.num_device_blocks + m.num_host_blocks == tail.index else 0

    def load_tail(self, req: CacheRequest, blocks: list[int], first_own: int) -> None:
        """At admission: load the fetched partial block into ``req``'s own device block."""
        tail = req.tail
        if tail is None or tail.state != "ready":
            return
        if self.tail_hit(req) and first_own <= tail.index < first_own + len(blocks):
            tail.state = "loading"
            self.m.stage(CopyKind.LOAD, (req, tail.index, tail, blocks[tail.index - first_own]))
            req.num_loading += 1
        else:  # its full blocks were not all hits: recomputed
            self.drop_tail(req)

    def drop_tail(self, req: CacheRequest) -> None:
        tail = req.tail
        if tail is None:
            return
        if tail.state == "ready":
            assert tail.host_block is not None, tail
            self.m.host_pool.free_one(tail.host_block)
            tail.host_block = None
        if tail.state in ("fetching", "ready", "wanted"):
            tail.state = "dropped"  # a fetch in flight frees its block when done

    def tail_loaded(self, req: CacheRequest, tail: TailBlock, block: int, ok: bool, rewinds: dict[object, int]) -> None:
        assert tail.host_block is not None, tail
        self.m.host_pool.free_one(tail.host_block)
        tail.host_block = None
        tail.state = "done" if ok else "failed"
        req.num_loading -= 1
        if req.freed:
            self.m.device_pool.free_one(block)
        elif not ok or req.rid in rewinds:
            rewinds.setdefault(req.rid, tail.index * self.m.block_size)
