"""Compressed radix tree of full blocks, with per-tier residency and leaf-only eviction.

(Over 600 lines on purpose: segments, nodes and the per-tier eviction heaps change together on
every split, merge, copy and eviction, each reading the others' fields; apart they would not be
separate jobs but one job's halves reaching into each other.)

A *segment* is a run of blocks with no branch inside it; the tree branches only between
segments, so a prompt's cached prefix is found with one dict lookup and one byte comparison per
segment, not per block::

    root ─┬─ [A B C] ─┬─ [D E]        3 segments hold A..E; C has two children (D, F)
          │           └─ [F]
          └─ [G]                      a segment has no child segment, or two or more

A segment keeps its blocks' *labels* (token bytes and tagged extras, see
:class:`~kvtier.cache.keys.BlockHasher`) end to end in ``data``, with each label's end offset in
``ends``; its parent finds it by its first label. Inserting below the middle of a segment splits
it there; when removing a leaf segment leaves its parent with one child, the two merge again.

Residency is per block: one :class:`Node` per block, with a parent link (the block before it),
its chained key (a global ``key -> node`` dict finds any node by key in O(1): storage names,
fetches), its copies and pins::

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
from typing import TYPE_CHECKING, Callable, Sequence

from kvtier.cache.events import DEVICE, HOST, REMOVED, STORED, KVEvents

if TYPE_CHECKING:
    from kvtier.cache.keys import BlockHasher

ROOT_KEY = b""


class Node:
    __slots__ = (
        "key",
        "parent",
        "seg",
        "idx",
        "depth",
        "num_children",
        "in_device_heap",
        "in_host_heap",
        "device_block",
        "host_block",
        "host_ready",
        "putting",
        "lock_ref",
        "device_reads",
        "host_reads",
        "num_device_children",
        "num_host_children",
        "hit_count",
        "last_access",
        "evict_device_after_copy",
        "evict_host_after_copy",
        "from_storage",
        "preloaded",
    )

    def __init__(self, key: bytes, parent: "Node | None", seg: "Segment", idx: int) -> None:
        self.key = key
        self.parent = parent
        self.seg = seg  # the segment holding this block ...
        self.idx = idx  # ... at this index
        self.depth: int = -1 if parent is None else parent.depth + 1  # block index along the path
        self.num_children = 0
        self.in_device_heap = False
        self.in_host_heap = False
        self.device_block: int | None = None  # readable: set only once the bytes landed
        self.host_block: int | None = None
        self.host_ready = False  # False while a device->host copy is in flight
        self.putting = False  # a host->storage copy is in flight
        self.lock_ref = 0  # running requests using the device copy
        self.device_reads = 0  # in-flight copies reading the device copy
        self.host_reads = 0  # in-flight copies reading the host copy, holds
        self.num_device_children = 0
        self.num_host_children = 0
        self.hit_count = 0
        self.last_access = 0
        self.evict_device_after_copy = False  # write_back: free the device copy once copied
        self.evict_host_after_copy = False  # write_back: free the host copy once stored
        self.from_storage = False  # host copy fetched from storage, not yet hit
        self.preloaded = None  # the prefetch whose wait preloaded the device copy (not hit yet)

    def __repr__(self) -> str:
        return (
            f"Node(depth={self.depth}, key={self.key[:4].hex()}, dev={self.device_block}, "
            f"host={self.host_block}{'' if self.host_ready else '*'}, lock={self.lock_ref})"
        )

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def device_evictable(self) -> bool:
        return (
            self.device_block is not None
            and self.lock_ref == 0
            and self.device_reads == 0
            and self.num_device_children == 0
            and (self.host_block is not None or not self.num_children)
        )

    def host_evictable(self) -> bool:
        return (
            self.host_block is not None
            and self.host_ready
            and self.host_reads == 0
            and not self.putting
            and self.num_host_children == 0
            and (self.device_block is not None or not self.num_children)
        )


class Segment:
    """A run of blocks without a branch: ``nodes``, their ``keys`` (``keys[i] is
    nodes[i].key``: a match takes a run of keys with one slice), their labels end to end
    (``data``; label ``i`` ends at ``ends[i]``), and the child segments by first label. ``uniform``: every label
    is a block of tokens without extras (see ``BlockHasher.uniform``), so a request without
    extras needs no per-block boundary check against it.

    Evicting the last block only drops its end offset: ``data`` may run past ``ends[-1]`` until
    :meth:`trimmed` cuts it (one copy per run of evictions, not one per block)."""

    __slots__ = ("parent", "nodes", "keys", "data", "ends", "children", "uniform")

    def __init__(self, parent: "Segment | None", uniform: bool = True) -> None:
        self.parent = parent
        self.nodes: list[Node] = []
        self.keys: list[bytes] = []
        self.data = b""
        self.ends: list[int] = []
        self.children: dict[bytes, Segment] = {}
        self.uniform = uniform

    def label(self, i: int) -> bytes:
        return self.data[self.ends[i - 1] if i else 0 : self.ends[i]]

    def trimmed(self) -> bytes:
        """``data`` without the labels of evicted blocks."""
        data = self.data
        if self.ends and len(data) != self.ends[-1]:
            data = self.data = data[: self.ends[-1]]
        return data

    def __repr__(self) -> str:
        return f"Segment({len(self.nodes)} blocks, {len(self.children)} children)"


class RadixTree:
    """Nodes, their per-tier copies and the candidate heaps. Pure bookkeeping: block pools and
    transfers belong to the manager."""

    def __init__(self, eviction_key: Callable[[Node], tuple]) -> None:
        self.root_seg = Segment(None)
        self.root = Node(ROOT_KEY, None, self.root_seg, -1)
        self.nodes: dict[bytes, Node] = {}
        self._key = eviction_key
        self._device_heap: list[tuple[tuple, int, Node]] = []
        self._host_heap: list[tuple[tuple, int, Node]] = []
        self._seq = count()
        self.num_device_copies = 0
        self.num_host_copies = 0
        self.num_device_unlocked = 0  # device copies no running request holds (evictable in time)
        self.epoch = 0  # bumped whenever a copy or node goes away (stale matches)
        self.events: KVEvents | None = None  # blocks stored / removed per tier, once enabled (cache/events.py)

    def __len__(self) -> int:
        return len(self.nodes)

    def get(self, key: bytes) -> Node | None:
        return self.nodes.get(key)

    def alive(self, node: Node) -> bool:
        return self.nodes.get(node.key) is node

    # ------------------------------------------------------------------ lookup
    def match(self, h: "BlockHasher", max_blocks: int) -> list[Node]:
        """Nodes of the longest cached run of ``h``'s first ``max_blocks`` blocks: per segment,
        one dict lookup by the next block's label and one comparison of ``h.stream`` with the
        segment's labels; only the segment where the request diverges is searched by block.
        ``h`` adopts the matched blocks' keys (one slice per segment: a hit is never hashed)."""
        path: list[Node] = []
        keys: list[bytes] = []
        stream, plain = h.stream, h.uniform
        seg, blk = self.root_seg, 0
        while blk < max_blocks:
            pos = h.end(blk - 1)
            child = seg.children.get(stream[pos : h.end(blk)])
            if child is None:
                break
            n = len(child.nodes)
            if n <= max_blocks - blk and plain and child.uniform and (stream[pos : pos + child.ends[-1]] == child.trimmed()):
                k = n  # the whole run (block ends agree: no extras)
            else:
                k = self._common_blocks(child, h, blk, min(n, max_blocks - blk))
            if k < n:
                path.extend(child.nodes[:k])
                keys.extend(child.keys[:k])
                break
            path.extend(child.nodes)
            keys.extend(child.keys)
            blk += n
            seg = child
        h.adopt_keys(keys)
        return path

    @staticmethod
    def _common_blocks(seg: Segment, h: "BlockHasher", blk: int, limit: int) -> int:
        """How many of ``seg``'s first ``limit`` blocks equal ``h``'s blocks from ``blk`` (the
        first one does: it was found by its label)."""
        stream, pos, ends, data = h.stream, h.end(blk - 1), seg.ends, seg.data
        if h.uniform and seg.uniform:  # equal bytes up to a block end = equal blocks: bisect
            lo, hi = 1, limit  # lo blocks match; is it more?
            while lo < hi:
                mid = (lo + hi + 1) // 2
                e = ends[mid - 1]
                if stream[pos : pos + e] == data[:e]:
                    lo = mid
                else:
                    hi = mid - 1
            return lo
        k = 1
        while k < limit and h.label(blk + k) == seg.label(k):
            k += 1
        return k

    def child(self, parent: Node, label: bytes) -> Node | None:
        """The child of ``parent`` whose block has this label, or None."""
        seg, i = parent.seg, parent.idx + 1
        if i < len(seg.nodes):
            return seg.nodes[i] if seg.label(i) == label else None
        c = seg.children.get(label)
        return None if c is None else c.nodes[0]

    def children_of(self, node: Node) -> list[Node]:
        seg, i = node.seg, node.idx + 1
        if i < len(seg.nodes):
            return [seg.nodes[i]]
        return [c.nodes[0] for c in seg.children.values()]

    def label(self, node: Node) -> bytes:
        return node.seg.label(node.idx)

    # ------------------------------------------------------------------ structure
    def add_run(
        self,
        parent: Node,
        keys: Sequence[bytes],
        data: bytes,
        ends: Sequence[int],
        uniform: bool,
        device_blocks: Sequence[int] = (),
        tick: int = 0,
    ) -> list[Node]:
        """New nodes for a chain of blocks below ``parent`` (which has no child with the first
        label): their keys, their labels end to end and each label's end in ``data``. Appended
        to ``parent``'s segment when ``parent`` ends a leaf segment; else a new child segment,
        after splitting ``parent``'s segment behind it if ``parent`` is inside it.

        With ``device_blocks`` (one per key) the nodes are device copies of blocks just computed,
        each locked once by the request that computed them, hit once, accessed at ``tick``: the
        commit of a prefill, set up in the same pass that creates the nodes."""
        seg, i = parent.seg, parent.idx + 1
        if i < len(seg.nodes):
            self._split(seg, i)
        if seg.children or seg is self.root_seg:
            assert data[: ends[0]] not in seg.children, "duplicate block"
            target = Segment(seg, uniform)
            seg.children[data[: ends[0]]] = target
        else:
            target = seg
            target.uniform = target.uniform and uniform
        base, off = len(target.nodes), len(target.trimmed())
        nodes, prev = self.nodes, parent
        created: list[Node] = []
        append = created.append
        if device_blocks:
            assert len(device_blocks) == len(keys), (len(device_blocks), len(keys))
            ev = self.events if self.events is not None and self.events.enabled else None
            for idx, key, block in zip(range(base, base + len(keys)), keys, device_blocks):
                assert key not in nodes, "duplicate block key"
                node = nodes[key] = Node(key, prev, target, idx)
                node.num_children = node.num_device_children = 1
                node.device_block = block
                node.lock_ref = node.hit_count = 1
                node.last_access = tick
                if ev is not None:
                    ev.emit(STORED, DEVICE, key)
                append(node)
                prev = node
            prev.num_device_children = 0
            parent.num_device_children += 1
            self.num_device_copies += len(created)
        else:
            for idx, key in zip(range(base, base + len(keys)), keys):
                assert key not in nodes, "duplicate block key"
                node = nodes[key] = Node(key, prev, target, idx)
                node.num_children = 1
                append(node)
                prev = node
        prev.num_children = 0
        parent.num_children += 1
        target.nodes.extend(created)
        target.keys.extend(keys)
        target.data += data
        target.ends.extend(map(off.__add__, ends) if off else ends)
        return created

    def _split(self, seg: Segment, i: int) -> None:
        """Cut ``seg`` before its block ``i``: blocks ``i..`` (and ``seg``'s children) become its
        only child segment."""
        tail = Segment(seg, seg.uniform)
        cut = seg.ends[i - 1]
        tail.nodes = seg.nodes[i:]
        tail.keys = seg.keys[i:]
        tail.data = seg.trimmed()[cut:]
        tail.ends = [e - cut for e in seg.ends[i:]]
        tail.children = seg.children
        for c in tail.children.values():
            c.parent = tail
        for j, node in enumerate(tail.nodes):
            node.seg, node.idx = tail, j
        del seg.nodes[i:], seg.keys[i:], seg.ends[i:]
        seg.data = seg.data[:cut]
        seg.children = {tail.data[: tail.ends[0]]: tail}

    def _drop_leaf(self, node: Node) -> None:
        """Unlink a childless node (the last block of a leaf segment)."""
        seg = node.seg
        assert not node.num_children and seg.nodes[-1] is node and not seg.children, node
        del self.nodes[node.key]
        parent = node.parent
        assert parent is not None
        parent.num_children -= 1
        if len(seg.nodes) > 1:
            seg.nodes.pop()
            seg.keys.pop()
            seg.ends.pop()  # data is cut later (trimmed)
            return
        up = seg.parent
        assert up is not None
        del up.children[seg.label(0)]
        if len(up.children) == 1 and up is not self.root_seg:
            self._merge(up)

    def _merge(self, seg: Segment) -> None:
        """Join ``seg`` with its only child segment."""
        (child,) = seg.children.values()
        base, off = len(seg.nodes), len(seg.trimmed())
        for j, node in enumerate(child.nodes):
            node.seg, node.idx = seg, base + j
        seg.nodes.extend(child.nodes)
        seg.keys.extend(child.keys)
        seg.ends.extend([off + e for e in child.ends])
        seg.data += child.trimmed()
        seg.children = child.children
        for c in seg.children.values():
            c.parent = seg
        seg.uniform = seg.uniform and child.uniform

    def remove(self, node: Node) -> None:
        """Drop a node that holds no copy and has no children."""
        assert not node.num_children and node.device_block is None and node.host_block is None, node
        assert node.lock_ref == 0 and node.device_reads == 0 and node.host_reads == 0, node
        parent = node.parent
        assert parent is not None
        self._drop_leaf(node)
        self.epoch += 1
        self.maybe_candidate(parent)

    def check(self) -> None:
        """The segments' structure (tests, ``assert_invariants``)."""
        seen = 0
        stack = [(self.root_seg, self.root)]
        while stack:
            seg, above = stack.pop()
            if seg is not self.root_seg:
                assert seg.nodes and len(seg.children) != 1, f"{seg}: empty, or one child (unmerged)"
                assert len(seg.ends) == len(seg.nodes) and seg.ends[-1] <= len(seg.data), seg
                assert seg.keys == [n.key for n in seg.nodes], f"{seg}: keys"
                assert all(a < b for a, b in zip([0, *seg.ends], seg.ends)), f"{seg}: label ends"
            prev = above
            for j, node in enumerate(seg.nodes):
                assert node.seg is seg and node.idx == j and node.parent is prev, f"{node} link"
                assert self.nodes.get(node.key) is node, f"{node} not in the key index"
                assert node.num_children == (1 if j + 1 < len(seg.nodes) else len(seg.children)), node
                prev = node
            seen += len(seg.nodes)
            for label, c in seg.children.items():
                assert c.parent is seg and c.label(0) == label, f"{c}: parent link or label"
                stack.append((c, prev))
        assert self.root.num_children == len(self.root_seg.children)
        assert seen == len(self.nodes), "a node outside the segments"

    # ------------------------------------------------------------------ copies
    def _emit(self, kind: str, tier: str, node: Node) -> None:
        ev = self.events
        if ev is not None and ev.enabled:
            ev.emit(kind, tier, node.key)

    def host_landed(self, node: Node) -> None:
        """A device->host copy of ``node`` landed: its host copy is readable."""
        node.host_ready = True
        self._emit(STORED, HOST, node)

    def set_device(self, node: Node, block: int) -> None:
        assert node.device_block is None and not node.is_root
        node.device_block = block
        self._emit(STORED, DEVICE, node)
        self.num_device_copies += 1
        assert node.parent is not None
        node.parent.num_device_children += 1
        if node.lock_ref == 0:
            self.num_device_unlocked += 1
            self.maybe_candidate(node)
        elif node.host_block is not None:  # locked: a candidate on the host tier at most
            self.maybe_candidate(node)

    def _clear_device(self, node: Node) -> int:
        """Take away an unlocked, unread device copy; returns its block."""
        block = node.device_block
        assert block is not None and node.lock_ref == 0 and node.device_reads == 0, node
        node.device_block = None
        self._emit(REMOVED, DEVICE, node)
        node.evict_device_after_copy = False
        node.preloaded = None
        self.epoch += 1
        self.num_device_copies -= 1
        self.num_device_unlocked -= 1
        assert node.parent is not None
        node.parent.num_device_children -= 1
        return block

    def drop_device(self, node: Node) -> int:
        block = self._clear_device(node)
        parent = node.parent
        assert parent is not None
        if parent.num_device_children == 0:
            self.maybe_candidate(parent)
        return block

    def evict_device_leaf(self, node: Node) -> int:
        """Drop the device copy of a device leaf that has no host copy, and the node with it
        (``drop_device`` + ``remove`` in one step: the common eviction). Returns the block.
        The parent may have become a leaf: :meth:`next_device_victim` looks at it first."""
        assert node.host_block is None and not node.num_children and node.host_reads == 0, node
        block = self._clear_device(node)
        self._drop_leaf(node)
        return block

    def evict_device_run(self, node: Node, limit: int) -> tuple[Node, list[int]]:
        """:meth:`evict_device_leaf` of ``node`` and, up to ``limit`` blocks in all, of the
        blocks above it in its segment that would be the next device victims anyway: no host
        copy, unlocked, unread, and a key below every candidate in the heap (the order
        :meth:`next_device_victim` takes them in). The segment's first block is left to
        :meth:`next_device_victim` (it unlinks a segment). One cut of the segment's lists, not
        one call per block: the eviction of a finished request's unique blocks.

        Returns the topmost evicted node and the blocks, top first."""
        seg = node.seg
        nodes = seg.nodes
        i = j = node.idx
        heap = self._device_heap
        bound = heap[0][0] if heap else None
        key = self._key
        while j > 1 and i - j + 1 < limit:
            p = nodes[j - 1]
            if (
                p.host_block is not None
                or p.lock_ref
                or p.device_reads
                or p.device_block is None
                or (bound is not None and not key(p) < bound)
            ):
                break
            j -= 1
        if j == i:
            return node, [self.evict_device_leaf(node)]
        assert node.host_block is None and not node.num_children and node.host_reads == 0, node
        assert node.lock_ref == 0 and node.device_reads == 0 and nodes[-1] is node, node
        run = nodes[j:]
        index = self.nodes
        blocks: list[int] = []
        ev = self.events if self.events is not None and self.events.enabled else None
        for n in run:
            del index[n.key]
            assert n.device_block is not None
            blocks.append(n.device_block)
            n.device_block = None
            if ev is not None:
                ev.emit(REMOVED, DEVICE, n.key)
        del nodes[j:], seg.keys[j:], seg.ends[j:]  # data is cut later (trimmed)
        above = nodes[j - 1]
        above.num_children = above.num_device_children = 0
        self.num_device_copies -= len(run)
        self.num_device_unlocked -= len(run)
        self.epoch += 1
        return run[0], blocks

    def set_host(self, node: Node, block: int, ready: bool) -> None:
        assert node.host_block is None and not node.is_root
        node.host_block = block
        node.host_ready = ready
        if ready:
            self._emit(STORED, HOST, node)
        self.num_host_copies += 1
        assert node.parent is not None
        node.parent.num_host_children += 1
        self.maybe_candidate(node)

    def drop_host(self, node: Node) -> int:
        block = node.host_block
        assert block is not None and node.host_reads == 0 and not node.putting
        if node.host_ready:
            self._emit(REMOVED, HOST, node)
        node.host_block = None
        node.host_ready = False
        self.epoch += 1
        node.evict_host_after_copy = False
        self.num_host_copies -= 1
        parent = node.parent
        assert parent is not None
        parent.num_host_children -= 1
        self.maybe_candidate(parent)
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
        if (
            not node.in_device_heap
            and node.device_block is not None
            and not node.lock_ref
            and not node.num_device_children
            and node.device_evictable()
        ):
            node.in_device_heap = True
            self._push(self._device_heap, node)
        if not node.in_host_heap and node.host_block is not None and node.host_evictable():
            node.in_host_heap = True
            self._push(self._host_heap, node)

    def _push(self, heap: list, node: Node) -> None:
        heapq.heappush(heap, (self._key(node), next(self._seq), node))
        if len(heap) > 2 * len(self.nodes) + 4096:  # dead entries piled up: start over
            self._rebuild()

    def _rebuild(self) -> None:
        for heap, flag, is_candidate in (
            (self._device_heap, "in_device_heap", Node.device_evictable),
            (self._host_heap, "in_host_heap", Node.host_evictable),
        ):
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
