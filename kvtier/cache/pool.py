"""Block allocators for the device and host tiers: O(1) allocate/free, loud on misuse."""

from __future__ import annotations


class DoubleFreeError(RuntimeError):
    """A block was freed twice, or a block id that this pool never handed out was freed."""


class BlockPool:
    """A fixed set of block ids ``0..num_blocks-1`` of one tier.

    Free ids sit on a stack (LIFO: a block freed last is reused first, still warm in caches);
    ``_is_free`` catches a double free in O(1).
    """

    __slots__ = ("tier", "num_blocks", "_free", "_is_free")

    def __init__(self, num_blocks: int, tier: str = "device") -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"{tier} pool size must be a non-negative int, got {num_blocks!r}")
        self.tier = tier
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, … first
        self._is_free = bytearray(b"\x01") * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` distinct free block ids; raises MemoryError if fewer are free (nothing taken)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise MemoryError(f"{self.tier} pool: {n} blocks requested, {len(self._free)} free")
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        is_free = self._is_free
        for b in out:
            is_free[b] = 0
        out.reverse()
        return out

    def allocate_one(self) -> int:
        if not self._free:
            raise MemoryError(f"{self.tier} pool: no free block")
        b = self._free.pop()
        self._is_free[b] = 0
        return b

    def free(self, blocks: list[int] | tuple[int, ...]) -> None:
        """Return blocks; the whole call is refused (nothing freed) if any id is bad or free."""
        is_free, n = self._is_free, self.num_blocks
        for i, b in enumerate(blocks):
            if not (isinstance(b, int) and 0 <= b < n) or is_free[b]:
                for done in blocks[:i]:  # undo: nothing freed
                    is_free[done] = 0
                if not (isinstance(b, int) and 0 <= b < n):
                    raise DoubleFreeError(f"{self.tier} pool: block id {b!r} is not in 0..{n - 1}")
                if b in blocks[:i]:
                    raise DoubleFreeError(f"{self.tier} pool: a block appears twice in one free: {sorted(blocks)}")
                raise DoubleFreeError(f"{self.tier} pool: block {b} freed twice")
            is_free[b] = 1
        self._free.extend(reversed(blocks))

    def free_one(self, b: int) -> None:
        if not (isinstance(b, int) and 0 <= b < self.num_blocks):
            raise DoubleFreeError(f"{self.tier} pool: block id {b!r} is not in 0..{self.num_blocks - 1}")
        if self._is_free[b]:
            raise DoubleFreeError(f"{self.tier} pool: block {b} freed twice")
        self._is_free[b] = 1
        self._free.append(b)

    def is_free(self, b: int) -> bool:
        return bool(self._is_free[b])

    def free_blocks(self) -> list[int]:
        """The free block ids, in the order :meth:`allocate` hands them out."""
        return self._free[::-1]
