"""Radix tree of full blocks with per-tier residency and leaf-only eviction.

One node per full block, addressed by its chained key (so a global ``key -> node`` dict finds
any node in O(1), and ``children`` keeps the tree shape for leaf-only eviction)::

    root ── A ── B ── C          device copies: A B     (prefix-closed: a device copy's parent
                  └── D                                  always has one too)
                                 host copies:   A B C D
    device leaf = has a device copy and no child with one      (B)
    host leaf   = has a host copy and no child with one        (C, D)

A node exists while it holds a copy on the device or the host tier. Storage residency is not
kept here: the storage index answers for it (it can change under us: shared pool, LRU).

Eviction per tier pops a heap of candidate leaves keyed by the eviction policy. Entries are
pushed whenever a node may have become a candidate and validated lazily on pop (stale key:
pushed again with its current key; no longer a candidate: dropped), so no eviction scans the tree.
"""
from __future__ import annotations

import heapq
from itertools import count
from typing import Callable

ROOT_KEY = b""


class Node:
    __slots__ = (
        "key", "parent", "depth", "children",
        "device_block", "host_block", "host_ready", "putting",
        "lock_ref", "device_reads", "host_reads",
        "num_device_children", "num_host_children",
        "hit_count", "last_access", "evict_device_after_copy", "evict_host_after_copy",
    )

    def __init__(self, key: bytes, parent: "Node | None") -> None:
        self.key = key
        self.parent = parent
        self.depth = -1 if parent is None else parent.depth + 1  # block index along the path
        self.children: dict[bytes, Node] = {}
        self.device_block: int | None = None   # readable: set only once the bytes landed
        self.host_block: int | None = None
        self.host_ready = False                # False while a device->host copy is in flight
        self.putting = False                   # a host->storage copy is in flight
        self.lock_ref = 0                      # running requests using the device copy
        self.device_reads = 0                  # in-flight copies reading the device copy
        self.host_reads = 0                    # in-flight copies reading the host copy, holds
        self.num_device_children = 0
        self.num_host_children = 0
        self.hit_count = 0
        self.last_access = 0
        self.evict_device_after_copy = False   # write_back: free the device copy once copied
        self.evict_host_after_copy = False     # write_back: free the host copy once stored

    def __repr__(self) -> str:
        return (f"Node(depth={self.depth}, key={self.key[:4].hex()}, dev={self.device_block}, "
                f"host={self.host_block}{'' if self.host_ready else '*'}, lock={self.lock_ref})")

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def device_evictable(self) -> bool:
        return (self.device_block is not None and self.lock_ref == 0 and self.device_reads == 0
                and self.num_device_children == 0
                and (self.host_block is not None or not self.children))

    def host_evictable(self) -> bool:
        return (self.host_block is not None and self.host_ready and self.host_reads == 0
                and not self.putting and self.num_host_children == 0
                and (self.device_block is not None or not self.children))


class _CandidateHeap:
    """Lazy min-heap of eviction candidates of one tier."""

    def __init__(self, key: Callable[[Node], tuple], is_candidate: Callable[[Node], bool]) -> None:
        self._key = key
        self._is_candidate = is_candidate
        self._heap: list[tuple[tuple, int, Node]] = []
        self._seq = count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, node: Node) -> None:
        heapq.heappush(self._heap, (self._key(node), next(self._seq), node))

    def pop(self, alive: Callable[[Node], bool]) -> Node | None:
        """Smallest-key live candidate, or None."""
        heap = self._heap
        while heap:
            k, _, node = heapq.heappop(heap)
            if not alive(node) or not self._is_candidate(node):
                continue
            current = self._key(node)
            if current != k:  # touched since pushed: requeue with its present key
                heapq.heappush(heap, (current, next(self._seq), node))
                continue
            return node
        return None

    def rebuild(self, nodes) -> None:  # type: ignore[no-untyped-def]
        self._heap = [(self._key(n), next(self._seq), n) for n in nodes if self._is_candidate(n)]
        heapq.heapify(self._heap)


class RadixTree:
    """Nodes, their per-tier copies and the candidate heaps. Pure bookkeeping: block pools and
    transfers belong to the manager."""

    def __init__(self, eviction_key: Callable[[Node], tuple]) -> None:
        self.root = Node(ROOT_KEY, None)
        self.nodes: dict[bytes, Node] = {}
        self.device_heap = _CandidateHeap(eviction_key, Node.device_evictable)
        self.host_heap = _CandidateHeap(eviction_key, Node.host_evictable)
        self.num_device_copies = 0
        self.num_host_copies = 0
        self.num_device_unlocked = 0   # device copies no running request holds (evictable in time)
        self.epoch = 0                 # bumped whenever a copy or node goes away (stale matches)

    def __len__(self) -> int:
        return len(self.nodes)

    def get(self, key: bytes) -> Node | None:
        return self.nodes.get(key)

    def alive(self, node: Node) -> bool:
        return self.nodes.get(node.key) is node

    # ------------------------------------------------------------------ structure
    def add_child(self, parent: Node, key: bytes) -> Node:
        assert key not in self.nodes, "duplicate block key"
        node = Node(key, parent)
        parent.children[key] = node
        self.nodes[key] = node
        return node

    def remove(self, node: Node) -> None:
        """Drop a node that holds no copy and has no children."""
        assert not node.children and node.device_block is None and node.host_block is None, node
        assert node.lock_ref == 0 and node.device_reads == 0 and node.host_reads == 0, node
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        del self.nodes[node.key]
        self.epoch += 1
        self.maybe_candidate(parent)

    # ------------------------------------------------------------------ copies
    def set_device(self, node: Node, block: int) -> None:
        assert node.device_block is None and not node.is_root
        node.device_block = block
        self.num_device_copies += 1
        if node.lock_ref == 0:
            self.num_device_unlocked += 1
        node.parent.num_device_children += 1  # type: ignore[union-attr]
        self.maybe_candidate(node)

    def drop_device(self, node: Node) -> int:
        block = node.device_block
        assert block is not None and node.lock_ref == 0 and node.device_reads == 0
        node.device_block = None
        node.evict_device_after_copy = False
        self.epoch += 1
        self.num_device_copies -= 1
        self.num_device_unlocked -= 1
        node.parent.num_device_children -= 1  # type: ignore[union-attr]
        self.maybe_candidate(node.parent)      # type: ignore[arg-type]
        return block

    def set_host(self, node: Node, block: int, ready: bool) -> None:
        assert node.host_block is None and not node.is_root
        node.host_block = block
        node.host_ready = ready
        self.num_host_copies += 1
        node.parent.num_host_children += 1  # type: ignore[union-attr]
        if ready:
            self.maybe_candidate(node)

    def drop_host(self, node: Node) -> int:
        block = node.host_block
        assert block is not None and node.host_reads == 0 and not node.putting
        node.host_block = None
        node.host_ready = False
        self.epoch += 1
        node.evict_host_after_copy = False
        self.num_host_copies -= 1
        node.parent.num_host_children -= 1  # type: ignore[union-attr]
        self.maybe_candidate(node.parent)    # type: ignore[arg-type]
        self.maybe_candidate(node)
        return block

    # ------------------------------------------------------------------ locks
    def lock(self, node: Node) -> None:
        if node.lock_ref == 0 and node.device_block is not None:
            self.num_device_unlocked -= 1
        node.lock_ref += 1

    def unlock(self, node: Node) -> None:
        assert node.lock_ref > 0, node
        node.lock_ref -= 1
        if node.lock_ref == 0:
            if node.device_block is not None:
                self.num_device_unlocked += 1
            self.maybe_candidate(node)

    # ------------------------------------------------------------------ eviction
    def maybe_candidate(self, node: Node) -> None:
        if node.is_root:
            return
        if node.device_evictable():
            self.device_heap.push(node)
        if node.host_evictable():
            self.host_heap.push(node)
        if len(self.device_heap) + len(self.host_heap) > 8 * len(self.nodes) + 4096:
            self.device_heap.rebuild(self.nodes.values())
            self.host_heap.rebuild(self.nodes.values())

    def pop_device_victim(self) -> Node | None:
        return self.device_heap.pop(self.alive)

    def pop_host_victim(self) -> Node | None:
        return self.host_heap.pop(self.alive)
