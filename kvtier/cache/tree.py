"""Radix tree of full blocks with per-tier residency and leaf-only eviction.

One node per full block. A node is found by walking ``children`` by *label* (the block's
token bytes and tagged extras, see :class:`~kvtier.cache.keys.BlockHasher`), so matching a
prompt hashes nothing; each node also carries its chained key, and a global ``key -> node`` dict
finds any node by key in O(1) (storage names, fetches)::

    root ── A ── B ── C          device copies: A B     (prefix-closed: a device copy's parent
                  └── D                                  always has one too)
                                 host copies:   A B C D
    device leaf = has a device copy and no child with one      (B)
    host leaf   = has a host copy and no child with one        (C, D)

A node exists while it holds a copy on the device or the host tier. Storage residency is not
kept here: the storage index answers for it (it can change under us: shared pool, LRU).

Eviction per tier pops a heap of candidate leaves keyed by the eviction policy. A node is
pushed when it may have become a candidate, unless it is already in that heap (``in_*_heap``:
at most one entry per node and tier); entries are validated lazily on pop (stale key: pushed
again with its current key; no longer a candidate: dropped), so no eviction scans the tree.
Eviction keys only grow (last access, hit count), so a stale entry pops early, never late.
"""
from __future__ import annotations

import heapq
from itertools import count
from typing import Callable

ROOT_KEY = b""


class Node:
    __slots__ = (
        "key", "label", "parent", "depth", "children", "in_device_heap", "in_host_heap",
        "device_block", "host_block", "host_ready", "putting",
        "lock_ref", "device_reads", "host_reads",
        "num_device_children", "num_host_children",
        "hit_count", "last_access", "evict_device_after_copy", "evict_host_after_copy",
        "from_storage",
    )

    def __init__(self, key: bytes, parent: "Node | None", label: bytes = b"") -> None:
        self.key = key
        self.label = label                     # the parent's children are keyed by label
        self.parent = parent
        self.depth = -1 if parent is None else parent.depth + 1  # block index along the path
        self.children: dict[bytes, Node] = {}
        self.in_device_heap = False
        self.in_host_heap = False
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
        self.from_storage = False              # host copy fetched from storage, not yet hit

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


class RadixTree:
    """Nodes, their per-tier copies and the candidate heaps. Pure bookkeeping: block pools and
    transfers belong to the manager."""

    def __init__(self, eviction_key: Callable[[Node], tuple]) -> None:
        self.root = Node(ROOT_KEY, None)
        self.nodes: dict[bytes, Node] = {}
        self._key = eviction_key
        self._device_heap: list[tuple[tuple, int, Node]] = []
        self._host_heap: list[tuple[tuple, int, Node]] = []
        self._seq = count()
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
    def add_child(self, parent: Node, key: bytes, label: bytes) -> Node:
        assert key not in self.nodes and label not in parent.children, "duplicate block"
        node = Node(key, parent, label)
        parent.children[label] = node
        self.nodes[key] = node
        return node

    def remove(self, node: Node) -> None:
        """Drop a node that holds no copy and has no children."""
        assert not node.children and node.device_block is None and node.host_block is None, node
        assert node.lock_ref == 0 and node.device_reads == 0 and node.host_reads == 0, node
        parent = node.parent
        assert parent is not None
        del parent.children[node.label]
        del self.nodes[node.key]
        self.epoch += 1
        self.maybe_candidate(parent)

    # ------------------------------------------------------------------ copies
    def set_device(self, node: Node, block: int) -> None:
        assert node.device_block is None and not node.is_root
        node.device_block = block
        self.num_device_copies += 1
        node.parent.num_device_children += 1  # type: ignore[union-attr]
        if node.lock_ref == 0:
            self.num_device_unlocked += 1
            self.maybe_candidate(node)
        elif node.host_block is not None:      # locked: a candidate on the host tier at most
            self.maybe_candidate(node)

    def _clear_device(self, node: Node) -> int:
        """Take away an unlocked, unread device copy; returns its block."""
        block = node.device_block
        assert block is not None and node.lock_ref == 0 and node.device_reads == 0, node
        node.device_block = None
        node.evict_device_after_copy = False
        self.epoch += 1
        self.num_device_copies -= 1
        self.num_device_unlocked -= 1
        node.parent.num_device_children -= 1  # type: ignore[union-attr]
        return block

    def drop_device(self, node: Node) -> int:
        block = self._clear_device(node)
        parent = node.parent
        if parent.num_device_children == 0:  # type: ignore[union-attr]
            self.maybe_candidate(parent)      # type: ignore[arg-type]
        return block

    def evict_device_leaf(self, node: Node) -> int:
        """Drop the device copy of a device leaf that has no host copy, and the node with it
        (``drop_device`` + ``remove`` in one step: the common eviction). Returns the block.
        The parent may have become a leaf: :meth:`next_device_victim` looks at it first."""
        assert node.host_block is None and not node.children and node.host_reads == 0, node
        block = self._clear_device(node)
        del node.parent.children[node.label]   # type: ignore[union-attr]
        del self.nodes[node.key]
        return block

    def set_host(self, node: Node, block: int, ready: bool) -> None:
        assert node.host_block is None and not node.is_root
        node.host_block = block
        node.host_ready = ready
        self.num_host_copies += 1
        node.parent.num_host_children += 1  # type: ignore[union-attr]
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
        if node.lock_ref == 0 and node.device_block is not None:
            self.num_device_unlocked += 1
            if node.num_device_children == 0 and not node.in_device_heap:
                self.maybe_candidate(node)

    # ------------------------------------------------------------------ eviction
    def maybe_candidate(self, node: Node) -> None:
        """Push ``node`` on the heap of each tier where it is an eviction candidate (once)."""
        if node.parent is None:
            return
        if (not node.in_device_heap and node.device_block is not None and not node.lock_ref
                and not node.num_device_children and node.device_evictable()):
            node.in_device_heap = True
            self._push(self._device_heap, node)
        if not node.in_host_heap and node.host_block is not None and node.host_evictable():
            node.in_host_heap = True
            self._push(self._host_heap, node)

    def _push(self, heap: list, node: Node) -> None:
        heapq.heappush(heap, (self._key(node), next(self._seq), node))
        if len(heap) > 2 * len(self.nodes) + 4096:   # dead entries piled up: start over
            self._rebuild()

    def _rebuild(self) -> None:
        for heap, flag, is_candidate in ((self._device_heap, "in_device_heap", Node.device_evictable),
                                         (self._host_heap, "in_host_heap", Node.host_evictable)):
            for _k, _s, n in heap:
                setattr(n, flag, False)
            heap[:] = [(self._key(n), next(self._seq), n) for n in self.nodes.values() if is_candidate(n)]
            heapq.heapify(heap)
            for _k, _s, n in heap:
                setattr(n, flag, True)

    def next_device_victim(self, evicted: Node) -> Node | None:
        """The next device victim after ``evict_device_leaf(evicted)``: its parent when that
        is now the smallest candidate (a chain evicted leaf-up without touching the heap),
        else the heap's smallest. Same order as pushing the parent and popping."""
        parent = evicted.parent
        assert parent is not None
        if parent.parent is None:
            return self.pop_device_victim()
        if not parent.in_host_heap and parent.host_block is not None and parent.host_evictable():
            parent.in_host_heap = True
            self._push(self._host_heap, parent)
        if parent.device_block is not None and not parent.num_device_children and parent.device_evictable():
            heap = self._device_heap
            k = self._key(parent)
            if not heap or k < heap[0][0]:
                return parent
            if not parent.in_device_heap:
                parent.in_device_heap = True
                self._push(heap, parent)
        return self.pop_device_victim()

    def pop_device_victim(self) -> Node | None:
        """Smallest-key live device candidate, or None."""
        heap, nodes, key = self._device_heap, self.nodes, self._key
        while heap:
            k, _, node = heapq.heappop(heap)
            node.in_device_heap = False
            if nodes.get(node.key) is not node or not node.device_evictable():
                continue
            current = key(node)
            if current != k:  # touched since pushed: requeue with its present key
                node.in_device_heap = True
                heapq.heappush(heap, (current, next(self._seq), node))
                continue
            return node
        return None

    def pop_host_victim(self) -> Node | None:
        """Smallest-key live host candidate, or None."""
        heap, nodes, key = self._host_heap, self.nodes, self._key
        while heap:
            k, _, node = heapq.heappop(heap)
            node.in_host_heap = False
            if nodes.get(node.key) is not node or not node.host_evictable():
                continue
            current = key(node)
            if current != k:
                node.in_host_heap = True
                heapq.heappush(heap, (current, next(self._seq), node))
                continue
            return node
        return None
