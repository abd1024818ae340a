"""KV events: which blocks an engine holds, per tier, as a numbered stream (what a router indexes).

Every change of a block's copies in the radix tree is one event ``(seq, kind, tier, key)``:
``kind`` is ``stored`` (a readable copy appeared: a computed block committed, a load landed, a
backup to the host tier landed) or ``removed`` (the copy went away: evicted, dropped), ``tier``
``device`` or ``host``, ``key`` the block's chained key (hex; cache/keys.py: the same key any
process derives from the tokens, the cache_salt and the model fingerprint). ``seq`` counts from
1 without gaps. Storage is not here: the pool is shared, and it is asked for directly.

Nothing is recorded until someone asks (:meth:`KVEvents.enable`): an engine that nobody routes
pays one attribute test per tree change. The buffer is bounded: a reader that asks for events
older than the oldest kept gets ``None`` (a gap) and resynchronizes from :meth:`snapshot`, whose
``seq`` says which events it already includes. Pure Python, no torch (as cache/).
"""

from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Mapping, Protocol


class BlockCopies(Protocol):
    """What :meth:`KVEvents.snapshot` reads of a tree node (cache/tree.py's ``Node``)."""

    @property
    def key(self) -> bytes: ...
    @property
    def device_block(self) -> int | None: ...
    @property
    def host_block(self) -> int | None: ...
    @property
    def host_ready(self) -> bool: ...


class Nodes(Protocol):
    """What :meth:`KVEvents.snapshot` reads of the radix tree (cache/tree.py's ``RadixTree``)."""

    @property
    def nodes(self) -> Mapping[bytes, BlockCopies]: ...


STORED, REMOVED = "stored", "removed"
DEVICE, HOST = "device", "host"
DEFAULT_CAPACITY = 200_000  # events kept (~50 bytes each)


class KVEvents:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 event, got {capacity}")
        self.enabled = False
        self.seq = 0  # the last event's number
        self._buf: deque[tuple[int, str, str, bytes]] = deque(maxlen=capacity)

    def enable(self) -> None:
        self.enabled = True

    def emit(self, kind: str, tier: str, key: bytes) -> None:
        self.seq += 1
        self._buf.append((self.seq, kind, tier, key))

    def since(self, seq: int, limit: int = 10_000) -> list[list] | None:
        """Events numbered after ``seq`` (at most ``limit``, oldest first), as
        ``[seq, kind, tier, key hex]``; None if some of them are no longer kept."""
        if seq < 0 or seq > self.seq:
            raise ValueError(f"seq must be in 0..{self.seq}, got {seq}")
        if seq == self.seq:
            return []
        buf = self._buf
        if not buf or buf[0][0] > seq + 1:
            return None
        start = seq + 1 - buf[0][0]
        # islice walks the deque once (an index into its middle walks it each time)
        return [[s, kind, tier, key.hex()] for s, kind, tier, key in islice(buf, start, start + limit)]

    def snapshot(self, tree: Nodes) -> dict:
        """Every readable copy now, and the number of the last event it includes."""
        device, host = [], []
        for node in tree.nodes.values():
            if node.device_block is not None:
                device.append(node.key.hex())
            if node.host_block is not None and node.host_ready:
                host.append(node.key.hex())
        return {"seq": self.seq, "device": device, "host": host}
