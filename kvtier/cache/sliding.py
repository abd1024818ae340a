"""Sliding-window groups: the blocks of layers that see only the last ``window`` positions.

A model whose layers attend in groups (ModelConfig.attention_groups: gpt-oss, Gemma 2/3) keeps
the full group's KV in the device blocks the block table and the radix tree manage
(cache/table.py), and each sliding group's KV in blocks of its own, a *slot* per device block::

    device block table   [ d0 d1 d2 d3 d4 d5 d6 d7 ]        full layers: every block
    slot_of[d]           [  -  -  -  -  s9 s2 s5 s7 ]        sliding layers: the window's blocks
                                      ^ first_needed(num_computed): a query at p >= num_computed
                                        reads keys >= p - window + 1

A running request *holds* the slots of its blocks from ``first_needed`` on and lets the others go
as its window moves past them (a 100K-token request holds window / block_size + 1 slots in
decode, a chunk's more while it prefills). A slot no request holds is freed, or, if its block is
in the tree (committed), *retained*: it still serves hits (a shared system prompt, a chat's next
turn) until a request needs the slot, least recently retained first, as vLLM's freed blocks keep
their hash until reused. A device block leaving the device tier takes its slot.

A prefix hit of ``k`` blocks is exact only if every sliding group has the slots of blocks
``first_needed(k * block_size) .. k - 1``: recomputing just the missing window would not do, since
a sliding layer's KV at position p depends on the earlier sliding layers' KV over the window
before p (L sliding layers reach back L windows). :meth:`SlidingGroup.longest_hit` walks the
match back to the longest prefix whose windows are all present (a node without its slot still
serves the full layers of a longer hit whose window is present further on).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from kvtier.cache.pool import BlockPool


class SlidingGroup:
    """One sliding group's slots: a pool of ``num_slots`` and the slot of each of
    ``num_device_blocks`` device blocks (-1: none)."""

    def __init__(self, window: int, block_size: int, num_slots: int, num_device_blocks: int) -> None:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"sliding window must be a positive number of positions, got {window!r}")
        self.window, self.block_size = window, block_size
        self.pool = BlockPool(num_slots, "sliding")
        self.slot_of = [-1] * num_device_blocks
        self.holders = [0] * num_device_blocks  # running requests that read the block's slot
        self.retained: OrderedDict[int, None] = OrderedDict()  # device blocks whose slot only the tree keeps

    @property
    def blocks_per_window(self) -> int:
        """Slots a decoding request holds at most: the blocks a window can straddle."""
        return -(-self.window // self.block_size) + 1

    def first_needed(self, num_computed: int) -> int:
        """Index of the first block a query at a position >= ``num_computed`` reads."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def longest_hit(self, device_blocks: Sequence[int], num_blocks: int) -> int:
        """The longest ``k <= num_blocks`` such that the blocks a hit of ``k`` blocks reads in
        this group (``first_needed(k * block_size) .. k - 1`` of ``device_blocks``) have slots."""
        slot_of = self.slot_of
        k = num_blocks
        while k > 0:
            lo = self.first_needed(k * self.block_size)
            missing = [j for j in range(lo, k) if slot_of[device_blocks[j]] < 0]
            if not missing:
                return k
            k = missing[-1]  # a hit ending at or before the last missing block
        return 0

    # ------------------------------------------------------------------ holding
    def hold(self, device_blocks: Sequence[int]) -> bool:
        """A request reads these blocks' slots: keep (or give) each one. False, with nothing
        changed, when the pool cannot give the missing ones even after dropping retained slots."""
        missing = [b for b in device_blocks if self.slot_of[b] < 0]
        retained_here = sum(1 for b in device_blocks if b in self.retained)
        if len(missing) > self.pool.num_free + len(self.retained) - retained_here:
            return False
        for b in device_blocks:
            self.retained.pop(b, None)
        while len(missing) > self.pool.num_free:
            self._drop_slot(self.retained.popitem(last=False)[0])
        for b, slot in zip(missing, self.pool.allocate(len(missing))):
            self.slot_of[b] = slot
        for b in device_blocks:
            self.holders[b] += 1
        return True

    def release(self, device_blocks: Sequence[int], keep: Sequence[int] = ()) -> None:
        """A request no longer reads these blocks' slots: a slot nobody else reads is freed, or,
        for the blocks in ``keep`` (tree-owned, its last window), retained for later hits."""
        keeping = set(keep)
        for b in device_blocks:
            assert self.holders[b] > 0, f"device block {b} released by a request that did not hold it"
            self.holders[b] -= 1
            if self.holders[b] == 0:
                if b in keeping:
                    self.retained[b] = None
                else:
                    self._drop_slot(b)

    def replace(self, own: int, kept: int) -> None:
        """A request computed device block ``own`` again and keeps the tree's ``kept`` instead:
        its hold moves to ``kept``, with ``own``'s slot if ``kept`` has none."""
        if self.slot_of[kept] < 0:
            self.slot_of[kept], self.slot_of[own] = self.slot_of[own], -1
            self.holders[kept] += 1
            self.holders[own] -= 1
            assert self.holders[own] == 0, f"device block {own} is a request's own, read by another"
        else:
            self.hold((kept,))
            self.release((own,))

    def drop_device_blocks(self, device_blocks: Sequence[int]) -> None:
        """These device blocks went back to the device pool: their slots go too."""
        for b in device_blocks:
            if self.slot_of[b] >= 0:
                assert self.holders[b] == 0, f"device block {b} freed while a request reads its sliding slot"
                self.retained.pop(b, None)
                self._drop_slot(b)

    def _drop_slot(self, b: int) -> None:
        self.pool.free_one(self.slot_of[b])
        self.slot_of[b] = -1

    def table(self, device_blocks: Sequence[int], first: int) -> list[int]:
        """The group's block table for a request's ``device_blocks``: slots from block ``first``
        on, 0 before it (never read: attention starts at the window's first block)."""
        slot_of = self.slot_of
        return [0] * first + [slot_of[b] for b in device_blocks[first:]]

    def assert_invariants(self) -> None:
        """Every slot is free or the slot of exactly one device block; a retained block has a
        slot and no holder; a held block has a slot."""
        used = [s for s in self.slot_of if s >= 0]
        assert len(used) == len(set(used)) == self.pool.num_used, "a sliding slot is lost or shared"
        assert all(not self.pool.is_free(s) for s in used)
        for b in self.retained:
            assert self.slot_of[b] >= 0 and self.holders[b] == 0, b
        for b, n in enumerate(self.holders):
            assert n >= 0 and (n == 0 or self.slot_of[b] >= 0), b


class DevicePool(BlockPool):
    """The device tier's pool, telling the sliding groups when a device block goes back."""

    __slots__ = ("groups",)

    def __init__(self, num_blocks: int, groups: Sequence[SlidingGroup]) -> None:
        super().__init__(num_blocks, "device")
        self.groups = tuple(groups)

    def free(self, blocks: list[int] | tuple[int, ...]) -> None:
        super().free(blocks)
        for g in self.groups:
            g.drop_device_blocks(blocks)

    def free_one(self, b: int) -> None:
        super().free_one(b)
        for g in self.groups:
            g.drop_device_blocks((b,))
